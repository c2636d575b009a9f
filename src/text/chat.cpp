#include "vlmgen/text/chat.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "../io/json_parse.h"
#include "chat_templates.h"
#include "utf8.h"
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

int64_t count_images(const ChatMessage& m) {
  if (m.content_is_string) return 0;
  return std::count_if(m.content.begin(), m.content.end(), [](const ContentPart& p) { return p.is_image(); });
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
      images += count_images(m);
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

// Whether code point `c` is whitespace to Python's str.strip() (what Jinja's `trim` calls).
bool python_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// The code point at s[i] (valid UTF-8) and its length.
uint32_t code_point_at(std::string_view s, size_t i, size_t* length) {
  const auto b = [&](size_t k) { return static_cast<uint32_t>(static_cast<uint8_t>(s[i + k])); };
  if (b(0) < 0x80 || i + 1 >= s.size()) return *length = 1, b(0);
  if (b(0) < 0xE0) return *length = 2, ((b(0) & 0x1F) << 6) | (b(1) & 0x3F);
  if (b(0) < 0xF0 || i + 3 >= s.size())
    return *length = 3, ((b(0) & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F);
  return *length = 4, ((b(0) & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
}

std::string python_strip(std::string_view s) {
  size_t begin = 0, end = s.size(), n = 0;
  while (begin < end && python_space(code_point_at(s, begin, &n))) begin += n;
  while (end > begin) {
    size_t start = end - 1;
    while (start > begin && (static_cast<uint8_t>(s[start]) & 0xC0) == 0x80) --start;
    if (!python_space(code_point_at(s, start, &n)) || start + n != end) break;
    end = start;
  }
  return std::string(s.substr(begin, end - begin));
}

// Gemma-3's template, message by message (the checkpoint's Jinja source is in chat_templates.h).
std::vector<ChatSegment> render_gemma3(const std::vector<ChatMessage>& messages, const ChatOptions& options,
                                       size_t first) {
  VLMGEN_CHECK(!options.add_vision_id, "the Gemma-3 template has no add_vision_id");
  std::vector<ChatSegment> out;
  const auto text = [&](std::string_view s) {
    if (out.empty() || out.back().image >= 0) out.emplace_back();
    out.back().text.append(s);
  };
  const bool has_system = !messages.empty() && messages[0].role == "system";
  std::string first_user_prefix;
  if (has_system) {
    const ChatMessage& m = messages[0];
    VLMGEN_CHECK(!m.content.empty() && m.content[0].kind == ContentPart::Kind::kText,
                 "message 0: the Gemma-3 template takes the system message's first part as text; it has {}",
                 m.content.empty() ? "no parts" : "an image first");
    first_user_prefix = m.content[0].text + "\n\n";
    VLMGEN_CHECK(count_images(m) == 0,
                 "message 0: the Gemma-3 template writes only the system message's first text; its {} image(s) "
                 "would be left out of the prompt (put images in a user message)",
                 count_images(m));
  }
  if (first == 0) text("<bos>");
  int64_t images = 0;
  for (size_t i = has_system ? 1 : 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    const size_t index = i - (has_system ? 1 : 0);
    VLMGEN_CHECK((m.role == "user") == (index % 2 == 0),
                 "message {}: the Gemma-3 template needs roles that alternate user/assistant/user/assistant/...; "
                 "got {} here",
                 i, m.role.empty() ? std::string("an empty role") : m.role);
    if (i < first) {
      images += count_images(m);
      continue;
    }
    text("<start_of_turn>");
    text(m.role == "assistant" ? "model" : m.role);
    text("\n");
    if (index == 0) text(first_user_prefix);
    if (m.content_is_string) {
      text(python_strip(m.content.at(0).text));
    } else {
      for (const ContentPart& part : m.content) {
        if (part.is_image()) {
          out.push_back(ChatSegment{std::string(), images++});
        } else {
          text(python_strip(part.text));
        }
      }
    }
    text("<end_of_turn>\n");
  }
  if (options.add_generation_prompt) text("<start_of_turn>model\n");
  return out;
}

// A JSON file's "chat_template": a string, or a list of {"name", "template"} (the "default" one).
std::optional<std::string> template_in_json(const std::string& path) {
  if (!file_exists(path, "chat template config")) return std::nullopt;
  const auto json = detail::parse_json(read_regular_file(path, "chat template config", kMaxConfigBytes), path);
  VLMGEN_CHECK(json.is_object(), "{}: expected a JSON object, got {}", path, detail::json_excerpt(json));
  const auto it = json.find("chat_template");
  if (it == json.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  VLMGEN_CHECK(it->is_array(), "{}: \"chat_template\" is {}; expected a string or a list of named templates", path,
               detail::json_excerpt(*it));
  for (const auto& entry : *it) {
    if (entry.is_object() && entry.contains("name") && entry["name"].is_string() &&
        entry["name"].get<std::string>() == "default" && entry.contains("template") && entry["template"].is_string()) {
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
ChatTemplate ChatTemplate::gemma3() { return ChatTemplate("gemma3"); }

std::string ChatTemplate::rendered_text(const std::string& text) const {
  return name_ == "gemma3" ? python_strip(text) : text;
}

ChatTemplate ChatTemplate::from_source(const std::string& source, const std::string& what) {
  if (trim_trailing_newlines(source) == trim_trailing_newlines(std::string(detail::kQwen2VlChatTemplate))) {
    return qwen2_vl();
  }
  if (trim_trailing_newlines(source) == trim_trailing_newlines(std::string(detail::kGemma3ChatTemplate))) {
    return gemma3();
  }
  const ContentHash hash = Sha256().update(source.data(), source.size()).finish();
  VLMGEN_FAIL(
      "{}: this chat template ({} bytes, sha256 {}, starting {}) is not one vlmgen renders; supported: the "
      "Qwen2-VL template (qwen2-vl) and the Gemma-3 template (gemma3). Render the prompt yourself and pass token ids "
      "instead",
      what, source.size(), to_hex(hash).substr(0, 16), quote_excerpt(source, 48));
}

ChatTemplate ChatTemplate::from_pretrained(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string jinja = (fs::path(dir) / "chat_template.jinja").string();
  if (file_exists(jinja, "chat template"))
    return from_source(read_regular_file(jinja, "chat template", kMaxTemplateBytes), jinja);
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
  for (size_t i = 0; i < messages.size(); ++i) {
    if (const auto bad = detail::find_invalid_utf8(messages[i].role)) {
      VLMGEN_FAIL("message {}: the role is not valid UTF-8 (byte {} of {})", i, *bad, messages[i].role.size());
    }
    for (size_t p = 0; p < messages[i].content.size(); ++p) {
      const ContentPart& part = messages[i].content[p];
      if (part.kind != ContentPart::Kind::kText) continue;
      if (const auto bad = detail::find_invalid_utf8(part.text)) {
        VLMGEN_FAIL("message {}, part {}: the text is not valid UTF-8: byte 0x{:02X} at offset {} of {}", i, p,
                    static_cast<uint8_t>(part.text[*bad]), *bad, part.text.size());
      }
    }
  }
  return name_ == "gemma3" ? render_gemma3(messages, options, first) : render_qwen2_vl(messages, options, first);
}

std::string ChatTemplate::render_text(const std::vector<ChatMessage>& messages, const ChatOptions& options,
                                      size_t first) const {
  std::string out;
  for (const ChatSegment& s : render(messages, options, first)) {
    if (s.image < 0) {
      out += s.text;
    } else {
      out += name_ == "gemma3" ? "<start_of_image>" : "<|vision_start|><|image_pad|><|vision_end|>";
    }
  }
  return out;
}

}  // namespace vlmgen
