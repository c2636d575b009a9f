#pragma once

// Chat messages with images → the prompt ids and the vision bundle a Generator takes, rendered
// the way the checkpoint's own chat template renders them. No Jinja engine: the template a
// checkpoint ships is recognized (byte for byte) as one vlmgen implements, and anything else is
// refused with an error that says so.
//
//   auto chat = vlmgen::ChatProcessor::from_pretrained(dir, tokenizer, image_options);
//   std::vector<vlmgen::ChatMessage> messages = {
//       vlmgen::ChatMessage("user").image_file("beach.jpg").text("Describe this image.")};
//   vlmgen::ChatPrompt prompt = chat.build(messages);
//   generator.generate({{prompt.ids}, prompt.vision}, config);

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "vlmgen/image/gemma3_image_processor.h"
#include "vlmgen/image/image.h"
#include "vlmgen/image/qwen_image_processor.h"
#include "vlmgen/text/tokenizer.h"
#include "vlmgen/vision_inputs.h"

namespace vlmgen {

/// One part of a message's content: text, or an image given as a file, as encoded PNG/JPEG
/// bytes, as decoded pixels, or as a placeholder filled from the `images` argument of
/// ChatProcessor::build in order (the HF processor's way).
struct ContentPart {
  enum class Kind { kText, kImageFile, kImageBytes, kImagePixels, kImagePlaceholder };
  Kind kind = Kind::kText;
  std::string text;                     ///< kText: the text; kImageFile: the path; kImageBytes: the bytes
  std::shared_ptr<const Image> pixels;  ///< kImagePixels

  bool is_image() const { return kind != Kind::kText; }
};

/// One message: a role ("system", "user", "assistant") and its content, either one string or a
/// list of parts. Builders chain:
///   ChatMessage("user").image_file("a.png").text("What is this?")
struct ChatMessage {
  ChatMessage() = default;
  explicit ChatMessage(std::string role_) : role(std::move(role_)) {}
  /// A message whose content is one string (rendered as the template renders string content).
  ChatMessage(std::string role_, std::string text_) : role(std::move(role_)), content_is_string(true) {
    content.push_back(ContentPart{ContentPart::Kind::kText, std::move(text_), nullptr});
  }

  ChatMessage& text(std::string value);
  ChatMessage& image_file(std::string path);
  ChatMessage& image_bytes(std::string encoded);
  ChatMessage& image(Image pixels);
  /// A decoded picture as a tensor: [height, width, 3], uint8, RGB (copied; vlmgen::Error for
  /// another shape or dtype).
  ChatMessage& image(const at::Tensor& hwc_rgb);
  ChatMessage& image_placeholder();

  std::string role;
  std::vector<ContentPart> content;
  bool content_is_string = false;  ///< content is one text part given as a plain string
};

/// Options of one rendering.
struct ChatOptions {
  /// End with the header of an assistant turn, so the model answers. Default true.
  bool add_generation_prompt = true;
  /// Write "Picture N: " before each image (the Qwen-VL templates' add_vision_id). Default false.
  bool add_vision_id = false;
};

/// A piece of a rendered conversation: text, or the image with index `image` (0-based, counting
/// every image of the conversation in order).
struct ChatSegment {
  std::string text;
  int64_t image = -1;
};

/// A chat template vlmgen recognizes.
class ChatTemplate {
 public:
  /// The template of a checkpoint folder: chat_template.jinja, else chat_template.json, else
  /// tokenizer_config.json's "chat_template". Throws vlmgen::Error when there is none or it is
  /// not one vlmgen renders.
  static ChatTemplate from_pretrained(const std::string& dir);
  /// Recognizes a template's source text; `what` names it in errors.
  static ChatTemplate from_source(const std::string& source, const std::string& what = "chat template");
  /// The Qwen2-VL template (as Qwen2-VL-Instruct checkpoints ship it).
  static ChatTemplate qwen2_vl();
  /// The Gemma-3 template (as the gemma-3-*-it checkpoints ship it): `<bos>`, then
  /// `<start_of_turn>user` / `<start_of_turn>model` turns closed by `<end_of_turn>`, the system
  /// message put before the first user message's text, roles checked to alternate, text trimmed,
  /// each image written `<start_of_image>`.
  static ChatTemplate gemma3();

