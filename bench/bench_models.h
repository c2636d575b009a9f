#pragma once

// The bench's models and prompts, shared by its reports.

#include <ATen/Parallel.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "vlmgen/kernels/cpu.h"
#include "vlmgen/models/gemma3.h"
#include "vlmgen/models/llava_next.h"
#include "vlmgen/models/qwen2_vl.h"
#include "vlmgen/testing/forward_spy.h"

namespace vlmgen::bench {

/// About 110M parameters in the language model: hidden 768, 12 layers, 12 heads (4 KV heads),
/// SwiGLU 2048, vocab 16384 untied; a 4-block vision tower. Qwen2.5-VL: SwiGLU tower with
/// 112-pixel windows; Qwen3-VL: q/k norms, no q/k/v bias, interleaved M-RoPE, a 32x32 position
/// table and DeepStack after vision blocks 1-3.
inline QwenVlConfig config_100m(QwenFamily family = QwenFamily::kQwen2Vl) {
  QwenVlConfig c = QwenVlConfig::tiny(family);  // the family's switches; every size set below
  c.hidden_size = 768;
  c.num_hidden_layers = 12;
  c.num_attention_heads = 12;
  c.num_key_value_heads = 4;
  c.head_dim = 64;
  c.intermediate_size = 2048;
  c.mrope_section = {8, 12, 12};
  c.vocab_size = 16384;
  c.max_position_embeddings = 8192;
  c.rope_theta = 10000.0;
  c.image_token_id = 16000;
  c.video_token_id = 16001;
  c.vision_start_token_id = 16002;
  c.vision_end_token_id = 16003;
  c.vision.depth = 4;
  c.vision.embed_dim = 384;
  c.vision.num_heads = 6;
  c.vision.mlp_ratio = 4;
  c.vision.patch_size = 14;
  c.vision.temporal_patch_size = 2;
  c.vision.spatial_merge_size = 2;
  c.vision.hidden_size = 768;
  c.vision.intermediate_size = 4 * 384;
  if (family == QwenFamily::kQwen2_5Vl) {
    c.vision.window_size = 112;
    c.vision.fullatt_block_indexes = {3};
  }
  if (family == QwenFamily::kQwen3Vl) {
    c.mrope_section = {12, 10, 10};
    c.vision.num_position_embeddings = 1024;
    c.vision.deepstack_visual_indexes = {1, 2, 3};
  }
  return c;
}

inline int64_t count_params(Qwen2Vl& m, bool language_only) {
  int64_t n = 0;
  for (auto& [name, t] : m.named_weights()) {
    if (!language_only || name.rfind("visual.", 0) != 0) n += t->numel();
  }
  return n;
}

/// Bytes of weights one decode step reads: every LM matrix and norm, plus one embedding row.
inline int64_t decode_weight_bytes(Qwen2Vl& m) {
  int64_t bytes = 0;
  for (auto& [name, t] : m.named_weights()) {
    if (name.rfind("visual.", 0) == 0) continue;
    if (name == "model.embed_tokens.weight") {
      bytes += t->size(1) * static_cast<int64_t>(t->element_size());
      continue;
    }
    bytes += t->numel() * static_cast<int64_t>(t->element_size());
  }
  if (m.tied_embeddings()) bytes += m.language_model().lm_head.nbytes();
  return bytes;
}

/// Plain text tokens: below every special id of the config.
/// `length` ordinary token ids below `limit` (the model's first special id), from `seed`.
inline std::vector<int64_t> text_prompt(int64_t length, int64_t limit, uint64_t seed) {
  std::vector<int64_t> p(static_cast<size_t>(length));
  uint64_t x = seed;
  for (auto& t : p) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    t = static_cast<int64_t>((x >> 33) % static_cast<uint64_t>(limit));
  }
  return p;
}

inline std::vector<int64_t> text_prompt(int64_t length, const QwenVlConfig& c, uint64_t seed) {
  return text_prompt(
      length,
      std::min({c.vocab_size, c.image_token_id, c.video_token_id, c.vision_start_token_id, c.vision_end_token_id}),
      seed);
}

/// The first id of `model`'s vocabulary that is an image, video or vision marker token.
inline int64_t first_special_id(const CausalVlm& model) {
  const ModelTraits& t = model.traits();
  int64_t limit = t.vocab_size;
  for (const auto& id : {t.image_token_id, t.video_token_id, t.vision_start_token_id, t.vision_end_token_id}) {
    if (id) limit = std::min(limit, *id);
  }
  return limit;
}

