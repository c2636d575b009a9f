#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "vlmgen/content_hash.h"
#include "vlmgen/detail/checked_math.h"
#include "vlmgen/detail/tensor_utils.h"
#include "vlmgen/error.h"
#include "vlmgen/fp8_kv_rows.h"

namespace vlmgen {

/// Shape of a model's KV cache, from its config. `head_dim` is the model's own (never derived
/// as hidden / heads: the two differ in many models).
struct KvCacheSpec {
  int64_t num_layers = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  at::ScalarType dtype = at::kFloat;

  /// Elements of one stored key or value row: head_dim, and for an FP8 cache (at::kByte) the
  /// row's scale after its bytes (encode_fp8_kv_row).
  int64_t row_width() const { return dtype == at::kByte ? head_dim + kFp8KvScaleBytes : head_dim; }
  /// Bytes of K and V stored per token of one row across all layers.
  int64_t bytes_per_token() const {
    return 2 * num_layers * num_kv_heads * row_width() * static_cast<int64_t>(c10::elementSize(dtype));
  }
};

/// The dtypes the shipped models' KV caches may store (CausalVlm::set_kv_cache_dtype): float32
/// (exact), bfloat16 (half the bytes; each key and value rounded to nearest even when written,
/// read back exactly, attention still float32) or at::kByte, FP8 (E4M3 bytes and a float32 scale
/// per key or value row, encode_fp8_kv_row: about a quarter of float32's bytes; each element
/// rounded to 3 mantissa bits at its row's scale, attention still float32). A context itself holds
/// any dtype its model uses. The 16- and 8-bit caches on the CPU only: the CPU decode kernel reads
/// them as it goes, where elsewhere every step would widen the whole cache.
inline void check_kv_cache_dtype(at::ScalarType dtype, at::Device device) {
  VLMGEN_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kByte,
               "a KV cache stores float32, bfloat16 or FP8 (Byte), not {}", c10::toString(dtype));
  VLMGEN_CHECK(dtype == at::kFloat || device.is_cpu(),
               "a {} KV cache is for models on the CPU, but this one is on {}; keep the float32 cache there",
               dtype == at::kByte ? "FP8" : "bfloat16", device.str());
}

/// An image whose placeholders lie in a context's committed columns, with a fingerprint of its
/// pixels (VisionInputs::fingerprints), so a continuation can be checked to bring the same image.
struct CachedImage {
  int64_t row = 0;
  int64_t begin = 0;          ///< first placeholder column
  int64_t end = 0;            ///< one past the last
  ContentHash fingerprint{};  ///< VisionInputs::fingerprints of the picture
};

/// A static KV cache: storage for `capacity` token columns of `batch` rows, allocated once.
/// `length()` columns are filled; a forward call with a context writes its window at
/// [length, length + S) in every layer and the generator commits the window afterwards, so a
/// forward that throws half-way leaves the committed state as it was. The context also keeps
/// the token ids and attention mask it holds, so a later request can be checked to extend them.
///
///   vlmgen::InferenceContext ctx(model.traits().kv_cache, /*batch=*/1, /*capacity=*/512);
///   generator.generate({prefix, {}, &ctx}, config);   // caches the prefix
///   generator.generate({prefix_plus_turn, vision, &ctx}, config);   // continues from it
class InferenceContext {
 public:
  InferenceContext(const KvCacheSpec& spec, int64_t batch, int64_t capacity, at::Device device = at::kCPU)
      : spec_(spec), batch_(batch), capacity_(capacity) {
    VLMGEN_CHECK(spec.num_layers >= 0 && spec.num_kv_heads >= 1 && spec.head_dim >= 1,
                 "KV cache spec needs num_kv_heads >= 1 and head_dim >= 1, got layers={} kv_heads={} head_dim={}",
                 spec.num_layers, spec.num_kv_heads, spec.head_dim);
    VLMGEN_CHECK(batch >= 1, "InferenceContext batch must be >= 1, got {}", batch);
    VLMGEN_CHECK(capacity >= 1, "InferenceContext capacity must be >= 1, got {}", capacity);
    auto opts = at::TensorOptions().dtype(spec.dtype).device(device);
    // One allocation for every layer's K and V (never read beyond length(), so it needs no
    // initialisation); each layer's keys and values are views of it.
    const at::Tensor storage =
        at::empty({spec.num_layers, 2, batch, spec.num_kv_heads, capacity, spec.row_width()}, opts);
    for (int64_t l = 0; l < spec.num_layers; ++l) {
      keys_.push_back(storage.select(0, l).select(0, 0));
      values_.push_back(storage.select(0, l).select(0, 1));
    }
    tokens_ = at::zeros({batch, capacity}, at::kLong);
    mask_ = at::zeros({batch, capacity}, at::kLong);
  }