  /// Name of the recognized template, e.g. "qwen2-vl" or "gemma3".
  const std::string& name() const { return name_; }

  /// How the template writes a message's text content (Gemma-3 trims it; Qwen2-VL keeps it).
  std::string rendered_text(const std::string& text) const;

  /// Renders messages [first, end) as they appear inside the rendering of all of `messages`
  /// (so image numbers and the default system prompt account for the earlier ones), plus the
  /// generation prompt when asked. Each image is one segment; text is merged.
  std::vector<ChatSegment> render(const std::vector<ChatMessage>& messages, const ChatOptions& options,
                                  size_t first = 0) const;
  /// The rendering as one string, each image written as the template writes it (Qwen-VL:
  /// `<|vision_start|><|image_pad|><|vision_end|>`), as a Jinja engine would render it.
  std::string render_text(const std::vector<ChatMessage>& messages, const ChatOptions& options, size_t first = 0) const;

 private:
  explicit ChatTemplate(std::string name) : name_(std::move(name)) {}
  std::string name_;
};

/// Prompt ids and images of one rendering.
struct ChatPrompt {
  std::vector<int64_t> ids;
  VisionInputs vision;  ///< the images of the rendered messages, in order (empty if none)
  int64_t num_images = 0;
};

/// Token ids a prompt uses for an image: a start token, `image_pad` once per placeholder, an end
/// token (Qwen-VL: <|vision_start|> <|image_pad|>... <|vision_end|>; Gemma-3: <start_of_image>
/// <image_soft_token>... <end_of_image>).
struct VisionTokenIds {
  int64_t vision_start = -1;  // -1: not set (no token has it)
  int64_t image_pad = -1;
  int64_t vision_end = -1;
  int64_t video_pad = -1;  ///< Qwen-VL's <|video_pad|> where the tokenizer has it: refused in text (no videos yet)
};

/// How a model family writes images into a prompt and preprocesses them: what the family's HF
/// processor does after the chat template has rendered the text.
struct ChatImageFormat {
  std::string name;  ///< "qwen-vl" or "gemma3"
  VisionTokenIds tokens;
  /// Text the processor writes around each image's tokens (Gemma-3: "\n\n" each side),
  /// tokenized together with the text next to it.
  std::string text_before, text_after;
  /// Images → the vision bundle.
  std::function<VisionInputs(const std::vector<Image>&)> preprocess;
  /// Placeholder tokens of each image of a bundle.
  std::function<std::vector<int64_t>(const VisionInputs&)> placeholder_counts;

  /// Qwen-VL: `options`' resizing, t·h·w / merge² placeholders per image. The tokens come from
  /// `tokenizer` (vlmgen::Error when it lacks them).
  static ChatImageFormat qwen_vl(const Tokenizer& tokenizer, QwenImageProcessorOptions options);
  /// Gemma-3 (Gemma3Processor): each image resized to `options.size`, `tokens_per_image`
  /// placeholders (the model's mm_tokens_per_image), "\n\n" before and after.
  static ChatImageFormat gemma3(const Tokenizer& tokenizer, Gemma3ImageProcessorOptions options,
                                int64_t tokens_per_image);
  /// The format of a checkpoint folder's family (config.json's model_type), with its
  /// preprocessor_config.json's settings; `source` (when given) says where they came from.
  /// vlmgen::Error for a family vlmgen writes no chat prompts for (LLaVA-NeXT).
  static ChatImageFormat from_pretrained(const std::string& dir, const Tokenizer& tokenizer,
                                         std::string* source = nullptr);
};

/// Tokenizer + chat template + image preprocessing: messages in, a request's prompt out.
class ChatProcessor {
 public:
  /// Keeps a reference to `tokenizer`, which must outlive this object.
  ChatProcessor(const Tokenizer& tokenizer, ChatTemplate chat_template, ChatImageFormat image_format);
  /// A Qwen-VL processor (ChatImageFormat::qwen_vl).
  ChatProcessor(const Tokenizer& tokenizer, ChatTemplate chat_template, QwenImageProcessorOptions image_options);
  /// The template of `dir` (ChatTemplate::from_pretrained) with `tokenizer` and the images' format.
  static ChatProcessor from_pretrained(const std::string& dir, const Tokenizer& tokenizer,
                                       ChatImageFormat image_format);
  static ChatProcessor from_pretrained(const std::string& dir, const Tokenizer& tokenizer,
                                       QwenImageProcessorOptions image_options);

