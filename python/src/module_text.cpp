// vlmgen._vlmgen: VisionInputs, images, safetensors files, the tokenizer and chat prompts.

#include <fmt/format.h>
#include <pybind11/stl.h>

#include <cstring>
#include <map>
#include <memory>

#include "model_adapter.h"
#include "module_parts.h"
#include "vlmgen/detail/tensor_utils.h"
#include "vlmgen/error.h"
#include "vlmgen/image/image.h"
#include "vlmgen/image/preprocessor_config.h"
#include "vlmgen/image/qwen_image_processor.h"
#include "vlmgen/io/safetensors.h"
#include "vlmgen/models/qwen_vl_config.h"
#include "vlmgen/text/chat.h"
#include "vlmgen/text/tokenizer.h"
#include "vlmgen/vision_inputs.h"

namespace vlmgen::python {
namespace py = pybind11;
namespace {

Image image_from_tensor(const at::Tensor& hwc, const std::string& what) {
  VLMGEN_CHECK(
      hwc.dim() == 3 && hwc.size(2) == 3 && hwc.scalar_type() == at::kByte && hwc.size(0) > 0 && hwc.size(1) > 0,
      "{} must be [height, width, 3] uint8 RGB, got {} {}", what, detail::shape_str(hwc),
      c10::toString(hwc.scalar_type()));
  at::Tensor c = hwc.to(at::kCPU).contiguous();
  Image image;
  image.height = c.size(0);
  image.width = c.size(1);
  image.rgb.resize(static_cast<size_t>(c.numel()));
  std::memcpy(image.rgb.data(), c.data_ptr<uint8_t>(), image.rgb.size());
  return image;
}

Image image_from_python(py::handle value, const std::string& what) {
  if (py::isinstance<py::str>(value)) return load_image(value.cast<std::string>());
  VLMGEN_CHECK(THPVariable_Check(value.ptr()), "{} must be a file path or a [height, width, 3] uint8 tensor, got {}",
               what, type_name(value));
  return image_from_tensor(THPVariable_Unpack(value.ptr()), what);
}

// The checkpoint folder's image preprocessing (preprocessor_config.json, else the model's).
QwenImageProcessorOptions checkpoint_options(const std::string& dir) {
  QwenVlConfig config = QwenVlConfig::from_file(dir + "/config.json");
  return checkpoint_image_processor(dir, config);
}

// Chat messages as OpenAI-style dicts: {"role": ..., "content": "text" | [parts]}, a part being
// {"type": "text", "text": ...} or {"type": "image", "image": path-or-tensor}.
std::vector<ChatMessage> messages_from_python(const py::list& messages) {
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < messages.size(); ++i) {
    py::handle item = messages[i];
    VLMGEN_CHECK(py::isinstance<py::dict>(item) && item.contains("role") && item.contains("content"),
                 "message {} must be a dict with 'role' and 'content'", i);
    const std::string role = py::str(item["role"]);
    py::handle content = item["content"];
    if (py::isinstance<py::str>(content)) {
      out.emplace_back(role, content.cast<std::string>());
      continue;
    }
    VLMGEN_CHECK(py::isinstance<py::list>(content), "message {}: content must be a string or a list of parts", i);
    ChatMessage message(role);
    size_t part_index = 0;
    for (py::handle part : content) {
      const std::string where = fmt::format("message {} part {}", i, part_index++);
      VLMGEN_CHECK(py::isinstance<py::dict>(part) && part.contains("type"), "{}: a part must be a dict with 'type'",
                   where);
      const std::string type = py::str(part["type"]);
      if (type == "text") {
        VLMGEN_CHECK(part.contains("text"), "{}: a text part needs 'text'", where);
        message.text(py::str(part["text"]));
      } else if (type == "image") {
        VLMGEN_CHECK(part.contains("image"), "{}: an image part needs 'image' (a path or a uint8 tensor)", where);
        message.image(image_from_python(part["image"], where));
      } else {
        VLMGEN_FAIL("{}: type must be 'text' or 'image', got '{}'", where, type);
      }
    }
    out.push_back(std::move(message));
  }
  return out;
}

struct PyChatProcessor {
  std::shared_ptr<Tokenizer> tokenizer;
  std::unique_ptr<ChatProcessor> processor;
};

}  // namespace

