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

namespace vlmgen::detail {

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
