#pragma once

// What one forward call gets of a request's images: the images whose placeholders its window
// computes, as pixels, or as embeddings from the request's encoder cache (the vision tower runs
// once per image per request). Consecutive calls over the same images reuse the selection.

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "vlmgen/content_hash.h"
#include "vlmgen/detail/tensor_utils.h"
#include "vlmgen/engine/encoder_cache.h"
#include "vlmgen/error.h"
#include "vlmgen/model.h"
#include "vlmgen/vision_inputs.h"

namespace vlmgen::detail {

class WindowVision {
 public:
  /// `vision`: the request's images on the model's device; `counts`: placeholder rows per image.
  /// With `use_encoder_cache`, images are encoded through model.encode_images and kept; with a
  /// `shared` cache too, they are first looked for there by content hash (and put there once
  /// encoded), so requests share them.
  WindowVision(CausalVlm& model, VisionInputs vision, std::vector<int64_t> counts, bool use_encoder_cache,
               EncoderCache* shared = nullptr)
      : model_(model),
        vision_(std::move(vision)),
        counts_(std::move(counts)),
        use_encoder_cache_(use_encoder_cache),
        shared_(use_encoder_cache ? shared : nullptr),
        embeddings_(static_cast<size_t>(vision_.num_images())) {}

  /// Fills args.images, args.vision and args.image_embeddings for `images` (indices into the
  /// request's bundle; empty: no vision, only the layout).
  void fill(const std::vector<int64_t>& images, ForwardArgs& args) {
    if (images.empty()) {
      args.vision.layout = vision_.layout;
      return;
    }
    if (images != last_images_) {
      last_images_ = images;
      last_vision_ = vision_.select(images);
      last_embeddings_ = use_encoder_cache_ ? embeddings_for(images) : at::Tensor();
    }
    args.images = images;
    args.vision = last_vision_;
    args.image_embeddings = last_embeddings_;
    // The embeddings are authoritative: the pixels stay behind, so a model cannot use the wrong
    // one and they do not cross to the device again for every call.
    if (last_embeddings_.defined()) args.vision.pixel_values = at::Tensor();
  }

  /// Images run through the vision tower so far.
  int64_t images_encoded() const { return images_encoded_; }

 private:
  at::Tensor embeddings_for(const std::vector<int64_t>& images) {
    std::vector<int64_t> missing;
    for (int64_t i : images) {
      if (embeddings_[static_cast<size_t>(i)].defined()) continue;
      if (shared_ != nullptr) {
        if (keys_.empty()) keys_ = vision_.fingerprints();
        const at::Tensor hit = shared_->find(keys_[static_cast<size_t>(i)]);
        if (hit.defined() && hit.dim() == 2 && hit.size(0) == counts_[static_cast<size_t>(i)]) {
          embeddings_[static_cast<size_t>(i)] = hit;
          continue;
        }
      }
      missing.push_back(i);
    }
    if (!missing.empty()) {
      at::Tensor encoded = model_.encode_images(vision_.select(missing));
      int64_t rows = 0;
      for (int64_t i : missing) rows += counts_[static_cast<size_t>(i)];
      VLMGEN_CHECK(encoded.defined() && encoded.dim() == 2 && encoded.size(0) == rows,
                   "encode_images returned {} for {} images needing {} embedding rows", shape_str(encoded),
                   missing.size(), rows);
      int64_t offset = 0;
      for (int64_t i : missing) {
        embeddings_[static_cast<size_t>(i)] = encoded.narrow(0, offset, counts_[static_cast<size_t>(i)]);
        offset += counts_[static_cast<size_t>(i)];
        // The cache gets its own compact copy: a view would keep the whole batch alive.
        if (shared_ != nullptr)
          shared_->insert(keys_[static_cast<size_t>(i)], embeddings_[static_cast<size_t>(i)].clone());
      }
      images_encoded_ += static_cast<int64_t>(missing.size());
    }
    std::vector<at::Tensor> parts;
    for (int64_t i : images) parts.push_back(embeddings_[static_cast<size_t>(i)]);
    return parts.size() == 1 ? parts[0] : at::cat(parts, 0);
  }

  CausalVlm& model_;
  VisionInputs vision_;
  std::vector<int64_t> counts_;
  bool use_encoder_cache_;
  EncoderCache* shared_;
  std::vector<ContentHash> keys_;       // per image, computed when the shared cache is first asked
  std::vector<at::Tensor> embeddings_;  // per image, once encoded
  std::vector<int64_t> last_images_;
  VisionInputs last_vision_;
  at::Tensor last_embeddings_;
  int64_t images_encoded_ = 0;
};

}  // namespace vlmgen::detail