  /// Like the constructor, but the storage size is overflow-checked first and an allocation
  /// failure becomes a vlmgen::Error naming the bytes, instead of the allocator's own error.
  static std::unique_ptr<InferenceContext> allocate(const KvCacheSpec& spec, int64_t batch, int64_t capacity,
                                                    at::Device device = at::kCPU) {
    int64_t bytes = detail::checked_mul(detail::checked_mul(spec.num_layers, 2, "KV cache bytes"),
                                        detail::checked_mul(spec.num_kv_heads, spec.row_width(), "KV cache bytes"),
                                        "KV cache bytes");
    bytes = detail::checked_mul(
        detail::checked_mul(bytes, static_cast<int64_t>(c10::elementSize(spec.dtype)), "KV cache bytes"),
        detail::checked_mul(batch, capacity, "KV cache bytes"), "KV cache bytes");
    try {
      return std::make_unique<InferenceContext>(spec, batch, capacity, device);
    } catch (const c10::Error& e) {
      VLMGEN_FAIL("could not allocate a KV cache of {} bytes ({} rows x {} columns x {} layers) on {}: {}", bytes,
                  batch, capacity, spec.num_layers, device.str(), e.what_without_backtrace());
    } catch (const std::bad_alloc&) {
      VLMGEN_FAIL("could not allocate a KV cache of {} bytes ({} rows x {} columns x {} layers) on {}", bytes, batch,
                  capacity, spec.num_layers, device.str());
    }
  }

  /// A deep copy: its own storage holding the same committed columns and images, so several
  /// continuations can start from one cached prefix independently.
  InferenceContext clone() const {
    InferenceContext out = *this;
    for (auto& t : out.keys_) t = t.clone();
    for (auto& t : out.values_) t = t.clone();
    out.tokens_ = tokens_.clone();
    out.mask_ = mask_.clone();
    return out;
  }

  const KvCacheSpec& spec() const { return spec_; }
  int64_t batch_size() const { return batch_; }
  int64_t capacity() const { return capacity_; }
  /// Columns committed so far (the same for every row; left padding counts).
  int64_t length() const { return length_; }
  int64_t num_layers() const { return spec_.num_layers; }
  at::Device device() const { return keys_.empty() ? at::Device(at::kCPU) : keys_[0].device(); }
  /// Bytes of K/V storage allocated.
  int64_t bytes() const { return spec_.bytes_per_token() * batch_ * capacity_; }

  /// Throws unless `columns` more columns fit.
  void check_room(int64_t columns) const {
    VLMGEN_CHECK(length_ + columns <= capacity_,
                 "the KV cache holds {} of {} columns; {} more would overflow it (need capacity >= {})", length_,
                 capacity_, columns, length_ + columns);
  }

  /// Model side: writes the window's keys and values ([batch, kv_heads, S, head_dim]) for
  /// `layer` at columns [length, length + S) and returns the keys and values of columns
  /// [0, length + S), as views into the cache (in the cache's dtype: a bfloat16 cache stores the
  /// window rounded, and its own queries see it so, as later steps will; an FP8 cache returns its
  /// rows [batch, kv_heads, length + S, row_width] of bytes, decode_fp8_kv reads them).
  std::pair<at::Tensor, at::Tensor> append_kv(int64_t layer, const at::Tensor& k, const at::Tensor& v) {
    VLMGEN_CHECK(layer >= 0 && layer < spec_.num_layers, "layer {} is out of range for a cache of {} layers", layer,
                 spec_.num_layers);
    VLMGEN_CHECK(k.dim() == 4 && k.size(0) == batch_ && k.size(1) == spec_.num_kv_heads && k.size(3) == spec_.head_dim,
                 "keys must be [{}, {}, S, {}], got {}", batch_, spec_.num_kv_heads, spec_.head_dim,
                 detail::shape_str(k));
    VLMGEN_CHECK(v.sizes() == k.sizes(), "values {} must match keys {}", detail::shape_str(v), detail::shape_str(k));
    const int64_t s = k.size(2);
    check_room(s);
    if (spec_.dtype == at::kByte) {  // FP8: each row encoded with its scale
      keys_[layer].narrow(2, length_, s).copy_(encode_fp8_kv(k.to(at::kCPU)));
      values_[layer].narrow(2, length_, s).copy_(encode_fp8_kv(v.to(at::kCPU)));
    } else {
      keys_[layer].narrow(2, length_, s).copy_(k);
      values_[layer].narrow(2, length_, s).copy_(v);
    }
    return {keys_[layer].narrow(2, 0, length_ + s), values_[layer].narrow(2, 0, length_ + s)};
  }

