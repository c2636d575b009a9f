#pragma once

// What rank 0 of a tensor-parallel Engine sends the other ranks before every step: the requests
// it admits (their prompts, images and options, as bytes), the cancellations and streaming-
// callback answers that take effect, and the numbers of the state it stepped from. Every rank
// then runs the same step: same calls, same windows, same tokens. A rank whose state differs
// (other options, other cache contents) stops with an error before the step's collectives; a
// request that fails on some ranks only is caught by the engine's checks after starting and
// after stepping (Engine::run_step).

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "vlmgen/detail/checked_math.h"
#include "vlmgen/error.h"
#include "vlmgen/replay_policy.h"
#include "vlmgen/request.h"
#include "vlmgen/vision_inputs.h"

namespace vlmgen::detail {

/// Appends plain values, strings and tensors to a byte string.
class ByteWriter {
 public:
  template <typename T>
  void put(T value) {
    static_assert(std::is_trivially_copyable_v<T>, "put takes plain values");
    if constexpr (std::is_same_v<T, bool>) {
      put<uint8_t>(value ? 1 : 0);
    } else {
      bytes_.append(reinterpret_cast<const char*>(&value), sizeof value);
    }
  }
  void put_bytes(const void* data, size_t size) {
    put(static_cast<uint64_t>(size));
    bytes_.append(static_cast<const char*>(data), size);
  }
  template <typename T>
  void put_vector(const std::vector<T>& values) {
    put_bytes(values.data(), values.size() * sizeof(T));
  }
  /// Defined or not, whether it sat on the CPU, dtype, shape, then its bytes in row-major order.
  void put_tensor(const at::Tensor& t) {
    put<uint8_t>(t.defined() ? 1 : 0);
    if (!t.defined()) return;
    put<uint8_t>(t.device().is_cpu() ? 1 : 0);
    put<int16_t>(static_cast<int16_t>(t.scalar_type()));
    put_vector(t.sizes().vec());
    const at::Tensor host = t.to(at::kCPU).contiguous();
    put_bytes(host.data_ptr(), static_cast<size_t>(host.numel()) * host.element_size());
  }
  std::string& bytes() { return bytes_; }

 private:
  std::string bytes_;
};

/// Reads what a ByteWriter wrote, in the same order; running past the end is a vlmgen::Error.
class ByteReader {
 public:
  explicit ByteReader(const std::string& bytes) : bytes_(bytes) {}
  template <typename T>
  T get() {
    static_assert(std::is_trivially_copyable_v<T> && !std::is_same_v<T, bool>, "get takes plain values; see get_bool");
    T value;
    std::memcpy(&value, take(sizeof value), sizeof value);
    return value;
  }
  bool get_bool() {
    const auto byte = get<uint8_t>();
    VLMGEN_CHECK(byte <= 1, "a step plan holds {} where true or false was expected", byte);
    return byte == 1;
  }
  /// A count of entries that take at least `entry_bytes` bytes each: no more than the bytes left.
  size_t get_count(size_t entry_bytes) {
    const auto count = get<uint64_t>();
    VLMGEN_CHECK(count <= (bytes_.size() - offset_) / std::max<size_t>(entry_bytes, 1),
                 "a step plan announces {} entries at {} but has {} bytes left", count, offset_,
                 bytes_.size() - offset_);
    return static_cast<size_t>(count);
  }
  /// An enumeration value below `count`.
  template <typename Enum>
  Enum get_enum(int32_t count) {
    const auto value = get<int32_t>();
    VLMGEN_CHECK(value >= 0 && value < count, "a step plan holds value {} for a choice of {}", value, count);
    return static_cast<Enum>(value);
  }
  template <typename T>
  std::vector<T> get_vector() {
    const auto size = get<uint64_t>();
    VLMGEN_CHECK(size % sizeof(T) == 0, "a step plan's list of {}-byte values is {} bytes long", sizeof(T), size);
    const char* data = take(size);
    std::vector<T> values(size / sizeof(T));
    if (size > 0) std::memcpy(values.data(), data, size);
    return values;
  }
  std::string get_string() {
    const auto size = get<uint64_t>();
    return std::string(take(size), size);
  }
  /// A tensor put_tensor wrote: on the CPU when it was there, else on `device`.
  at::Tensor get_tensor(at::Device device) {
    if (!get_bool()) return at::Tensor();
    const bool on_cpu = get_bool();
    const auto code = get<int16_t>();
    VLMGEN_CHECK(code >= 0 && code < static_cast<int16_t>(at::ScalarType::Undefined),
                 "a step plan's tensor has dtype code {}", code);
    const auto dtype = static_cast<at::ScalarType>(code);
    const std::vector<int64_t> sizes = get_vector<int64_t>();
    int64_t want = static_cast<int64_t>(c10::elementSize(dtype));
    for (int64_t s : sizes) {
      VLMGEN_CHECK(s >= 0, "a step plan's tensor has a negative size in [{}]", fmt::join(sizes, ", "));
      want = checked_mul(want, s, "a step plan's tensor bytes");
    }
    const auto size = get<uint64_t>();
    VLMGEN_CHECK(size == static_cast<uint64_t>(want), "a step plan's tensor of shape [{}] holds {} bytes, expected {}",
                 fmt::join(sizes, ", "), size, want);
    const char* data = take(size);
    at::Tensor t = at::empty(sizes, at::TensorOptions().dtype(dtype));
    if (size > 0) std::memcpy(t.data_ptr(), data, size);
    return on_cpu ? t : t.to(device);
  }
  bool done() const { return offset_ == bytes_.size(); }

