// ChatProcessor (messages → ids + images) and ChatSession (turns kept in step with a context).

#include <ATen/ATen.h>

#include <algorithm>
#include <filesystem>

#include "../io/json_parse.h"
#include "vlmgen/error.h"
#include "vlmgen/io/files.h"
#include "vlmgen/text/chat.h"

namespace vlmgen {

namespace {

VisionInputs concat_images(const VisionInputs& a, const VisionInputs& b) {
  if (a.num_images() == 0) return b;
  if (b.num_images() == 0) return a;
  if (a.layout == VisionLayout::kPerImage) {
    return VisionInputs::per_image(at::cat({a.pixel_values, b.pixel_values}), at::cat({a.image_sizes, b.image_sizes}));
  }
  return VisionInputs::patch_flattened(at::cat({a.pixel_values, b.pixel_values}),
                                       at::cat({a.image_grid_thw, b.image_grid_thw}),
                                       at::cat({a.image_sizes, b.image_sizes}));
}

// Appends `text` to the last segment when that is text, else as a new segment.
void append_text(std::vector<ChatSegment>& segments, const std::string& text) {
  if (text.empty()) return;
  if (segments.empty() || segments.back().image >= 0) segments.emplace_back();
  segments.back().text += text;
}

struct ImageRef {
  size_t message, part;
  const ContentPart* content;
};

// Every image part of messages [first, end), in order.
std::vector<ImageRef> image_parts(const std::vector<ChatMessage>& messages, size_t first) {
  std::vector<ImageRef> out;
  for (size_t m = first; m < messages.size(); ++m) {
    if (messages[m].content_is_string) continue;
    for (size_t p = 0; p < messages[m].content.size(); ++p) {
      if (messages[m].content[p].is_image()) out.push_back(ImageRef{m, p, &messages[m].content[p]});
    }
  }
  return out;
}

Image decode_part(const ImageRef& ref, const std::vector<Image>& images, size_t* next_image) {
  const ContentPart& part = *ref.content;
  try {
    switch (part.kind) {
      case ContentPart::Kind::kImageFile: return load_image(part.text);
      case ContentPart::Kind::kImageBytes:
        return decode_image(reinterpret_cast<const uint8_t*>(part.text.data()), part.text.size(), ImageLimits(),
                            "image bytes");
      case ContentPart::Kind::kImagePixels:
        VLMGEN_CHECK(part.pixels != nullptr, "the image part holds no pixels");
        return *part.pixels;
      case ContentPart::Kind::kImagePlaceholder: return images[(*next_image)++];
      case ContentPart::Kind::kText: break;
    }
  } catch (const Error& e) {
    VLMGEN_FAIL("message {}, part {}: {}", ref.message, ref.part, e.what());
  }
  VLMGEN_FAIL("message {}, part {}: not an image part", ref.message, ref.part);
}

}  // namespace

ChatProcessor::ChatProcessor(const Tokenizer& tokenizer, ChatTemplate chat_template, ChatImageFormat image_format)
    : tokenizer_(tokenizer), template_(std::move(chat_template)), format_(std::move(image_format)) {
  VLMGEN_CHECK(format_.preprocess && format_.placeholder_counts,
               "the image format {} has no preprocessing or placeholder counts", format_.name);
}

ChatProcessor::ChatProcessor(const Tokenizer& tokenizer, ChatTemplate chat_template,
                             QwenImageProcessorOptions image_options)
    : ChatProcessor(tokenizer, std::move(chat_template),
                    ChatImageFormat::qwen_vl(tokenizer, std::move(image_options))) {}

ChatProcessor ChatProcessor::from_pretrained(const std::string& dir, const Tokenizer& tokenizer,
                                             ChatImageFormat image_format) {
  return ChatProcessor(tokenizer, ChatTemplate::from_pretrained(dir), std::move(image_format));
}

ChatProcessor ChatProcessor::from_pretrained(const std::string& dir, const Tokenizer& tokenizer,
                                             QwenImageProcessorOptions image_options) {
  return ChatProcessor(tokenizer, ChatTemplate::from_pretrained(dir), std::move(image_options));
}

ChatPrompt ChatProcessor::build(const std::vector<ChatMessage>& messages, const ChatOptions& options,
                                const std::vector<Image>& images, size_t first) const {
  return assemble(template_.render(messages, options, first), messages, images, first);
}

ChatPrompt ChatProcessor::assemble(const std::vector<ChatSegment>& segments, const std::vector<ChatMessage>& messages,
                                   const std::vector<Image>& images, size_t first) const {
  // Count and check before decoding anything. An image's tokens typed into the text would stand
  // for an image the prompt does not carry (the model would fail halfway through a forward), and
  // a video's for a video, which no model here takes yet.
  for (int64_t id :
       {format_.tokens.vision_start, format_.tokens.image_pad, format_.tokens.vision_end, format_.tokens.video_pad}) {
    if (id < 0) continue;
    const std::string typed = tokenizer_.decode({id});
    const bool video = id == format_.tokens.video_pad;
    for (const ChatSegment& s : segments) {
      VLMGEN_CHECK(
          s.image >= 0 || typed.empty() || s.text.find(typed) == std::string::npos,
          "the messages' text holds the {} token '{}' (id {}); {}", video ? "video" : "image", typed, id,
          video ? "videos are not supported yet" : "an image goes in an image part, which writes its own tokens");
    }
  }
  const std::vector<ImageRef> refs = image_parts(messages, first);
  size_t placeholders = 0;
  for (const ImageRef& ref : refs) {
    if (ref.content->kind == ContentPart::Kind::kImagePlaceholder) {
      VLMGEN_CHECK(placeholders < images.size(),
                   "message {}, part {} is an image placeholder, but only {} images were given for the placeholders",
                   ref.message, ref.part, images.size());
      ++placeholders;
    }
  }
  VLMGEN_CHECK(placeholders == images.size(),
               "{} images were given but the messages have {} image placeholder parts to take them", images.size(),
               placeholders);
  std::vector<Image> decoded;
  decoded.reserve(refs.size());
  size_t next_image = 0;
  for (const ImageRef& ref : refs) decoded.push_back(decode_part(ref, images, &next_image));
  ChatPrompt prompt;
  prompt.num_images = static_cast<int64_t>(decoded.size());
  if (!decoded.empty()) prompt.vision = format_.preprocess(decoded);
  const std::vector<int64_t> counts =
      decoded.empty() ? std::vector<int64_t>() : format_.placeholder_counts(prompt.vision);

  // The text the processor writes around each image joins the text next to it.
  std::vector<ChatSegment> expanded;
  for (const ChatSegment& s : segments) {
    if (s.image < 0) {
      append_text(expanded, s.text);
      continue;
    }
    append_text(expanded, format_.text_before);
    expanded.push_back(s);
    append_text(expanded, format_.text_after);
  }
  const auto image_segments =
      std::count_if(expanded.begin(), expanded.end(), [](const ChatSegment& s) { return s.image >= 0; });
  VLMGEN_CHECK(static_cast<size_t>(image_segments) == refs.size(),
               "the rendering places {} images but the messages hold {}: every image must appear in the prompt",
               image_segments, refs.size());
  const VisionTokenIds& tokens = format_.tokens;
  int64_t first_image = -1;
  for (const ChatSegment& s : expanded) {
    if (s.image < 0) {
      const std::vector<int64_t> ids = tokenizer_.encode(s.text);
      for (int64_t id : ids) {  // the same, on the ids (the check above compared the texts)
        VLMGEN_CHECK(id != tokens.vision_start && id != tokens.image_pad && id != tokens.vision_end,
                     "the messages' text holds the image token '{}' (id {}); an image goes in an image part, "
                     "which writes its own tokens",
                     tokenizer_.decode({id}), id);
      }
      prompt.ids.insert(prompt.ids.end(), ids.begin(), ids.end());
      continue;
    }
    if (first_image < 0) first_image = s.image;
    const int64_t local = s.image - first_image;
    VLMGEN_CHECK(local >= 0 && local < static_cast<int64_t>(counts.size()),
                 "the rendering has image {} but the messages hold {} images", s.image, counts.size());
    prompt.ids.push_back(tokens.vision_start);
    prompt.ids.insert(prompt.ids.end(), static_cast<size_t>(counts[static_cast<size_t>(local)]), tokens.image_pad);
    prompt.ids.push_back(tokens.vision_end);
  }
  return prompt;
}

ChatSession::ChatSession(const ChatProcessor& processor, ChatOptions options)
    : processor_(processor), options_(options) {}

ChatSession::Turn ChatSession::add(std::vector<ChatMessage> new_messages) {
  VLMGEN_CHECK(!awaiting_reply_, "the last turn has no reply yet: call add_reply with the generated tokens first");
  VLMGEN_CHECK(!new_messages.empty(), "a turn needs at least one message");
  std::vector<ChatMessage> messages = messages_;
  for (ChatMessage& m : new_messages) messages.push_back(std::move(m));
  const ChatTemplate& tmpl = processor_.chat_template();
  std::vector<ChatSegment> segments = tmpl.render(messages, options_, first_open_);
  // The part of the first message already in ids_ (the reply and its header) is not added again.
  if (!open_text_.empty()) {
    VLMGEN_CHECK(
        !segments.empty() && segments[0].image < 0 && segments[0].text.compare(0, open_text_.size(), open_text_) == 0,
        "the chat template renders the last reply differently from the tokens generated for it; cannot "
        "continue the conversation from its cached ids");
    segments[0].text.erase(0, open_text_.size());
  }
  ChatPrompt prompt = processor_.assemble(segments, messages, {}, first_open_);
  // The generation prompt: what add_generation_prompt appends to the rendering.
  ChatOptions closed = options_;
  closed.add_generation_prompt = false;
  const std::string with = tmpl.render_text(messages, options_, messages.size());
  const std::string without = tmpl.render_text(messages, closed, messages.size());
  VLMGEN_CHECK(with.compare(0, without.size(), without) == 0, "the chat template's generation prompt is not a suffix");

  Turn turn;
  turn.ids = ids_;
  turn.ids.insert(turn.ids.end(), prompt.ids.begin(), prompt.ids.end());
  turn.vision = concat_images(vision_, prompt.vision);
  turn.new_ids = static_cast<int64_t>(prompt.ids.size());
  turn.new_images = prompt.num_images;
  // Commit.
  messages_ = std::move(messages);
  ids_ = turn.ids;
  vision_ = turn.vision;
  num_images_ += prompt.num_images;
  first_open_ = messages_.size();
  open_text_ = with.substr(without.size());
  awaiting_reply_ = options_.add_generation_prompt;
  return turn;
}

void ChatSession::add_reply(const std::vector<int64_t>& tokens) {
  VLMGEN_CHECK(awaiting_reply_, "no turn is waiting for a reply: add a user message first");
  const Tokenizer& tokenizer = processor_.tokenizer();
  std::vector<int64_t> content = tokens;
  if (!content.empty() && tokenizer.is_special(content.back())) content.pop_back();  // the end token
  const std::string text = tokenizer.decode(content);
  messages_.push_back(ChatMessage("assistant", text));
  // The template's rendering of the reply (Gemma-3 trims it); its ids stay as generated.
  open_text_ += processor_.chat_template().rendered_text(text);
  ids_.insert(ids_.end(), content.begin(), content.end());
  first_open_ = messages_.size() - 1;
  awaiting_reply_ = false;
}

std::vector<int64_t> end_token_ids_from_pretrained(const std::string& dir, const Tokenizer& tokenizer) {
  namespace fs = std::filesystem;
  std::vector<int64_t> ids;
  for (const char* name : {"generation_config.json", "config.json"}) {
    const std::string path = (fs::path(dir) / name).string();
    if (!file_exists(path, "config")) continue;
    const auto json = detail::parse_json(read_regular_file(path, "config", 64 << 20), path);
    if (!json.is_object() || !json.contains("eos_token_id") || json["eos_token_id"].is_null()) continue;
    const auto& value = json["eos_token_id"];
    for (const auto& v : value.is_array() ? value : nlohmann::json::array({value})) {
      VLMGEN_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0, "{}: eos_token_id holds {}; expected token ids",
                   path, detail::json_excerpt(v));
      ids.push_back(v.get<int64_t>());
    }
  }
  if (tokenizer.eos_token()) {
    if (auto id = tokenizer.token_id(*tokenizer.eos_token())) ids.push_back(*id);
  }
  std::vector<int64_t> unique;
  for (int64_t id : ids) {
    if (std::find(unique.begin(), unique.end(), id) == unique.end()) unique.push_back(id);
  }
  VLMGEN_CHECK(!unique.empty(),
               "{}: no end token found (eos_token_id in generation_config.json or config.json, "
               "eos_token in tokenizer_config.json)",
               dir);
  return unique;
}

}  // namespace vlmgen
