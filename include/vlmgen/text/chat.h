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
#include <memory>
#include <optional>
#include <string>
#include <vector>

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

  /// Name of the recognized template, e.g. "qwen2-vl".
  const std::string& name() const { return name_; }

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

/// Token ids a Qwen-VL prompt uses around an image.
struct VisionTokenIds {
  int64_t vision_start = 0;
  int64_t image_pad = 0;
  int64_t vision_end = 0;
};

/// Tokenizer + chat template + image preprocessing: messages in, a request's prompt out.
class ChatProcessor {
 public:
  /// Keeps a reference to `tokenizer`, which must outlive this object.
  ChatProcessor(const Tokenizer& tokenizer, ChatTemplate chat_template, QwenImageProcessorOptions image_options);
  /// The template of `dir` (ChatTemplate::from_pretrained) with `tokenizer` and `image_options`.
  static ChatProcessor from_pretrained(const std::string& dir, const Tokenizer& tokenizer,
                                       QwenImageProcessorOptions image_options);

  const Tokenizer& tokenizer() const { return tokenizer_; }
  const ChatTemplate& chat_template() const { return template_; }
  const VisionTokenIds& vision_tokens() const { return vision_tokens_; }

  /// Renders messages [first, end) (see ChatTemplate::render), loads and preprocesses their
  /// images, and returns the ids with each image's placeholder run expanded to its token count
  /// (t·h·w / merge²). Image placeholder parts take `images` in order; giving more or fewer
  /// images than there are placeholder parts is an error. Images are checked before any is
  /// decoded; errors name the message and part.
  ChatPrompt build(const std::vector<ChatMessage>& messages, const ChatOptions& options = ChatOptions(),
                   const std::vector<Image>& images = {}, size_t first = 0) const;

 private:
  friend class ChatSession;
  ChatPrompt assemble(const std::vector<ChatSegment>& segments, const std::vector<ChatMessage>& messages,
                      const std::vector<Image>& images, size_t first) const;

  const Tokenizer& tokenizer_;
  ChatTemplate template_;
  QwenImageProcessorOptions image_options_;
  VisionTokenIds vision_tokens_;
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
