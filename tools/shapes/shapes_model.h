#pragma once

// The shapes captioner: a tiny Qwen2-VL trained on vlmgen::shapes scenes, the files of its
// checkpoint directory, and the glue that turns pictures into prompts and captions.
//
//   auto captioner = vlmgen::shapes::ShapesCaptioner::load(vlmgen::shapes::default_checkpoint_dir(src));
//   auto run = captioner.caption(images, vlmgen::GenerationConfig().enable_kv_cache(false));
//   // run.captions[i]: "a red circle top left"
//
// A checkpoint directory holds what a real Qwen2-VL directory holds, so the model loads through
// Qwen2Vl::from_checkpoint like any other: config.json and model.safetensors (the model),
// preprocessor_config.json (the image processor's settings, HF field names) and vocab.txt (the
// word tokenizer).

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "shapes/shapes_data.h"
#include "shapes/word_tokenizer.h"
#include "vlmgen/generator.h"
#include "vlmgen/image/preprocessor_config.h"
#include "vlmgen/image/qwen_image_processor.h"
#include "vlmgen/models/qwen2_vl.h"
#include "vlmgen/models/qwen_vl_config.h"
#include "vlmgen/vision_inputs.h"

namespace vlmgen::shapes {

inline constexpr const char* kVocabFile = "vocab.txt";
inline constexpr const char* kPreprocessorFile = kPreprocessorConfigFile;

/// `source_dir`/models/shapes-vlm: where the repository ships the trained checkpoint.
std::string default_checkpoint_dir(const std::string& source_dir);

/// The architecture of the shipped model: a Qwen2-VL of about 0.5M parameters whose vision tower
/// turns a `image_size` x `image_size` picture into 9 merged tokens (16-pixel patches, merge 2),
/// one per grid cell for the default 96 pixels, with the token ids of `tokenizer`.
QwenVlConfig model_config(const WordTokenizer& tokenizer, int64_t image_size = 96);

/// Processor settings that keep a `image_size` square picture at its size (min_pixels =
/// max_pixels = image_size^2) with the model's patch, temporal patch and merge sizes.
QwenImageProcessorOptions processor_options(const QwenVlConfig& config, int64_t image_size);

/// Writes / reads `dir`/preprocessor_config.json with HF's field names (patch_size,
/// temporal_patch_size, merge_size, min_pixels, max_pixels, image_mean, image_std,
/// rescale_factor). load throws vlmgen::Error naming a missing or malformed field.
void save_processor_options(const std::string& dir, const QwenImageProcessorOptions& options);
QwenImageProcessorOptions load_processor_options(const std::string& dir);

/// One teacher-forced training batch: right-padded prompt + caption + <eos> rows.
struct TrainingBatch {
  at::Tensor input_ids;       // [B, L], int64, CPU: prompt, caption words, <eos>, then <pad>
  at::Tensor attention_mask;  // [B, L], int64, CPU: 1 up to and including <eos>, 0 after
  at::Tensor labels;          // [B, L], int64, CPU: next token at caption positions, -100 elsewhere
  VisionInputs vision;        // one image per row, in row order
  int64_t target_tokens = 0;  // labels that are not -100
};

/// Builds the batch of `scenes`: row b predicts scene b's caption words and <eos> from its
/// image prompt (labels[b][t] is the token at t + 1, so logits at t are scored against it).
TrainingBatch make_training_batch(const std::vector<Scene>& scenes, const WordTokenizer& tokenizer,
                                  const QwenImageProcessorOptions& processor, int64_t placeholders_per_image);

/// Captions of one batch of pictures, with the generator's statistics.
struct CaptionRun {
  std::vector<std::string> captions;      // one per picture, special tokens left out
  std::vector<std::vector<int64_t>> ids;  // the generated ids, <eos> included when reached
  GenerationStats stats;                  // summed over the generate calls
};

/// The shipped model with its tokenizer and image settings.
class ShapesCaptioner {
 public:
  /// Loads a checkpoint directory: the model through Qwen2Vl::from_checkpoint, vocab.txt and
  /// preprocessor_config.json. Throws vlmgen::Error when a file is missing or the tokenizer
  /// disagrees with the config (vocabulary size, image token ids).
  static ShapesCaptioner load(const std::string& dir);

  ShapesCaptioner(std::unique_ptr<Qwen2Vl> model, WordTokenizer tokenizer, const QwenImageProcessorOptions& processor);

  /// Side of the square the model sees: pictures of another size are resized to it (bicubic,
  /// aspect ratio not kept, as the model only ever saw squares).
  int64_t image_size() const { return image_size_; }
  /// Merged image tokens per picture.
  int64_t placeholders_per_image() const { return placeholders_; }

  /// Vision inputs of `images` (resized to image_size() when needed).
  VisionInputs vision_inputs(const std::vector<Image>& images) const;

  /// Captions `images`, `batch_size` per generate call (0 = all at once). `config` supplies
  /// everything but the end and pad tokens, which come from the tokenizer (<eos>, <pad>); its
  /// default max_new_tokens (16) covers any two-shape caption (at most 11 words and <eos>).
  CaptionRun caption(const std::vector<Image>& images, GenerationConfig config = GenerationConfig(),
                     int64_t batch_size = 0);

  Qwen2Vl& model() { return *model_; }
  const WordTokenizer& tokenizer() const { return tokenizer_; }
  const QwenImageProcessorOptions& processor() const { return processor_; }

 private:
  std::unique_ptr<Qwen2Vl> model_;
  WordTokenizer tokenizer_;
  QwenImageProcessorOptions processor_;
  int64_t image_size_ = 0;
  int64_t placeholders_ = 0;
};

}  // namespace vlmgen::shapes
