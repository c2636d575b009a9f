// How each family writes images into chat prompts (ChatImageFormat), and the format of a
// checkpoint folder.

#include <filesystem>

#include "vlmgen/error.h"
#include "vlmgen/image/preprocessor_config.h"
#include "vlmgen/models/gemma3.h"
#include "vlmgen/models/load_model.h"
#include "vlmgen/models/qwen_vl_config.h"
#include "vlmgen/text/chat.h"

namespace vlmgen {

namespace {

int64_t required_token(const Tokenizer& tokenizer, const char* content, const char* family) {
  const auto id = tokenizer.token_id(content);
  VLMGEN_CHECK(id.has_value(), "the tokenizer has no {} token, which a {} chat prompt needs for each image", content,
               family);
  return *id;
}

}  // namespace

ChatImageFormat ChatImageFormat::qwen_vl(const Tokenizer& tokenizer, QwenImageProcessorOptions options) {
  options.validate();
  ChatImageFormat format;
  format.name = "qwen-vl";
  format.tokens = VisionTokenIds{required_token(tokenizer, "<|vision_start|>", "Qwen-VL"),
                                 required_token(tokenizer, "<|image_pad|>", "Qwen-VL"),
                                 required_token(tokenizer, "<|vision_end|>", "Qwen-VL")};
  format.tokens.video_pad = tokenizer.token_id("<|video_pad|>").value_or(-1);
  const int64_t merge = options.merge_size();
  format.preprocess = [options](const std::vector<Image>& images) { return vlmgen::preprocess(images, options); };
  format.placeholder_counts = [merge](const VisionInputs& v) { return v.placeholder_counts(merge); };
  return format;
}

ChatImageFormat ChatImageFormat::gemma3(const Tokenizer& tokenizer, Gemma3ImageProcessorOptions options,
                                        int64_t tokens_per_image) {
  VLMGEN_CHECK(tokens_per_image > 0, "Gemma-3 images need a positive number of tokens, got {}", tokens_per_image);
  ChatImageFormat format;
  format.name = "gemma3";
  format.tokens = VisionTokenIds{required_token(tokenizer, "<start_of_image>", "Gemma-3"),
                                 required_token(tokenizer, "<image_soft_token>", "Gemma-3"),
                                 required_token(tokenizer, "<end_of_image>", "Gemma-3")};
  // Gemma3Processor writes "\n\n<start_of_image>" + the image tokens + "<end_of_image>\n\n".
  format.text_before = "\n\n";
  format.text_after = "\n\n";
  format.preprocess = [options](const std::vector<Image>& images) { return preprocess_gemma3(images, options); };
  format.placeholder_counts = [tokens_per_image](const VisionInputs& v) {
    return std::vector<int64_t>(static_cast<size_t>(v.num_images()), tokens_per_image);
  };
  return format;
}

ChatImageFormat ChatImageFormat::from_pretrained(const std::string& dir, const Tokenizer& tokenizer,
                                                 std::string* source) {
  const std::string type = checkpoint_model_type(dir);
  const std::string config_path = (std::filesystem::path(dir) / "config.json").string();
  if (family_from_name(type)) {
    return qwen_vl(tokenizer, checkpoint_image_processor(dir, QwenVlConfig::from_file(config_path), source));
  }
  if (type == "gemma3" || type == "Gemma3ForConditionalGeneration") {
    const Gemma3Config config = Gemma3Config::from_file(config_path);
    const Gemma3ImageProcessorOptions options = gemma3_image_processor(dir, config.image_size);
    if (source != nullptr) *source = fmt::format("Gemma3ImageProcessor at {}x{}", options.size, options.size);
    return gemma3(tokenizer, options, config.mm_tokens_per_image);
  }
  VLMGEN_FAIL(
      "{}: chat prompts are written for the Qwen-VL families and Gemma-3 only; model_type {} is not one of them "
      "(give the model token ids instead)",
      dir, type);
}

}  // namespace vlmgen