  /// Model side, for kernels that write the window in place instead of calling append_kv: the
  /// whole K and V storage of `layer`, [batch, kv_heads, capacity, spec().row_width()] views. Columns
  /// [0, length) hold the committed keys and values; a forward call of S columns writes its own
  /// at [length, length + S) (check_room(S) first), as append_kv would.
  std::pair<at::Tensor, at::Tensor> layer_storage(int64_t layer) const {
    VLMGEN_CHECK(layer >= 0 && layer < spec_.num_layers, "layer {} is out of range for a cache of {} layers", layer,
                 spec_.num_layers);
    return {keys_[layer], values_[layer]};
  }

  /// Keys and values of the committed columns of `layer`, [batch, kv_heads, length, row_width]
  /// (head_dim but for an FP8 cache's rows of bytes).
  std::pair<at::Tensor, at::Tensor> kv(int64_t layer) const {
    VLMGEN_CHECK(layer >= 0 && layer < spec_.num_layers, "layer {} is out of range for a cache of {} layers", layer,
                 spec_.num_layers);
    return {keys_[layer].narrow(2, 0, length_), values_[layer].narrow(2, 0, length_)};
  }

  /// Generator side, after a forward call: the window's token ids and attention mask
  /// ([batch, S]) are now cached.
  void commit(const at::Tensor& input_ids, const at::Tensor& mask) {
    VLMGEN_CHECK(input_ids.dim() == 2 && input_ids.size(0) == batch_, "commit expects [{}, S] token ids, got {}",
                 batch_, detail::shape_str(input_ids));
    VLMGEN_CHECK(mask.sizes() == input_ids.sizes(), "commit mask {} must match token ids {}", detail::shape_str(mask),
                 detail::shape_str(input_ids));
    const int64_t s = input_ids.size(1);
    check_room(s);
    tokens_.narrow(1, length_, s).copy_(input_ids.to(at::kCPU, at::kLong));
    mask_.narrow(1, length_, s).copy_(mask.to(at::kCPU, at::kLong));
    length_ += s;
  }

  /// Token ids of the committed columns, [batch, length], int64, CPU.
  at::Tensor tokens() const { return tokens_.narrow(1, 0, length_); }
  /// Attention mask of the committed columns, [batch, length], int64 (1 real, 0 padding), CPU.
  at::Tensor attention_mask() const { return mask_.narrow(1, 0, length_); }

  /// Generator side: an image whose placeholders are now in the committed columns.
  void record_image(const CachedImage& image) {
    VLMGEN_CHECK(
        image.row >= 0 && image.row < batch_ && image.begin >= 0 && image.begin < image.end && image.end <= length_,
        "cached image at row {} columns [{}, {}) is outside the committed rows [0, {}) x columns [0, {})", image.row,
        image.begin, image.end, batch_, length_);
    images_.push_back(image);
  }
  /// Images recorded in the committed columns, in the order they were committed.
  const std::vector<CachedImage>& cached_images() const { return images_; }

  /// A new context of `capacity` columns holding this context's first `length` committed
  /// columns and the images inside them: a cached prefix that a longer request continues from.
  std::unique_ptr<InferenceContext> copy_prefix(int64_t length, int64_t capacity) const {
    VLMGEN_CHECK(length >= 0 && length <= length_ && capacity >= std::max<int64_t>(length, 1),
                 "copy_prefix of {} columns into a capacity of {} from a context of {} columns", length, capacity,
                 length_);
    auto out = allocate(spec_, batch_, capacity, device());
    for (size_t l = 0; l < keys_.size(); ++l) {
      out->keys_[l].narrow(2, 0, length).copy_(keys_[l].narrow(2, 0, length));
      out->values_[l].narrow(2, 0, length).copy_(values_[l].narrow(2, 0, length));
    }
    out->tokens_.narrow(1, 0, length).copy_(tokens_.narrow(1, 0, length));
    out->mask_.narrow(1, 0, length).copy_(mask_.narrow(1, 0, length));
    out->length_ = length;
    for (const CachedImage& image : images_) {
      if (image.end <= length) out->images_.push_back(image);
    }
    return out;
  }

  /// Forgets every column from `length` on (keeps a shared prefix, drops the rest), and the
  /// images that reach past it.
  void truncate(int64_t length) {
    VLMGEN_CHECK(length >= 0 && length <= length_, "cannot truncate a context of {} columns to {}", length_, length);
    length_ = length;
    images_.erase(std::remove_if(images_.begin(), images_.end(), [&](const CachedImage& i) { return i.end > length; }),
                  images_.end());
  }
  void reset() { truncate(0); }

 private:
  KvCacheSpec spec_;
  int64_t batch_;
  int64_t capacity_;
  int64_t length_ = 0;
  std::vector<at::Tensor> keys_;    // per layer [batch, kv_heads, capacity, row_width]
  std::vector<at::Tensor> values_;  // per layer [batch, kv_heads, capacity, row_width]
  at::Tensor tokens_;               // [batch, capacity], int64, CPU
  at::Tensor mask_;                 // [batch, capacity], int64, CPU
  std::vector<CachedImage> images_;
};

}  // namespace vlmgen
