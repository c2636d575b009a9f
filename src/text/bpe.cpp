#include "bpe.h"

#include <queue>
#include <tuple>

namespace vlmgen::detail {

namespace {
// Pieces up to this many bytes are merged by scanning all pairs each round (cheap for words);
// longer ones through a heap, so a megabyte without a break costs n log n, not n².
constexpr size_t kShortPiece = 48;
}  // namespace

void BpeMerges::reserve(size_t count) {
  size_t capacity = 16;
  while (capacity < 2 * count) capacity *= 2;
  if (capacity <= table_.size()) return;
  std::vector<Entry> old;
  old.swap(table_);
  table_.assign(capacity, Entry());
  shift_ = 64;
  for (size_t c = capacity; c > 1; c /= 2) --shift_;
  size_ = 0;
  for (const Entry& e : old) {
    if (e.key == kEmpty) continue;
    size_t slot = slot_of(e.key);
    while (table_[slot].key != kEmpty) slot = (slot + 1) & (table_.size() - 1);
    table_[slot] = e;
    ++size_;
  }
}

void BpeMerges::grow() { reserve(table_.empty() ? 8 : table_.size()); }

bool BpeMerges::add(int32_t left, int32_t right, int32_t rank, int32_t merged) {
  if (2 * (size_ + 1) > table_.size()) grow();
  const uint64_t key = key_of(left, right);
  size_t slot = slot_of(key);
  while (table_[slot].key != kEmpty) {
    if (table_[slot].key == key) {
      table_[slot] = Entry{key, rank, merged};
      return false;
    }
    slot = (slot + 1) & (table_.size() - 1);
  }
  table_[slot] = Entry{key, rank, merged};
  ++size_;
  return true;
}

bool BpeMerges::find(int32_t left, int32_t right, int32_t* rank, int32_t* merged) const {
  if (table_.empty()) return false;
  const uint64_t key = key_of(left, right);
  size_t slot = slot_of(key);
  while (true) {
    const Entry& e = table_[slot];
    if (e.key == key) {
      *rank = e.rank;
      *merged = e.merged;
      return true;
    }
    if (e.key == kEmpty) return false;
    slot = (slot + 1) & (table_.size() - 1);
  }
}

void BpeMerges::encode(std::string_view piece, const std::array<int32_t, 256>& byte_ids,
                       std::vector<int64_t>& out) const {
  if (piece.size() > kShortPiece) {
    std::vector<int32_t> ids(piece.size());
    for (size_t i = 0; i < piece.size(); ++i) ids[i] = byte_ids[static_cast<uint8_t>(piece[i])];
    merge_long(ids, out);
    return;
  }
  int32_t ids[kShortPiece];
  for (size_t i = 0; i < piece.size(); ++i) ids[i] = byte_ids[static_cast<uint8_t>(piece[i])];
  merge_short(ids, piece.size(), out);
}

void BpeMerges::encode_ids(std::vector<int32_t>& ids, std::vector<int64_t>& out) const {
  if (ids.size() > kShortPiece) {
    merge_long(ids, out);
  } else {
    merge_short(ids.data(), ids.size(), out);
  }
}

void BpeMerges::merge_short(int32_t* ids, size_t n, std::vector<int64_t>& out) const {
  while (n > 1) {
    int32_t best_rank = INT32_MAX, best_merged = 0;
    size_t best = n;
    for (size_t i = 0; i + 1 < n; ++i) {
      int32_t rank = 0, merged = 0;
      if (find(ids[i], ids[i + 1], &rank, &merged) && rank < best_rank) {
        best_rank = rank;
        best_merged = merged;
        best = i;
      }
    }
    if (best == n) break;
    ids[best] = best_merged;
    for (size_t i = best + 1; i + 1 < n; ++i) ids[i] = ids[i + 1];
    --n;
  }
  out.insert(out.end(), ids, ids + n);
}

void BpeMerges::merge_long(const std::vector<int32_t>& ids, std::vector<int64_t>& out) const {
  struct Symbol {
    int32_t id;
    int32_t prev, next;  // -1 at the ends
    bool alive;
  };
  const auto n = static_cast<int32_t>(ids.size());
  std::vector<Symbol> symbols(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) {
    symbols[static_cast<size_t>(i)] = Symbol{ids[static_cast<size_t>(i)], i - 1, i + 1 < n ? i + 1 : -1, true};
  }
  // (rank, position of the left symbol, left id, right id); smallest rank, then leftmost.
  using Candidate = std::tuple<int32_t, int32_t, int32_t, int32_t>;
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
  const auto consider = [&](int32_t left) {
    if (left < 0) return;
    const int32_t right = symbols[static_cast<size_t>(left)].next;
    if (right < 0) return;
    int32_t rank = 0, merged = 0;
    const int32_t a = symbols[static_cast<size_t>(left)].id, b = symbols[static_cast<size_t>(right)].id;
    if (find(a, b, &rank, &merged)) heap.emplace(rank, left, a, b);
  };
  for (int32_t i = 0; i + 1 < n; ++i) consider(i);
  while (!heap.empty()) {
    const auto [rank, left, a, b] = heap.top();
    heap.pop();
    Symbol& l = symbols[static_cast<size_t>(left)];
    if (!l.alive || l.id != a || l.next < 0) continue;  // stale: this symbol changed since
    Symbol& r = symbols[static_cast<size_t>(l.next)];
    if (r.id != b) continue;
    int32_t merged_rank = 0, merged = 0;
    find(a, b, &merged_rank, &merged);
    l.id = merged;
    r.alive = false;
    l.next = r.next;
    if (r.next >= 0) symbols[static_cast<size_t>(r.next)].prev = left;
    consider(l.prev);
    consider(left);
  }
  for (int32_t i = 0; i >= 0; i = symbols[static_cast<size_t>(i)].next)
    out.push_back(symbols[static_cast<size_t>(i)].id);
}

}  // namespace vlmgen::detail
