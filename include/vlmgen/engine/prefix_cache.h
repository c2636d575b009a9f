#pragma once

// KV-cache prefixes kept across requests. A prompt is cut into blocks of `block_columns`; block
// k's key chains block k-1's key with the block's token ids and, for every image whose
// placeholders lie in the block, the image's content hash and where its span begins — so a
// request that repeats a system prompt, earlier turns, or the same picture finds the columns
// computed before, and a different picture behind the same placeholder ids never does. A hit
// never ends inside an image: it is cut back to the image's first placeholder. Entries are
// copies of a finished prefill's first full blocks; least-recently-used eviction within a byte
// budget. Thread-safe. Batch-1 requests only.

#include <algorithm>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "vlmgen/content_hash.h"
#include "vlmgen/image_spans.h"
#include "vlmgen/inference_context.h"

namespace vlmgen {

class PrefixCache {
 public:
  struct Stats {
    int64_t lookups = 0;
    int64_t hits = 0;
    int64_t hit_columns = 0;  ///< prompt columns served from the cache
    int64_t entries = 0;
    int64_t bytes = 0;
    int64_t evictions = 0;
  };
  struct Hit {
    std::shared_ptr<const InferenceContext> context;  ///< holds at least `columns` committed columns
    int64_t columns = 0;
  };

  PrefixCache(int64_t block_columns, int64_t max_bytes) : block_(block_columns), max_bytes_(max_bytes) {}

  int64_t block_columns() const { return block_; }

  /// The key of every full block of `prompt` (one row, no padding), in order.
  std::vector<ContentHash> block_keys(const std::vector<int64_t>& prompt, const std::vector<ImageSpan>& spans,
                                      const std::vector<ContentHash>& fingerprints) const {
    std::vector<ContentHash> keys;
    ContentHash previous{};
    const auto full = static_cast<int64_t>(prompt.size()) / block_;
    for (int64_t k = 0; k < full; ++k) {
      Sha256 sha;
      sha.update(previous.data(), previous.size());
      sha.update(prompt.data() + k * block_, static_cast<size_t>(block_) * sizeof(int64_t));
      for (const ImageSpan& s : spans) {
        if (s.end <= k * block_ || s.begin >= (k + 1) * block_) continue;
        sha.update_int(s.begin);
        const ContentHash& f = fingerprints.at(static_cast<size_t>(s.image));
        sha.update(f.data(), f.size());
      }
      previous = sha.finish();
      keys.push_back(previous);
    }
    return keys;
  }

  /// The longest cached prefix of a prompt with these block keys, cut back so that it ends
  /// before the prompt's last column and outside every image; columns 0 when there is none.
  Hit lookup(const std::vector<ContentHash>& keys, const std::vector<ImageSpan>& spans, int64_t prompt_columns) {
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.lookups;
    for (auto k = static_cast<int64_t>(keys.size()); k > 0; --k) {
      const auto it = index_.find(keys[static_cast<size_t>(k - 1)]);
      if (it == index_.end()) continue;
      int64_t columns = std::min(k * block_, prompt_columns - 1);
      for (const ImageSpan& s : spans) {
        if (s.begin < columns && columns < s.end) columns = s.begin;
      }
      if (columns <= 0) return Hit{};
      order_.splice(order_.begin(), order_, it->second.entry);
      ++stats_.hits;
      stats_.hit_columns += columns;
      return Hit{it->second.entry->context, columns};
    }
    return Hit{};
  }

  /// Keeps the first `keys.size()` blocks of `context` (a finished prefill of the prompt these
  /// keys belong to), copying them; evicts least-recently-used entries to fit the budget.
  void insert(const std::vector<ContentHash>& keys, const InferenceContext& context) {
    const auto columns = static_cast<int64_t>(keys.size()) * block_;
    if (columns == 0 || columns > context.length()) return;
    const int64_t bytes = context.spec().bytes_per_token() * context.batch_size() * columns;
    std::lock_guard<std::mutex> lock(mutex_);
    if (bytes > max_bytes_ || index_.count(keys.back()) > 0) return;
    while (stats_.bytes + bytes > max_bytes_ && !order_.empty()) evict_last();
    order_.push_front(
        Entry{std::shared_ptr<const InferenceContext>(context.copy_prefix(columns, columns)), keys, bytes});
    for (size_t k = 0; k < keys.size(); ++k) {
      if (index_.count(keys[k]) == 0) index_[keys[k]] = Slot{order_.begin()};
    }
    stats_.bytes += bytes;
  }

  Stats stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    Stats s = stats_;
    s.entries = static_cast<int64_t>(order_.size());
    return s;
  }

 private:
  struct Entry {
    std::shared_ptr<const InferenceContext> context;
    std::vector<ContentHash> keys;
    int64_t bytes;
  };
  struct Slot {
    std::list<Entry>::iterator entry;
  };

  void evict_last() {
    const Entry& last = order_.back();
    for (const ContentHash& key : last.keys) {
      const auto it = index_.find(key);
      if (it != index_.end() && it->second.entry == std::prev(order_.end())) index_.erase(it);
    }
    stats_.bytes -= last.bytes;
    order_.pop_back();
    ++stats_.evictions;
  }

  const int64_t block_;
  const int64_t max_bytes_;
  mutable std::mutex mutex_;
  std::list<Entry> order_;  // most recently used first
  std::map<ContentHash, Slot> index_;
  Stats stats_;
};

}  // namespace vlmgen
