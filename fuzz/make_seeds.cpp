// Writes the seed corpora of the fuzz targets from real files made by vlmgen itself:
//   vlmgen-fuzz-seeds OUT_DIR   ->  OUT_DIR/{safetensors,checkpoint,config,image}/...
// The committed fuzz/corpus/ was made this way; rerun it after a format change. Its progressive
// and restart-marker JPEGs were made from rgb.jpg and gray.jpg with libjpeg-turbo's jpegtran
// (-progressive, -restart 1), which stb cannot write.

#include <ATen/ATen.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "vlmgen/image/image.h"
#include "vlmgen/io/safetensors.h"
#include "vlmgen/models/qwen_vl_config.h"

#define STB_IMAGE_WRITE_IMPLEMENTATION
#define STB_IMAGE_WRITE_STATIC
#if defined(__clang__)
// stb's JPEG encoder shifts negative values left (undefined behaviour that UBSan reports); the
// seeds only need its output.
#pragma clang attribute push(__attribute__((no_sanitize("shift"))), apply_to = function)
#endif
#include "stb_image_write.h"
#if defined(__clang__)
#pragma clang attribute pop
#endif

namespace fs = std::filesystem;

namespace {

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void safetensors_seeds(const fs::path& out) {
  at::manual_seed(0);
  vlmgen::save_safetensors((out / "dtypes.safetensors").string(),
                           {{"f32", at::randn({2, 3})},
                            {"f16", at::randn({4}).to(at::kHalf)},
                            {"bf16", at::randn({1, 2, 2}).to(at::kBFloat16)},
                            {"i64", at::arange(3, at::kLong)},
                            {"u8", at::arange(5, at::kByte)},
                            {"bool", at::ones({2}, at::kBool)}},
                           {{"format", "pt"}});
  vlmgen::save_safetensors((out / "empty_tensor.safetensors").string(),
                           {{"a", at::empty({0, 3})}, {"b", at::ones({2})}, {"scalar", at::ones({})}});
  vlmgen::save_safetensors((out / "no_tensors.safetensors").string(), {}, {{"k", "v"}});
}

void checkpoint_seeds(const fs::path& out) {
  const fs::path tmp = out / "tmp";
  fs::create_directories(tmp);
  vlmgen::save_safetensors((tmp / "shard-0.safetensors").string(),
                           {{"model.embed_tokens.weight", at::ones({4, 2})}, {"model.norm.weight", at::ones({2})}});
  vlmgen::save_safetensors((tmp / "shard-1.safetensors").string(), {{"lm_head.weight", at::zeros({4, 2}, at::kHalf)}});
  const std::string index =
      R"({"metadata": {"total_size": 56}, "weight_map": {"model.embed_tokens.weight": "shard-0.safetensors", )"
      R"("model.norm.weight": "shard-0.safetensors", "lm_head.weight": "shard-1.safetensors"}})";
  std::string packed = index;
  for (const char* shard : {"shard-0.safetensors", "shard-1.safetensors"}) {
    packed += std::string(vlmgen::fuzz::kFileSeparator) + read_file(tmp / shard);
  }
  vlmgen::fuzz::write_file((out / "two_shards").string(), packed);
  fs::remove_all(tmp);
}

void config_seeds(const fs::path& out) {
  vlmgen::fuzz::write_file((out / "tiny.json").string(), vlmgen::QwenVlConfig::tiny().to_json());
  vlmgen::fuzz::write_file((out / "qwen2_vl_2b.json").string(), vlmgen::QwenVlConfig().to_json());
  // The other families: window attention (Qwen2.5-VL), DeepStack and a position table (Qwen3-VL).
  vlmgen::fuzz::write_file((out / "tiny_qwen2_5_vl.json").string(),
                           vlmgen::QwenVlConfig::tiny(vlmgen::QwenFamily::kQwen2_5Vl).to_json());
  vlmgen::fuzz::write_file((out / "tiny_qwen3_vl.json").string(),
                           vlmgen::QwenVlConfig::tiny(vlmgen::QwenFamily::kQwen3Vl).to_json());
  // The nested layout of newer transformers, with rope_parameters and null fields.
  vlmgen::fuzz::write_file((out / "nested.json").string(), R"({
  "model_type": "qwen2_vl", "image_token_id": 90, "video_token_id": 91, "vision_start_token_id": 88,
  "vision_end_token_id": 89, "tie_word_embeddings": true,
  "text_config": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 128, "vocab_size": 96, "head_dim": null, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]}},
  "vision_config": {"depth": 2, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 2.0, "in_chans": 3,
    "spatial_patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2, "hidden_size": 64}
})");
}

std::string be32(uint32_t v) {
  return {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8), static_cast<char>(v)};
}

