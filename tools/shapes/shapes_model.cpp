#include "shapes/shapes_model.h"

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <utility>

#include "vlmgen/error.h"
#include "vlmgen/image/preprocessor_config.h"

namespace vlmgen::shapes {

std::string default_checkpoint_dir(const std::string& source_dir) {
  return (std::filesystem::path(source_dir) / "models" / "shapes-vlm").string();
}

QwenVlConfig model_config(const WordTokenizer& tokenizer, int64_t image_size) {
  QwenVlConfig c;
  // Sized to train to >95% exact captions in a few minutes on two CPU cores: wide enough for
  // two shapes per picture, two layers deep so the caption can attend back to the image.
  c.hidden_size = 96;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 24;
  c.intermediate_size = 256;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 10000.0;
  c.mrope_section = {4, 4, 4};
  c.vocab_size = tokenizer.size();
  c.max_position_embeddings = 256;
  c.tie_word_embeddings = true;
  c.image_token_id = tokenizer.image_pad_id();
  c.video_token_id = tokenizer.video_pad_id();
  c.vision_start_token_id = tokenizer.vision_start_id();
  c.vision_end_token_id = tokenizer.vision_end_id();
  c.vision.depth = 2;
  c.vision.embed_dim = 64;
  c.vision.num_heads = 4;
  c.vision.mlp_ratio = 2;
  c.vision.in_channels = 3;
  c.vision.patch_size = 16;
  c.vision.temporal_patch_size = 2;
  c.vision.spatial_merge_size = 2;
  c.vision.hidden_size = c.hidden_size;
  c.vision.hidden_act = "quick_gelu";
  const int64_t factor = c.vision.patch_size * c.vision.spatial_merge_size;
  VLMGEN_CHECK(image_size >= factor && image_size % factor == 0,
               "image_size must be a positive multiple of patch_size * merge_size = {}, got {}", factor, image_size);
  return c;
}

QwenImageProcessorOptions processor_options(const QwenVlConfig& config, int64_t image_size) {
  return QwenImageProcessorOptions()
      .patch_size(config.vision.patch_size)
      .temporal_patch_size(config.vision.temporal_patch_size)
      .merge_size(config.vision.spatial_merge_size)
      .min_pixels(image_size * image_size)
      .max_pixels(image_size * image_size);
}

void save_processor_options(const std::string& dir, const QwenImageProcessorOptions& options) {
  save_preprocessor_config(dir, options);
}

QwenImageProcessorOptions load_processor_options(const std::string& dir) {
  std::optional<QwenImageProcessorOptions> options = load_preprocessor_config(dir);
  VLMGEN_CHECK(options.has_value(), "{} has no {}: the captioner's image size is set there", dir,
               kPreprocessorConfigFile);
  return *options;
}

TrainingBatch make_training_batch(const std::vector<Scene>& scenes, const WordTokenizer& tokenizer,
                                  const QwenImageProcessorOptions& processor, int64_t placeholders_per_image) {
  VLMGEN_CHECK(!scenes.empty(), "a training batch needs at least one scene");
  const std::vector<int64_t> prompt = tokenizer.image_prompt(placeholders_per_image);
  const int64_t prompt_len = static_cast<int64_t>(prompt.size());
  std::vector<std::vector<int64_t>> rows;
  std::vector<Image> images;
  int64_t longest = 0;
  for (const Scene& scene : scenes) {
    std::vector<int64_t> row = prompt;
    const std::vector<int64_t> caption = tokenizer.encode(scene.caption);
    row.insert(row.end(), caption.begin(), caption.end());
    row.push_back(tokenizer.eos_id());
    longest = std::max<int64_t>(longest, static_cast<int64_t>(row.size()));
    rows.push_back(std::move(row));
    images.push_back(scene.image);
  }

  TrainingBatch batch;
  batch.vision = preprocess(images, processor);
  for (int64_t count : batch.vision.placeholder_counts(processor.merge_size())) {
    VLMGEN_CHECK(count == placeholders_per_image,
                 "a {}x{} scene becomes {} image tokens with these processor settings, but the prompt holds {}",
                 images[0].height, images[0].width, count, placeholders_per_image);
  }
  const int64_t b = static_cast<int64_t>(rows.size());
  batch.input_ids = at::full({b, longest}, tokenizer.pad_id(), at::kLong);
  batch.attention_mask = at::zeros({b, longest}, at::kLong);
  batch.labels = at::full({b, longest}, -100, at::kLong);
  auto ids = batch.input_ids.accessor<int64_t, 2>();
  auto mask = batch.attention_mask.accessor<int64_t, 2>();
  auto labels = batch.labels.accessor<int64_t, 2>();
  for (int64_t r = 0; r < b; ++r) {
    const std::vector<int64_t>& row = rows[static_cast<size_t>(r)];
    const int64_t n = static_cast<int64_t>(row.size());
    for (int64_t t = 0; t < n; ++t) {
      ids[r][t] = row[static_cast<size_t>(t)];
      mask[r][t] = 1;
    }
    // The logits at the last prompt column predict the first word; those at the last word, <eos>.
    for (int64_t t = prompt_len - 1; t + 1 < n; ++t) {
      labels[r][t] = row[static_cast<size_t>(t + 1)];
      ++batch.target_tokens;
    }
  }
  return batch;
}

ShapesCaptioner ShapesCaptioner::load(const std::string& dir) {
  std::unique_ptr<Qwen2Vl> model = Qwen2Vl::from_checkpoint(dir);
  WordTokenizer tokenizer = WordTokenizer::load((std::filesystem::path(dir) / kVocabFile).string());
  QwenImageProcessorOptions processor = load_processor_options(dir);
  return ShapesCaptioner(std::move(model), std::move(tokenizer), processor);
}

ShapesCaptioner::ShapesCaptioner(std::unique_ptr<Qwen2Vl> model, WordTokenizer tokenizer,
                                 const QwenImageProcessorOptions& processor)
    : model_(std::move(model)), tokenizer_(std::move(tokenizer)), processor_(processor) {
  VLMGEN_CHECK(model_ != nullptr, "ShapesCaptioner needs a model");
  const QwenVlConfig& c = model_->config();
  VLMGEN_CHECK(tokenizer_.size() == c.vocab_size, "the vocabulary has {} tokens but the model's vocab_size is {}",
               tokenizer_.size(), c.vocab_size);
  VLMGEN_CHECK(tokenizer_.image_pad_id() == c.image_token_id && tokenizer_.video_pad_id() == c.video_token_id &&
                   tokenizer_.vision_start_id() == c.vision_start_token_id &&
                   tokenizer_.vision_end_id() == c.vision_end_token_id,
               "the vocabulary's image tokens (pad {}, video {}, start {}, end {}) differ from the config's ({}, {}, "
               "{}, {})",
               tokenizer_.image_pad_id(), tokenizer_.video_pad_id(), tokenizer_.vision_start_id(),
               tokenizer_.vision_end_id(), c.image_token_id, c.video_token_id, c.vision_start_token_id,
               c.vision_end_token_id);
  processor_.validate();
  VLMGEN_CHECK(processor_.patch_size() == c.vision.patch_size &&
                   processor_.temporal_patch_size() == c.vision.temporal_patch_size &&
                   processor_.merge_size() == c.vision.spatial_merge_size,
               "the processor's patch {}, temporal patch {} and merge {} differ from the model's {}, {}, {}",
               processor_.patch_size(), processor_.temporal_patch_size(), processor_.merge_size(), c.vision.patch_size,
               c.vision.temporal_patch_size, c.vision.spatial_merge_size);
  // The model only ever saw squares of max_pixels: the largest such square of whole merge windows.
  const int64_t factor = processor_.factor();
  int64_t side = factor;
  while ((side + factor) * (side + factor) <= processor_.max_pixels()) side += factor;
  VLMGEN_CHECK(side * side <= processor_.max_pixels() && side * side >= processor_.min_pixels(),
               "no square of whole {}-pixel merge windows has an area in [min_pixels {}, max_pixels {}]", factor,
               processor_.min_pixels(), processor_.max_pixels());
  image_size_ = side;
  const int64_t merged_side = side / factor;
  placeholders_ = merged_side * merged_side;
}

VisionInputs ShapesCaptioner::vision_inputs(const std::vector<Image>& images) const {
  std::vector<Image> sized;
  sized.reserve(images.size());
  for (const Image& image : images) {
    const bool fits = image.height == image_size_ && image.width == image_size_;
    sized.push_back(fits ? image : resize_bicubic(image, image_size_, image_size_));
  }
  return preprocess(sized, processor_);
}

CaptionRun ShapesCaptioner::caption(const std::vector<Image>& images, GenerationConfig config, int64_t batch_size) {
  VLMGEN_CHECK(batch_size >= 0, "batch_size must be >= 0 (0 = all at once), got {}", batch_size);
  config.end_token_ids({tokenizer_.eos_id()}).pad_token_id(tokenizer_.pad_id());
  CaptionRun run;
  const int64_t n = static_cast<int64_t>(images.size());
  if (n == 0) return run;
  const int64_t per_call = batch_size == 0 ? n : batch_size;
  Generator generator(*model_);
  double decode_s = 0.0;
  double decode_tokens = 0.0;
  for (int64_t first = 0; first < n; first += per_call) {
    const int64_t count = std::min(per_call, n - first);
    std::vector<Image> chunk(images.begin() + first, images.begin() + first + count);
    std::vector<std::vector<int64_t>> prompts(static_cast<size_t>(count), tokenizer_.image_prompt(placeholders_));
    GenerationResult result = generator.generate(GenerateRequest(std::move(prompts), vision_inputs(chunk)), config);
    for (const SequenceOutput& seq : result.sequences) {
      run.captions.push_back(tokenizer_.decode(seq.tokens));
      run.ids.push_back(seq.tokens);
    }
    GenerationStats& s = run.stats;
    const GenerationStats& r = result.stats;
    s.used_kv_cache = r.used_kv_cache;
    s.forward_calls += r.forward_calls;
    s.prompt_columns = std::max(s.prompt_columns, r.prompt_columns);
    s.generated_tokens += r.generated_tokens;
    s.images_encoded += r.images_encoded;
    s.time_to_first_token_s += r.time_to_first_token_s;
    s.total_s += r.total_s;
    // Each call's rate is its decode tokens over its decode time; recombine by weight.
    const double call_decode_s = r.total_s - r.time_to_first_token_s;
    decode_s += call_decode_s;
    decode_tokens += r.decode_tokens_per_s * call_decode_s;
  }
  run.stats.decode_tokens_per_s = decode_s > 0 ? decode_tokens / decode_s : 0.0;
  return run;
}

}  // namespace vlmgen::shapes
