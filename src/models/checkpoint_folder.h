#pragma once

// HF checkpoint folders: where a multimodal model's tensors sit (either transformers spelling), and
// writing config.json + model.safetensors from the full tensors, once for a tensor-parallel group.
// Private to src/models.

#include <ATen/ATen.h>

#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "vlmgen/distributed/communicator.h"
#include "vlmgen/error.h"
#include "vlmgen/io/safetensors.h"
#include "vlmgen/models/qwen_vl.h"

namespace vlmgen::detail {

/// This rank's slice of tensor `name` ([full_shape], already checked) under `layout` as `dtype`,
/// read from the mapping without touching the other ranks' bytes: a fresh contiguous tensor of
/// this rank's size (never a view that keeps the whole weight alive).
inline at::Tensor read_shard(const SafetensorsCheckpoint& checkpoint, const std::string& name,
                             const std::vector<int64_t>& full_shape, qwen_vl::ShardLayout layout, int64_t rank,
                             int64_t tp, at::ScalarType dtype) {
  switch (layout) {
    case qwen_vl::ShardLayout::kReplicated: return checkpoint.tensor_as(name, dtype);
    case qwen_vl::ShardLayout::kRows: {
      const int64_t rows = full_shape[0] / tp;
      return checkpoint.narrow_as(name, 0, rank * rows, rows, dtype);
    }
    case qwen_vl::ShardLayout::kColumns: {
      const int64_t cols = full_shape[1] / tp;
      return checkpoint.narrow_as(name, 1, rank * cols, cols, dtype);
    }
    case qwen_vl::ShardLayout::kStackedRows: {
      const int64_t third = full_shape[0] / 3;
      const int64_t rows = third / tp;
      std::vector<at::Tensor> parts;
      for (int64_t i = 0; i < 3; ++i)
        parts.push_back(checkpoint.narrow_as(name, 0, i * third + rank * rows, rows, dtype));
      return at::cat(parts, 0);
    }
  }
  VLMGEN_FAIL("unknown shard layout of tensor {}", name);
}

/// read_shard of a tensor of 1 or more dims written into `out` (contiguous CPU, the slice's
/// shape, checked; its dtype is the one read as): nothing is allocated on the way but for the
/// stacked layout, which reads the slice and copies it (shapes must then match exactly).
inline void read_shard_into(const SafetensorsCheckpoint& checkpoint, const std::string& name,
                            const std::vector<int64_t>& full_shape, qwen_vl::ShardLayout layout, int64_t rank,
                            int64_t tp, at::Tensor& out) {
  switch (layout) {
    case qwen_vl::ShardLayout::kReplicated: return checkpoint.narrow_into(name, 0, 0, out);
    case qwen_vl::ShardLayout::kRows: return checkpoint.narrow_into(name, 0, rank * (full_shape[0] / tp), out);
    case qwen_vl::ShardLayout::kColumns: return checkpoint.narrow_into(name, 1, rank * (full_shape[1] / tp), out);
    case qwen_vl::ShardLayout::kStackedRows: {
      const at::Tensor slice = read_shard(checkpoint, name, full_shape, layout, rank, tp, out.scalar_type());
      VLMGEN_CHECK(slice.sizes() == out.sizes(), "tensor {}: this rank's slice is {}, not the {} to read it into", name,
                   slice.sizes(), out.sizes());
      out.copy_(slice);
      return;
    }
  }
  VLMGEN_FAIL("unknown shard layout of tensor {}", name);
}

/// Where tensor `name` of a transformers conditional-generation model (>= 4.52 spelling:
/// `model.language_model.*`, `model.vision_tower.*`, `model.multi_modal_projector.*`,
/// `lm_head.weight`) may sit in a checkpoint: that name, then the earlier spelling
/// (`language_model.model.*`, `language_model.lm_head.weight`, `vision_tower.*`, ...).
inline std::vector<std::string> multimodal_name_candidates(const std::string& name) {
  const std::string lm = "model.language_model.";
  if (name.compare(0, lm.size(), lm) == 0) return {name, "language_model.model." + name.substr(lm.size())};
  if (name == "lm_head.weight") return {name, "language_model.lm_head.weight"};
  if (name.compare(0, 6, "model.") == 0) return {name, name.substr(6)};
  return {name};
}

inline void write_checkpoint_folder(const std::string& dir, const std::string& config_json,
                                    const std::map<std::string, at::Tensor>& tensors) {
  const std::filesystem::path root(dir);
  std::error_code ec;
  std::filesystem::create_directories(root, ec);
  VLMGEN_CHECK(!ec, "cannot create checkpoint directory {}: {}", dir, ec.message());
  {
    const std::string path = (root / "config.json").string();
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    VLMGEN_CHECK(out.good(), "cannot open {} for writing", path);
    out << config_json;
    out.close();
    VLMGEN_CHECK(!out.fail(), "writing {} failed", path);
  }
  save_safetensors((root / "model.safetensors").string(), tensors, {{"format", "pt"}});
}

/// Rank 0 of `comm` (or the only process, when `comm` is null) writes the folder; every rank
/// returns once it is written, or raises when rank 0 could not write it.
inline void write_checkpoint_once(const std::string& dir, const std::string& config_json,
                                  const std::map<std::string, at::Tensor>& tensors, Communicator* comm, int64_t rank) {
  std::string failure;
  if (rank == 0) {
    try {
      write_checkpoint_folder(dir, config_json, tensors);
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  if (comm != nullptr) {
    at::Tensor written = at::full({1}, failure.empty() ? 1 : 0, at::kLong);
    comm->broadcast(written, 0);
    VLMGEN_CHECK(written.item<int64_t>() == 1 || rank == 0,
                 "rank 0 could not write checkpoint {} (its own error says why)", dir);
  }
  if (!failure.empty()) throw Error(failure);
}

}  // namespace vlmgen::detail
