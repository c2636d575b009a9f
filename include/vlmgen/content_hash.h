#pragma once

// Content identity: SHA-256 (FIPS 180-4) over tensors' bytes, shape and dtype. Used for image
// identity (a continuation or a prefix-cache hit must bring the same picture) and for checking
// that every tensor-parallel rank got the same request. A full-width cryptographic hash, so a
// crafted edit cannot make two pictures collide as it can with a checksum.

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace vlmgen {

/// A 256-bit digest.
using ContentHash = std::array<uint8_t, 32>;

/// Lower-case hex of a digest (or of its first `bytes` bytes), for logs and messages.
inline std::string to_hex(const ContentHash& h, size_t bytes = 32) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < bytes && i < h.size(); ++i) {
    out.push_back(digits[h[i] >> 4]);
    out.push_back(digits[h[i] & 15]);
  }
  return out;
}

/// Incremental SHA-256.
///
///   vlmgen::Sha256 sha;
///   sha.update("abc", 3);
///   vlmgen::ContentHash h = sha.finish();
class Sha256 {
 public:
  Sha256& update(const void* data, size_t size) {
    if (size == 0) return *this;  // data may be null then (an empty vector or tensor)
    const auto* p = static_cast<const uint8_t*>(data);
    total_bytes_ += size;
    if (used_ > 0) {
      const size_t take = std::min(size, block_.size() - used_);
      std::memcpy(block_.data() + used_, p, take);
      used_ += take;
      p += take;
      size -= take;
      if (used_ < block_.size()) return *this;
      compress(block_.data());
      used_ = 0;
    }
    for (; size >= 64; p += 64, size -= 64) compress(p);
    std::memcpy(block_.data(), p, size);
    used_ = size;
    return *this;
  }
  Sha256& update(const std::string& s) { return update(s.data(), s.size()); }
  /// A fixed-width integer, little-endian, so hashes agree across hosts.
  Sha256& update_int(int64_t v) {
    uint8_t b[8];
    for (int i = 0; i < 8; ++i) b[i] = static_cast<uint8_t>(static_cast<uint64_t>(v) >> (8 * i));
    return update(b, 8);
  }

  /// The digest; the object must not be updated afterwards.
  ContentHash finish() {
    const uint64_t bits = total_bytes_ * 8;
    const uint8_t one = 0x80;
    update(&one, 1);
    const uint8_t zero = 0;
    while (used_ != 56) update(&zero, 1);
    uint8_t length[8];
    for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(bits >> (56 - 8 * i));
    update(length, 8);
    ContentHash out;
    for (int i = 0; i < 8; ++i) {
      for (int j = 0; j < 4; ++j) out[4 * i + j] = static_cast<uint8_t>(state_[i] >> (24 - 8 * j));
    }
    return out;
  }

 private:
  static uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

  void compress(const uint8_t* block) {
    static constexpr uint32_t k[64] = {
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
        0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
        0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
        0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
        0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
        0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
        0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};
    uint32_t w[64];
    for (int i = 0; i < 16; ++i) {
      w[i] = uint32_t{block[4 * i]} << 24 | uint32_t{block[4 * i + 1]} << 16 | uint32_t{block[4 * i + 2]} << 8 |
             uint32_t{block[4 * i + 3]};
    }
    for (int i = 16; i < 64; ++i) {
      const uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      const uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = state_[0], b = state_[1], c = state_[2], d = state_[3];
    uint32_t e = state_[4], f = state_[5], g = state_[6], h = state_[7];
    for (int i = 0; i < 64; ++i) {
      const uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + k[i] + w[i];
      const uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      h = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = b;
      b = a;
      a = t1 + t2;
    }
    state_[0] += a;
    state_[1] += b;
    state_[2] += c;
    state_[3] += d;
    state_[4] += e;
    state_[5] += f;
    state_[6] += g;
    state_[7] += h;
  }

  std::array<uint32_t, 8> state_ = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                    0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  std::array<uint8_t, 64> block_{};
  size_t used_ = 0;
  uint64_t total_bytes_ = 0;
};

/// Feeds a tensor's identity into `sha`: defined or not, dtype, shape, then its bytes in
/// row-major order (read from a contiguous host copy when it is not one already).
inline void hash_tensor(Sha256& sha, const at::Tensor& t) {
  if (!t.defined()) {
    sha.update_int(-1);
    return;
  }
  sha.update(std::string(c10::toString(t.scalar_type())));
  sha.update_int(t.dim());
  for (int64_t s : t.sizes()) sha.update_int(s);
  const at::Tensor host = t.device().is_cpu() && t.is_contiguous() ? t : t.to(at::kCPU).contiguous();
  sha.update(host.data_ptr(), static_cast<size_t>(host.numel()) * host.element_size());
}

}  // namespace vlmgen