void bind_vision(py::module_& m) {
  py::class_<VisionInputs>(
      m, "VisionInputs",
      "The images of a request: patch-flattened (Qwen-VL: pixel_values [patches, patch_dim] and image_grid_thw "
      "[n, 3]) or per image (pixel_values [n, ...]), with optional image_sizes [n, 2].")
      .def(py::init([](std::optional<at::Tensor> pixel_values, std::optional<at::Tensor> image_grid_thw,
                       std::optional<at::Tensor> image_sizes, const std::string& layout) {
             VLMGEN_CHECK(layout == "patch_flattened" || layout == "per_image",
                          "layout must be 'patch_flattened' or 'per_image', got '{}'", layout);
             VisionInputs v;
             v.pixel_values = pixel_values.value_or(at::Tensor());
             v.image_grid_thw = image_grid_thw.value_or(at::Tensor());
             v.image_sizes = image_sizes.value_or(at::Tensor());
             v.layout = layout == "per_image" ? VisionLayout::kPerImage : VisionLayout::kPatchFlattened;
             return v;
           }),
           py::arg("pixel_values") = py::none(), py::arg("image_grid_thw") = py::none(),
           py::arg("image_sizes") = py::none(), py::arg("layout") = "patch_flattened")
      .def_property_readonly("pixel_values", [](const VisionInputs& v) { return defined_or_none(v.pixel_values); })
      .def_property_readonly("image_grid_thw", [](const VisionInputs& v) { return defined_or_none(v.image_grid_thw); })
      .def_property_readonly("image_sizes", [](const VisionInputs& v) { return defined_or_none(v.image_sizes); })
      .def_property_readonly(
          "layout",
          [](const VisionInputs& v) { return v.layout == VisionLayout::kPerImage ? "per_image" : "patch_flattened"; })
      .def_property_readonly("num_images", &VisionInputs::num_images)
      .def_property_readonly("empty", &VisionInputs::empty)
      .def("select", &VisionInputs::select, py::arg("images"), "The bundle of the images with these indices.")
      .def("__repr__", [](const VisionInputs& v) {
        auto shape = [](const at::Tensor& t) { return t.defined() ? detail::shape_str(t) : std::string("None"); };
        return fmt::format("VisionInputs(pixel_values={}, image_grid_thw={}, image_sizes={})", shape(v.pixel_values),
                           shape(v.image_grid_thw), shape(v.image_sizes));
      });

  m.def(
      "load_image",
      [](const std::string& path) {
        Image image = load_image(path);
        return at::from_blob(image.rgb.data(), {image.height, image.width, 3}, at::kByte).clone();
      },
      py::arg("path"), "Decodes a PNG or JPEG file into a [height, width, 3] uint8 RGB tensor.");
  m.def(
      "preprocess_images",
      [](const py::list& images, std::optional<std::string> checkpoint, int64_t min_pixels, int64_t max_pixels) {
        std::vector<Image> decoded;
        for (size_t i = 0; i < images.size(); ++i)
          decoded.push_back(image_from_python(images[i], fmt::format("image {}", i)));
        QwenImageProcessorOptions options = checkpoint ? checkpoint_options(*checkpoint) : QwenImageProcessorOptions();
        if (min_pixels > 0) options.min_pixels(min_pixels);
        if (max_pixels > 0) options.max_pixels(max_pixels);
        py::gil_scoped_release release;
        return preprocess(decoded, options);
      },
      py::arg("images"), py::arg("checkpoint") = py::none(), py::arg("min_pixels") = 0, py::arg("max_pixels") = 0,
      "Qwen-VL preprocessing of images (paths or [H, W, 3] uint8 tensors), with the settings of a checkpoint "
      "folder when given; returns a patch-flattened VisionInputs.");

  m.def(
      "save_safetensors",
      [](const std::string& path, const std::map<std::string, at::Tensor>& tensors,
         const std::map<std::string, std::string>& metadata) { save_safetensors(path, tensors, metadata); },
      py::arg("path"), py::arg("tensors"), py::arg("metadata") = std::map<std::string, std::string>(),
      "Writes a dict of tensors as one safetensors file.");
  m.def(
      "load_safetensors",
      [](const std::string& path) {
        SafetensorsFile file(path);
        std::map<std::string, at::Tensor> out;
        for (const auto& name : file.names()) out[name] = file.tensor(name);
        return out;
      },
      py::arg("path"),
      "Reads every tensor of a safetensors file into a dict (F8_E4M3/F8_E5M2 tensors come as their uint8 bytes).");
}