  const Tokenizer& tokenizer() const { return tokenizer_; }
  const ChatTemplate& chat_template() const { return template_; }
  const VisionTokenIds& vision_tokens() const { return format_.tokens; }
  const ChatImageFormat& image_format() const { return format_; }

  /// Renders messages [first, end) (see ChatTemplate::render), loads and preprocesses their
  /// images, and returns the ids with each image's placeholder run expanded to its token count
  /// (Qwen-VL: t·h·w / merge²; Gemma-3: mm_tokens_per_image). Image placeholder parts take `images` in order; giving
  /// more or fewer images than there are placeholder parts is an error. Images are checked before any is decoded;
  /// errors name the message and part.
  ChatPrompt build(const std::vector<ChatMessage>& messages, const ChatOptions& options = ChatOptions(),
                   const std::vector<Image>& images = {}, size_t first = 0) const;

 private:
  friend class ChatSession;
  ChatPrompt assemble(const std::vector<ChatSegment>& segments, const std::vector<ChatMessage>& messages,
                      const std::vector<Image>& images, size_t first) const;

  const Tokenizer& tokenizer_;
  ChatTemplate template_;
  ChatImageFormat format_;
};

/// A multi-turn conversation kept in step with one InferenceContext: each turn's ids are the
/// ids of every earlier turn (prompts and generated tokens, exactly as computed) followed by the
/// new turn's, so a context holding the earlier columns computes only the new ones, and the
/// request's vision bundle holds every image so far (the generator sends only those in the
/// window it computes).
///
///   vlmgen::ChatSession chat(processor);
///   auto turn = chat.add_user(vlmgen::ChatMessage("user").image_file("a.png").text("Hi"));
///   auto out = gen.generate({{turn.ids}, turn.vision, &context}, config);
///   chat.add_reply(out.sequences[0].tokens);
class ChatSession {
 public:
  explicit ChatSession(const ChatProcessor& processor, ChatOptions options = ChatOptions());

  struct Turn {
    std::vector<int64_t> ids;  ///< the whole conversation's ids
    VisionInputs vision;       ///< every image of the conversation
    int64_t new_ids = 0;       ///< ids added by this turn (the end of `ids`)
    int64_t new_images = 0;    ///< images added by this turn (the end of `vision`)
  };

  /// Adds messages (a user message; a system message before the first one) and the generation
  /// prompt. Throws vlmgen::Error, leaving the session unchanged, on bad input or when a reply
  /// is still expected.
  Turn add(std::vector<ChatMessage> new_messages);
  Turn add_user(ChatMessage message) { return add({std::move(message)}); }
  /// Records the reply generated for the last turn: its tokens as the generator returned them.
  /// A special token at the end (the end token the generator stopped at, never computed into a
  /// context) is left out: the next turn's ids close the reply the way the template does.
  /// The reply's ids stay exactly as generated even where the template would write its text
  /// differently (Gemma-3 trims a reply's leading and trailing whitespace): the context holds
  /// what was computed, so a conversation continued here can differ from a one-shot rendering
  /// of it by that whitespace.
  void add_reply(const std::vector<int64_t>& tokens);

  const std::vector<int64_t>& ids() const { return ids_; }
  const std::vector<ChatMessage>& messages() const { return messages_; }
  int64_t num_images() const { return num_images_; }

 private:
  const ChatProcessor& processor_;
  ChatOptions options_;
  std::vector<ChatMessage> messages_;
  std::vector<int64_t> ids_;
  VisionInputs vision_;
  int64_t num_images_ = 0;
  size_t first_open_ = 0;  // first message whose rendering is not wholly in ids_
  std::string open_text_;  // text of messages [first_open_, end) already in ids_
  bool awaiting_reply_ = false;
};

/// The token ids that end a reply for the checkpoint in `dir`: generation_config.json's and
/// config.json's eos_token_id (a number or a list) and tokenizer_config.json's eos_token,
/// without repeats. Throws vlmgen::Error when none is found.
std::vector<int64_t> end_token_ids_from_pretrained(const std::string& dir, const Tokenizer& tokenizer);

}  // namespace vlmgen
