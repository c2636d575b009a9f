#pragma once

// Byte-pair encoding of one pre-tokenized piece: start from one token per byte (or per character),
// then apply the merge of lowest rank among adjacent pairs (the leftmost one on a tie) until none applies.

#include <array>
#include <cstdint>
#include <string_view>
#include <vector>

namespace vlmgen::detail {

class BpeMerges {
 public:
  /// Room for `count` merges without rehashing.
  void reserve(size_t count);
  /// Adds the merge (left, right) → merged at `rank`. False when the pair was already there: the
  /// later rank replaces it, as in HF tokenizers (its merges are collected into a map) and
  /// transformers.js.
  bool add(int32_t left, int32_t right, int32_t rank, int32_t merged);
  /// Rank of merging (left, right), and the merged id, or false when they do not merge.
  bool find(int32_t left, int32_t right, int32_t* rank, int32_t* merged) const;
  size_t size() const { return size_; }

  /// Appends the ids of `piece` (non-empty bytes) to `out`; `byte_ids[b]` is the token of byte b.
  void encode(std::string_view piece, const std::array<int32_t, 256>& byte_ids, std::vector<int64_t>& out) const;
  /// Merges the tokens `ids` (a piece's first tokens, one per character or byte) and appends the
  /// result to `out`.
  void encode_ids(std::vector<int32_t>& ids, std::vector<int64_t>& out) const;

 private:
  struct Entry {
    uint64_t key = kEmpty;
    int32_t rank = 0;
    int32_t merged = 0;
  };
  static constexpr uint64_t kEmpty = ~uint64_t{0};
  static uint64_t key_of(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
  }
  size_t slot_of(uint64_t key) const { return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> shift_); }
  void grow();
  void merge_short(int32_t* ids, size_t n, std::vector<int64_t>& out) const;
  void merge_long(const std::vector<int32_t>& ids, std::vector<int64_t>& out) const;

  std::vector<Entry> table_;
  size_t size_ = 0;
  int shift_ = 64;
};

}  // namespace vlmgen::detail