void bind_text(py::module_& m) {
  py::class_<Tokenizer, std::shared_ptr<Tokenizer>>(
      m, "Tokenizer",
      "A checkpoint's own tokenizer (tokenizer.json: byte-level BPE, or SentencePiece-style BPE with byte "
      "fallback).")
      .def_static(
          "from_pretrained",
          [](const std::string& dir) { return std::make_shared<Tokenizer>(Tokenizer::from_pretrained(dir)); },
          py::arg("dir"))
      .def_static(
          "from_file", [](const std::string& path) { return std::make_shared<Tokenizer>(Tokenizer::from_file(path)); },
          py::arg("path"))
      .def(
          "encode",
          [](const Tokenizer& t, const std::string& text, bool parse_special_tokens) {
            EncodeOptions options;
            options.parse_special_tokens = parse_special_tokens;
            return t.encode(text, options);
          },
          py::arg("text"), py::arg("parse_special_tokens") = true)
      .def("decode", &Tokenizer::decode, py::arg("ids"), py::arg("skip_special_tokens") = false)
      .def(
          "token_id", [](const Tokenizer& t, const std::string& content) { return t.token_id(content); },
          py::arg("content"), "The id of a token given by its text, or None.")
      .def("is_special", &Tokenizer::is_special, py::arg("id"))
      .def_property_readonly("vocab_size", &Tokenizer::vocab_size)
      .def_property_readonly("eos_token", &Tokenizer::eos_token)
      .def_property_readonly("pad_token", &Tokenizer::pad_token)
      .def_property_readonly("bos_token", &Tokenizer::bos_token);

  py::class_<ChatPrompt>(m, "ChatPrompt", "The ids and images of rendered chat messages.")
      .def_readonly("ids", &ChatPrompt::ids)
      .def_readonly("vision", &ChatPrompt::vision)
      .def_readonly("num_images", &ChatPrompt::num_images);

  py::class_<PyChatProcessor, std::shared_ptr<PyChatProcessor>>(
      m, "ChatProcessor", "Chat template + tokenizer + image preprocessing of a checkpoint folder.")
      .def_static(
          "from_pretrained",
          [](const std::string& dir, std::shared_ptr<Tokenizer> tokenizer) {
            auto out = std::make_shared<PyChatProcessor>();
            out->tokenizer =
                tokenizer ? std::move(tokenizer) : std::make_shared<Tokenizer>(Tokenizer::from_pretrained(dir));
            out->processor = std::make_unique<ChatProcessor>(ChatProcessor::from_pretrained(
                dir, *out->tokenizer, ChatImageFormat::from_pretrained(dir, *out->tokenizer)));
            return out;
          },
          py::arg("dir"), py::arg("tokenizer") = py::none())
      .def_property_readonly("tokenizer", [](const PyChatProcessor& p) { return p.tokenizer; })
      .def(
          "build",
          [](const PyChatProcessor& p, const py::list& messages, bool add_generation_prompt, bool add_vision_id) {
            ChatOptions options;
            options.add_generation_prompt = add_generation_prompt;
            options.add_vision_id = add_vision_id;
            std::vector<ChatMessage> parsed = messages_from_python(messages);
            py::gil_scoped_release release;
            return p.processor->build(parsed, options);
          },
          py::arg("messages"), py::arg("add_generation_prompt") = true, py::arg("add_vision_id") = false,
          "Renders messages ([{'role': 'user', 'content': [{'type': 'image', 'image': 'a.png'}, {'type': 'text', "
          "'text': 'What is this?'}]}]) into prompt ids with each image's placeholders expanded, and its images.");
  m.def(
      "end_token_ids",
      [](const std::string& dir, const Tokenizer& tokenizer) { return end_token_ids_from_pretrained(dir, tokenizer); },
      py::arg("dir"), py::arg("tokenizer"), "The tokens that end a reply (generation_config.json, else eos).");
}

}  // namespace vlmgen::python