/// Gemma-3 and LLaVA-NeXT with the 100M LM's sizes (config_100m): Gemma-3's sliding window of 512
/// on 5 layers of 6 (so a context of 512 fits it), LLaVA-NeXT's Llama text model; small towers.
inline Gemma3Config gemma3_100m() {
  Gemma3Config c = Gemma3Config::tiny();
  c.hidden_size = 768;
  c.num_hidden_layers = 12;
  c.num_attention_heads = 12;
  c.num_key_value_heads = 4;
  c.head_dim = 64;
  c.query_pre_attn_scalar = 64;
  c.intermediate_size = 2048;
  c.vocab_size = 16384;
  c.max_position_embeddings = 8192;
  c.sliding_window = 512;
  c.sliding_layers.clear();
  for (int64_t i = 0; i < 12; ++i) c.sliding_layers.push_back((i + 1) % 6 != 0);
  c.image_token_id = 16000;
  c.boi_token_id = 16002;
  c.eoi_token_id = 16003;
  c.vision_hidden_size = 384;
  c.vision_intermediate_size = 1536;
  c.vision_num_hidden_layers = 4;
  c.vision_num_attention_heads = 6;
  c.image_size = 224;
  c.patch_size = 14;
  c.mm_tokens_per_image = 64;
  return c;
}

inline LlavaNextConfig llava_next_100m() {
  LlavaNextConfig c = LlavaNextConfig::tiny();
  c.hidden_size = 768;
  c.num_hidden_layers = 12;
  c.num_attention_heads = 12;
  c.num_key_value_heads = 4;
  c.head_dim = 64;
  c.intermediate_size = 2048;
  c.vocab_size = 16384;
  c.max_position_embeddings = 8192;
  c.image_token_id = 16000;
  c.vision_hidden_size = 384;
  c.vision_intermediate_size = 1536;
  c.vision_num_hidden_layers = 4;
  c.vision_num_attention_heads = 6;
  c.image_size = 224;
  c.patch_size = 14;
  c.image_grid_pinpoints = {{224, 448}, {448, 224}, {448, 448}};
  return c;
}

/// Bytes of every weight of the model (a tied lm_head once).
inline int64_t model_bytes(QwenVl& m) {
  int64_t bytes = 0;
  for (auto& [name, t] : m.named_weights()) bytes += t->numel() * static_cast<int64_t>(t->element_size());
  return bytes;
}

inline double decode_bytes(QwenVl& m) { return static_cast<double>(decode_weight_bytes(m)); }

inline bool kernels_enabled() { return kernels::enabled(); }

/// Sets both thread pools a run uses: ATen's (OpenMP) and OpenBLAS's own pthreads, which LibTorch
/// 1.13 leaves at one per core whatever at::set_num_threads says (found at run time, so a build
/// on another BLAS is unaffected). Returns whether OpenBLAS was found.
inline bool set_all_threads(int threads) {
  at::set_num_threads(threads);
  using SetThreads = void (*)(int);
  auto openblas = reinterpret_cast<SetThreads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (openblas != nullptr) openblas(threads);
  return openblas != nullptr;
}

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

/// Wraps a model and adds up the wall time of its image encoding and forward calls (forward and
/// forward_batch, each one's time also listed).
class TimedModel : public testing::ForwardingVlm {
 private:
  template <typename F>
  auto timed(F&& f, bool listed) {
    const auto t = Clock::now();
    auto out = f();
    const double s = seconds_since(t);
    model_s_ += s;
    if (listed) forward_s_.push_back(s);
    return out;
  }
  double model_s_ = 0;
  std::vector<double> forward_s_;

 public:
  explicit TimedModel(CausalVlm& inner) : ForwardingVlm(inner) {}
  at::Tensor encode_images(const VisionInputs& v) override {
    return timed([&] { return inner_.encode_images(v); }, false);
  }
  at::Tensor forward(const ForwardArgs& args) override {
    return timed([&] { return inner_.forward(args); }, true);
  }
  std::vector<at::Tensor> forward_batch(const std::vector<const ForwardArgs*>& calls) override {
    return timed([&] { return inner_.forward_batch(calls); }, true);
  }
  double model_seconds() const { return model_s_; }
  const std::vector<double>& forward_seconds() const { return forward_s_; }
  void reset() {
    model_s_ = 0;
    forward_s_.clear();
  }
};

/// The middle value (the upper one of an even count); 0 for none.
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

inline std::vector<std::string> supported_isa_names() {
  std::vector<std::string> out;
  for (kernels::Isa isa : kernels::supported_isas()) out.push_back(kernels::isa_name(isa));
  return out;
}

int run_speed_report(int rounds, const std::string& json_path);                  // speed_report.cpp
int run_memory_report(const std::string& dtype, const std::string& checkpoint);  // speed_report.cpp
int run_engine_report(int rounds, const std::string& json_path);                 // engine_report.cpp
/// The engine-only side of bench/serve_load.py: `clients` threads, each submitting its requests
/// one after another (a `prompt_tokens` prompt, `new_tokens` new tokens), on the 100M model.
struct EngineLoad {
  int64_t clients = 1;
  int64_t requests_per_client = 4;
  int64_t prompt_tokens = 64;
  int64_t new_tokens = 48;
};
int run_engine_load(const EngineLoad& load);  // engine_report.cpp

}  // namespace vlmgen::bench