uint32_t crc32(const std::string& bytes) {
  uint32_t crc = 0xffffffffu;
  for (unsigned char byte : bytes) {
    crc ^= byte;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xedb88320u & (0u - (crc & 1)));
  }
  return ~crc;
}

std::string chunk(const std::string& type, const std::string& data) {
  return be32(static_cast<uint32_t>(data.size())) + type + data + be32(crc32(type + data));
}

// A PNG from rows already filtered (each starting with its filter byte), for the variants stb's
// writer cannot make: palette, 16-bit, 1-bit, Adam7-interlaced.
std::string png(uint32_t width, uint32_t height, int depth, int color, int interlace, const std::string& raw,
                const std::string& extra_chunks = "") {
  int length = 0;
  unsigned char* z = stbi_zlib_compress(reinterpret_cast<unsigned char*>(const_cast<char*>(raw.data())),
                                        static_cast<int>(raw.size()), &length, 8);
  const std::string idat(reinterpret_cast<char*>(z), static_cast<size_t>(length));
  STBIW_FREE(z);
  const std::string ihdr =
      be32(width) + be32(height) +
      std::string{static_cast<char>(depth), static_cast<char>(color), 0, 0, static_cast<char>(interlace)};
  return std::string("\x89PNG\r\n\x1a\n", 8) + chunk("IHDR", ihdr) + extra_chunks + chunk("IDAT", idat) +
         chunk("IEND", "");
}

void png_variant_seeds(const fs::path& out) {
  std::string raw;
  for (int y = 0; y < 4; ++y) raw += std::string(1, '\0') + std::string{0, 1, 2, 1};  // 4 palette indices per row
  vlmgen::fuzz::write_file(
      (out / "palette_trns.png").string(),
      png(4, 4, 8, 3, 0, raw,
          chunk("PLTE", std::string("\xff\0\0\0\xff\0\0\0\xff", 9)) + chunk("tRNS", std::string("\x80", 1))));
  raw.clear();
  for (int y = 0; y < 2; ++y) {
    raw += '\1';                                                               // Sub filter
    for (int x = 0; x < 3 * 4 * 2; ++x) raw += static_cast<char>(x * 10 + y);  // 3 pixels of 4 x 16 bits
  }
  vlmgen::fuzz::write_file((out / "rgba16.png").string(), png(3, 2, 16, 6, 0, raw));
  vlmgen::fuzz::write_file((out / "gray1.png").string(), png(8, 2, 1, 0, 0, std::string("\0\xa5\0\x5a", 4)));
  // Adam7: seven passes over an 8x8 gray image, each row with its own filter byte.
  const int passes[7][4] = {{0, 0, 8, 8}, {4, 0, 8, 8}, {0, 4, 4, 8}, {2, 0, 4, 4},
                            {0, 2, 2, 4}, {1, 0, 2, 2}, {0, 1, 1, 2}};
  raw.clear();
  for (const auto& p : passes) {
    for (int y = p[1]; y < 8; y += p[3]) {
      raw += static_cast<char>(y % 5);  // every filter type
      for (int x = p[0]; x < 8; x += p[2]) raw += static_cast<char>(x * 31 + y * 7);
    }
  }
  vlmgen::fuzz::write_file((out / "interlaced.png").string(), png(8, 8, 8, 0, 1, raw));
}

void image_seeds(const fs::path& out) {
  png_variant_seeds(out);
  vlmgen::Image image{12, 16, std::vector<uint8_t>(12 * 16 * 3)};
  for (size_t i = 0; i < image.rgb.size(); ++i) image.rgb[i] = static_cast<uint8_t>(i * 37 % 251);
  vlmgen::save_png((out / "rgb.png").string(), image);
  const std::vector<uint8_t> gray = {0, 50, 100, 150, 200, 250, 25, 75, 125};
  stbi_write_png((out / "gray.png").string().c_str(), 3, 3, 1, gray.data(), 3);
  const std::vector<uint8_t> rgba(4 * 4 * 4, 128);
  stbi_write_png((out / "rgba.png").string().c_str(), 4, 4, 4, rgba.data(), 16);
  stbi_write_jpg((out / "rgb.jpg").string().c_str(), 16, 12, 3, image.rgb.data(), 90);
  stbi_write_jpg((out / "gray.jpg").string().c_str(), 3, 3, 1, gray.data(), 50);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: vlmgen-fuzz-seeds OUT_DIR\n";
    return 2;
  }
  const fs::path root(argv[1]);
  for (const char* target : {"safetensors", "checkpoint", "config", "image"}) fs::create_directories(root / target);
  safetensors_seeds(root / "safetensors");
  checkpoint_seeds(root / "checkpoint");
  config_seeds(root / "config");
  image_seeds(root / "image");
  std::cout << "seeds written under " << root << "\n";
  return 0;
}
