#include "vlmgen/text/chat.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "../io/json_parse.h"
#include "chat_templates.h"
#include "vlmgen/content_hash.h"
#include "vlmgen/detail/tensor_utils.h"
#include "vlmgen/error.h"
#include "vlmgen/io/files.h"

namespace vlmgen {

namespace {

constexpr int64_t kMaxTemplateBytes = 1 << 20;
constexpr int64_t kMaxConfigBytes = 64 << 20;

ContentPart image_part(ContentPart::Kind kind, std::string text = {}, std::shared_ptr<const Image> pixels = nullptr) {
  return ContentPart{kind, std::move(text), std::move(pixels)};
}

std::string trim_trailing_newlines(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
  return s;
}

// Qwen2-VL's template, message by message (the checkpoint's Jinja source is in chat_templates.h).
std::vector<ChatSegment> render_qwen2_vl(const std::vector<ChatMessage>& messages, const ChatOptions& options,
                                         size_t first) {
  std::vector<ChatSegment> out;
  const auto text = [&](std::string_view s) {
    if (out.empty() || out.back().image >= 0) out.emplace_back();
    out.back().text.append(s);
  };
  int64_t images = 0;
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    VLMGEN_CHECK(!m.role.empty(), "message {}: the role is empty; expected system, user or assistant", i);
    if (i < first) {
      if (!m.content_is_string)
        images += std::count_if(m.content.begin(), m.content.end(), [](const ContentPart& p) { return p.is_image(); });
      continue;
    }
    if (i == 0 && m.role != "system") text("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n");
    text("<|im_start|>");
    text(m.role);
    text("\n");
    if (m.content_is_string) {
      VLMGEN_CHECK(m.content.size() == 1 && m.content[0].kind == ContentPart::Kind::kText,
                   "message {}: string content must be one text part, got {} parts", i, m.content.size());
      text(m.content[0].text);
    } else {
      for (const ContentPart& part : m.content) {
        if (!part.is_image()) {
          text(part.text);
          continue;
        }
        ++images;
        if (options.add_vision_id) text(fmt::format("Picture {}: ", images));
        out.push_back(ChatSegment{std::string(), images - 1});
      }
    }
    text("<|im_end|>\n");
  }
  if (options.add_generation_prompt) text("<|im_start|>assistant\n");
  return out;
}

// A JSON file's "chat_template": a string, or a list of {"name", "template"} (the "default" one).
std::optional<std::string> template_in_json(const std::string& path) {
  if (!std::filesystem::exists(path)) return std::nullopt;
  const auto json = detail::parse_json(read_regular_file(path, "chat template config", kMaxConfigBytes), path);
  VLMGEN_CHECK(json.is_object(), "{}: expected a JSON object, got {}", path, detail::json_excerpt(json));
  const auto it = json.find("chat_template");
  if (it == json.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  VLMGEN_CHECK(it->is_array(), "{}: \"chat_template\" is {}; expected a string or a list of named templates", path,
               detail::json_excerpt(*it));
  for (const auto& entry : *it) {
    if (entry.is_object() && entry.value("name", std::string()) == "default" && entry.contains("template") &&
        entry["template"].is_string()) {
      return entry["template"].get<std::string>();
    }
  }
  VLMGEN_FAIL("{}: \"chat_template\" lists templates but none is named \"default\"", path);
}

}  // namespace

ChatMessage& ChatMessage::text(std::string value) {
  content_is_string = false;
  content.push_back(ContentPart{ContentPart::Kind::kText, std::move(value), nullptr});
  return *this;
}
ChatMessage& ChatMessage::image_file(std::string path) {
  content_is_string = false;
  content.push_back(image_part(ContentPart::Kind::kImageFile, std::move(path)));
  return *this;
}
ChatMessage& ChatMessage::image_bytes(std::string encoded) {
  content_is_string = false;
  content.push_back(image_part(ContentPart::Kind::kImageBytes, std::move(encoded)));
  return *this;
}
ChatMessage& ChatMessage::image(Image pixels) {
  content_is_string = false;
  content.push_back(image_part(ContentPart::Kind::kImagePixels, {}, std::make_shared<const Image>(std::move(pixels))));
  return *this;
}
ChatMessage& ChatMessage::image(const at::Tensor& hwc_rgb) {
  VLMGEN_CHECK(hwc_rgb.defined() && hwc_rgb.dim() == 3 && hwc_rgb.size(2) == 3 && hwc_rgb.scalar_type() == at::kByte &&
                   hwc_rgb.size(0) > 0 && hwc_rgb.size(1) > 0,
               "an image tensor must be [height, width, 3] uint8 RGB, got {} {}", detail::shape_str(hwc_rgb),
               hwc_rgb.defined() ? c10::toString(hwc_rgb.scalar_type()) : "undefined");
  const at::Tensor pixels = hwc_rgb.to(at::kCPU).contiguous();
  Image decoded{pixels.size(0), pixels.size(1), std::vector<uint8_t>(static_cast<size_t>(pixels.numel()))};
  std::memcpy(decoded.rgb.data(), pixels.data_ptr<uint8_t>(), decoded.rgb.size());
  return image(std::move(decoded));
}
ChatMessage& ChatMessage::image_placeholder() {
  content_is_string = false;
  content.push_back(image_part(ContentPart::Kind::kImagePlaceholder));
  return *this;
}

ChatTemplate ChatTemplate::qwen2_vl() { return ChatTemplate("qwen2-vl"); }

ChatTemplate ChatTemplate::from_source(const std::string& source, const std::string& what) {
  if (trim_trailing_newlines(source) == trim_trailing_newlines(std::string(detail::kQwen2VlChatTemplate))) {
    return qwen2_vl();
  }
  const ContentHash hash = Sha256().update(source.data(), source.size()).finish();
  VLMGEN_FAIL(
      "{}: this chat template ({} bytes, sha256 {}, starting {}) is not one vlmgen renders; supported: the "
      "Qwen2-VL template (qwen2-vl). Render the prompt yourself and pass token ids instead",
      what, source.size(), to_hex(hash).substr(0, 16), quote_excerpt(source, 48));
}

ChatTemplate ChatTemplate::from_pretrained(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string jinja = (fs::path(dir) / "chat_template.jinja").string();
  if (fs::exists(jinja)) return from_source(read_regular_file(jinja, "chat template", kMaxTemplateBytes), jinja);
  for (const char* name : {"chat_template.json", "tokenizer_config.json"}) {
    const std::string path = (fs::path(dir) / name).string();
    if (auto source = template_in_json(path)) return from_source(*source, path);
  }
  VLMGEN_FAIL(
      "{} has no chat template: looked for chat_template.jinja, chat_template.json and \"chat_template\" in "
      "tokenizer_config.json",
      dir);
}

std::vector<ChatSegment> ChatTemplate::render(const std::vector<ChatMessage>& messages, const ChatOptions& options,
                                              size_t first) const {
  VLMGEN_CHECK(first <= messages.size(), "render from message {} of {}", first, messages.size());
  return render_qwen2_vl(messages, options, first);
}

std::string ChatTemplate::render_text(const std::vector<ChatMessage>& messages, const ChatOptions& options,
                                      size_t first) const {
  std::string out;
  for (const ChatSegment& s : render(messages, options, first)) {
    out += s.image >= 0 ? "<|vision_start|><|image_pad|><|vision_end|>" : s.text;
  }
  return out;
}

}  // namespace vlmgen