 private:
  const char* take(size_t size) {
    VLMGEN_CHECK(size <= bytes_.size() - offset_, "a step plan ends after {} bytes; {} more were expected at {}",
                 bytes_.size(), size, offset_);
    const char* at = bytes_.data() + offset_;
    offset_ += size;
    return at;
  }
  const std::string& bytes_;
  size_t offset_ = 0;
};

/// A request's prompts, images and every option (not its callback, cancel flag or context,
/// which stay on the rank that has them). Read back by read_request.
inline void write_request(ByteWriter& w, const GenerateRequest& request, const GenerationConfig& c) {
  w.put(static_cast<uint64_t>(request.prompts.size()));
  for (const auto& p : request.prompts) w.put_vector(p);
  w.put(static_cast<int32_t>(request.vision.layout));
  w.put_tensor(request.vision.pixel_values);
  w.put_tensor(request.vision.image_grid_thw);
  w.put_tensor(request.vision.image_sizes);
  w.put(c.max_new_tokens());
  w.put(c.enable_kv_cache());
  w.put(static_cast<int32_t>(c.replay_mode()));
  w.put_vector(c.end_token_ids());
  w.put_vector(c.stop_token_ids());
  w.put(c.pad_token_id());
  w.put(c.temperature());
  w.put(c.top_k());
  w.put(c.top_p());
  w.put(c.seed());
  w.put_vector(c.row_seeds());
  w.put(c.return_logprobs());
  w.put(c.prefill_chunk_size());
  w.put(c.encoder_cache());
  w.put(c.allow_placeholder_tokens());
  w.put(c.full_logits());
  w.put(c.check_pixel_values());
  w.put(c.prompt_logprobs());
  w.put(c.top_logprobs());
  w.put(c.return_logits());
}

/// The request and options write_request wrote; tensors that were not on the CPU land on `device`.
inline std::pair<GenerateRequest, GenerationConfig> read_request(ByteReader& r, at::Device device) {
  GenerateRequest request;
  request.prompts.resize(r.get_count(sizeof(uint64_t)));
  for (auto& p : request.prompts) p = r.get_vector<int64_t>();
  request.vision.layout = r.get_enum<VisionLayout>(2);
  request.vision.pixel_values = r.get_tensor(device);
  request.vision.image_grid_thw = r.get_tensor(device);
  request.vision.image_sizes = r.get_tensor(device);
  GenerationConfig c;
  c.max_new_tokens(r.get<int64_t>());
  c.enable_kv_cache(r.get_bool());
  c.replay_mode(r.get_enum<ReplayMode>(3));
  c.end_token_ids(r.get_vector<int64_t>());
  c.stop_token_ids(r.get_vector<int64_t>());
  c.pad_token_id(r.get<int64_t>());
  c.temperature(r.get<double>());
  c.top_k(r.get<int64_t>());
  c.top_p(r.get<double>());
  c.seed(r.get<uint64_t>());
  c.row_seeds(r.get_vector<uint64_t>());
  c.return_logprobs(r.get_bool());
  c.prefill_chunk_size(r.get<int64_t>());
  c.encoder_cache(r.get_bool());
  c.allow_placeholder_tokens(r.get_bool());
  c.full_logits(r.get_bool());
  c.check_pixel_values(r.get_bool());
  c.prompt_logprobs(r.get_bool());
  c.top_logprobs(r.get<int64_t>());
  c.return_logits(r.get_bool());
  return {std::move(request), std::move(c)};
}

/// Numbers every rank computes from its own engine before a step (options, running requests,
/// caches, counters); a rank whose numbers differ from rank 0's has drifted.
struct StepState {
  static constexpr size_t kSize = 18;
  static constexpr std::array<const char*, kSize> kNames = {
      "kv_block_columns",         "prefix_block_columns",     "prefix_cache_bytes option", "encoder_cache_bytes option",
      "prefill_columns_per_step", "running requests",         "running ids (hash)",        "generated tokens",
      "prefix-cache hits",        "prefix-cache hit columns", "prefix-cache entries",      "prefix-cache bytes",
      "prefix-cache evictions",   "encoder-cache hits",       "encoder-cache misses",      "encoder-cache entries",
      "encoder-cache bytes",      "encoder-cache evictions"};
  std::array<int64_t, kSize> values{};

