#pragma once

// Image embeddings kept across requests, keyed by each image's content hash (SHA-256 of its
// pixels, shape and dtype: VisionInputs::fingerprints), so a picture the engine has seen is
// not run through the vision tower again. A byte budget with least-recently-used eviction.
// Eviction only drops the cache's reference: a request that already took an entry keeps it
// (tensors are reference-counted) until it ends, so nothing is evicted from under a request.
// Thread-safe.

#include <ATen/ATen.h>

#include <cstdint>
#include <list>
#include <map>
#include <mutex>
#include <utility>

#include "vlmgen/content_hash.h"

namespace vlmgen {

class EncoderCache {
 public:
  struct Stats {
    int64_t hits = 0;    ///< images found
    int64_t misses = 0;  ///< images looked for and not found
    int64_t entries = 0;
    int64_t bytes = 0;  ///< held by the entries
    int64_t evictions = 0;
  };

  /// `max_bytes` of embeddings at most (0: keep nothing).
  explicit EncoderCache(int64_t max_bytes) : max_bytes_(max_bytes) {}

  /// The embeddings of the image with content hash `key`, or an undefined tensor. Counts a hit
  /// or a miss.
  at::Tensor find(const ContentHash& key) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = index_.find(key);
    if (it == index_.end()) {
      ++stats_.misses;
      return at::Tensor();
    }
    ++stats_.hits;
    order_.splice(order_.begin(), order_, it->second);  // most recently used first
    return it->second->second;
  }

  /// Keeps `embeddings` for `key`, evicting the least recently used entries to stay within the
  /// budget. An entry larger than the whole budget is not kept.
  void insert(const ContentHash& key, const at::Tensor& embeddings) {
    const int64_t size = static_cast<int64_t>(embeddings.numel()) * static_cast<int64_t>(embeddings.element_size());
    std::lock_guard<std::mutex> lock(mutex_);
    if (size > max_bytes_ || index_.count(key) > 0) return;
    while (stats_.bytes + size > max_bytes_ && !order_.empty()) {
      const auto& last = order_.back();
      stats_.bytes -= bytes_of(last.second);
      index_.erase(last.first);
      order_.pop_back();
      ++stats_.evictions;
    }
    order_.emplace_front(key, embeddings);
    index_[key] = order_.begin();
    stats_.bytes += size;
    stats_.entries = static_cast<int64_t>(order_.size());
  }

  Stats stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    Stats s = stats_;
    s.entries = static_cast<int64_t>(order_.size());
    return s;
  }
  int64_t max_bytes() const { return max_bytes_; }

 private:
  static int64_t bytes_of(const at::Tensor& t) {
    return static_cast<int64_t>(t.numel()) * static_cast<int64_t>(t.element_size());
  }

  const int64_t max_bytes_;
  mutable std::mutex mutex_;
  std::list<std::pair<ContentHash, at::Tensor>> order_;  // most recently used first
  std::map<ContentHash, std::list<std::pair<ContentHash, at::Tensor>>::iterator> index_;
  Stats stats_;
};

}  // namespace vlmgen