  /// "name a vs b" for every number that differs.
  std::string differences(const StepState& other) const {
    std::vector<std::string> parts;
    for (size_t i = 0; i < kSize; ++i) {
      if (values[i] != other.values[i])
        parts.push_back(fmt::format("{} {} vs {}", kNames[i], values[i], other.values[i]));
    }
    return parts.empty() ? std::string("nothing differs") : fmt::format("{}", fmt::join(parts, ", "));
  }
};

/// A row whose streaming callback on rank 0 said stop.
struct RowCancel {
  uint64_t id = 0;  ///< the request
  int64_t row = 0;
};

/// One step's plan (see the top of this file).
struct StepPlan {
  bool stop = false;                      ///< rank 0's engine is shutting down: the others end their loop
  StepState state;                        ///< rank 0's state before this step
  std::vector<uint64_t> cancelled;        ///< running requests whose cancellation takes effect now
  std::vector<RowCancel> cancelled_rows;  ///< rows whose streaming callback said stop
  std::vector<uint64_t> failed;           ///< requests whose streaming callback threw on rank 0: they end
  std::vector<std::pair<uint64_t, std::string>> admitted;  ///< request id, write_request's bytes

  std::string encode() const {
    ByteWriter w;
    w.put(stop);
    w.put(state.values);
    w.put_vector(cancelled);
    w.put_vector(cancelled_rows);
    w.put_vector(failed);
    w.put(static_cast<uint64_t>(admitted.size()));
    for (const auto& [id, bytes] : admitted) {
      w.put(id);
      w.put_bytes(bytes.data(), bytes.size());
    }
    return std::move(w.bytes());
  }
  static StepPlan decode(const std::string& bytes) {
    ByteReader r(bytes);
    StepPlan plan;
    plan.stop = r.get_bool();
    plan.state.values = r.get<std::array<int64_t, StepState::kSize>>();
    plan.cancelled = r.get_vector<uint64_t>();
    plan.cancelled_rows = r.get_vector<RowCancel>();
    plan.failed = r.get_vector<uint64_t>();
    plan.admitted.resize(r.get_count(2 * sizeof(uint64_t)));
    for (auto& [id, request] : plan.admitted) {
      id = r.get<uint64_t>();
      request = r.get_string();
    }
    VLMGEN_CHECK(r.done(), "a step plan of {} bytes has bytes left after its last field", bytes.size());
    return plan;
  }
};

}  // namespace vlmgen::detail
