#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "vlmgen/io/fp8.h"

namespace vlmgen {

/// One tensor's entry in a safetensors header.
struct SafetensorsEntry {
  std::string name;
  at::ScalarType dtype = at::kFloat;  // F32, F16 or BF16 (also I64/I32/U8/BOOL for non-weights)
  std::optional<Fp8Format> fp8;       // F8_E4M3/F8_E5M2: the bytes, read as uint8 (dtype kByte)
  std::vector<int64_t> shape;
  int64_t begin = 0;  // byte offsets into the data section
  int64_t end = 0;
};

/// A memory-mapped .safetensors file. Tensors are read lazily; `narrow` reads only a slice of a
/// tensor along one dimension (for loading a tensor-parallel shard without reading the rest).
/// Malformed files throw vlmgen::Error naming the file and what is wrong. Refused, besides
/// malformed JSON: a path that is not a regular file (a FIFO would block), a header over 100 MB
/// or nested deeper than kMaxJsonDepth (vlmgen/io/json.h), a shape of more than 64 dimensions
/// or whose byte size overflows, and a data section that the tensors do not cover exactly once
/// (overlapping tensors, holes between them, bytes before the first or after the last).
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  bool contains(const std::string& name) const;
  std::vector<std::string> names() const;                        // sorted
  const SafetensorsEntry& entry(const std::string& name) const;  // throws when absent
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  /// Bytes of the data section (after the header): the sum of all tensors' byte sizes.
  int64_t data_bytes() const { return data_size_; }

  /// The whole tensor, copied out of the mapping (CPU, the file's dtype; FP8 as uint8 bytes),
  /// dropping the mapping's pages behind the copy as tensor_as does.
  at::Tensor tensor(const std::string& name) const;
  /// Rows [start, start + length) of dimension `dim` only (pages dropped likewise).
  at::Tensor narrow(const std::string& name, int64_t dim, int64_t start, int64_t length) const;
  /// As tensor() and narrow(), converted to `dtype` on the way: the file's bytes go through a
  /// 4 MiB buffer, so no whole copy in the file's dtype is ever made (a float32 checkpoint loaded
  /// as bfloat16 peaks at the bfloat16 tensor, not at both). Both drop the mapping's pages behind
  /// the copy as they go. An FP8 tensor can only be read as its bytes (at::kByte).
  at::Tensor tensor_as(const std::string& name, at::ScalarType dtype) const;
  at::Tensor narrow_as(const std::string& name, int64_t dim, int64_t start, int64_t length, at::ScalarType dtype) const;
  /// As narrow_as(name, dim, start, out.size(dim), out's dtype), written into `out` (contiguous,
  /// CPU, of the tensor's shape but out.size(dim) along `dim`) instead of a new tensor: for
  /// memory the caller placed. A bool tensor cannot be read this way.
  void narrow_into(const std::string& name, int64_t dim, int64_t start, at::Tensor& out) const;
  /// Drops the mapping's resident pages that lie wholly inside tensor `name` (they are read back
  /// from the file if the tensor is read again). The reads above already drop what they read,
  /// but for a page shared by two of their pieces or runs; a loader calls this once it is done
  /// with a tensor so none of its pages stays resident beside the copies.
  void release(const std::string& name) const;

 private:
  void read_header(std::string_view text);
  /// `dim` made non-negative, after checking it and [start, start + length) against the entry.
  int64_t checked_narrow(const SafetensorsEntry& e, const std::string& name, int64_t dim, int64_t start,
                         int64_t length) const;
  /// Rows [start, start + out.size(dim)) of dimension `dim` into `out`, converted to its dtype.
  void copy_narrowed(const SafetensorsEntry& e, int64_t dim, int64_t start, at::Tensor& out) const;
  /// `outer` runs of `run` bytes, `stride` apart from `first` in the data section, into `out`
  /// (contiguous; its dtype may differ from the entry's), dropping the pages read.
  void copy_runs(const SafetensorsEntry& e, int64_t first, int64_t outer, int64_t run, int64_t stride,
                 at::Tensor& out) const;

  std::string path_;
  std::map<std::string, SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
  const uint8_t* data_ = nullptr;  // start of the data section inside the mapping
  int64_t data_size_ = 0;
  size_t mapped_size_ = 0;
  void* mapping_ = nullptr;
};

/// A checkpoint made of one model.safetensors or shards listed in model.safetensors.index.json.
/// The index is held to 64 MiB and kMaxJsonDepth; shard names must be plain file names next to
/// it, and every file must be a regular one.
class SafetensorsCheckpoint {
 public:
  /// `dir` holds model.safetensors or model.safetensors.index.json (+ its shards).
  explicit SafetensorsCheckpoint(const std::string& dir);
  /// Bytes of tensor data in all files together: what a config's weights can be read from.
  int64_t data_bytes() const;
  bool contains(const std::string& name) const;
  std::vector<std::string> names() const;  // sorted
  const SafetensorsEntry& entry(const std::string& name) const;
  at::Tensor tensor(const std::string& name) const;
  at::Tensor narrow(const std::string& name, int64_t dim, int64_t start, int64_t length) const;
  at::Tensor tensor_as(const std::string& name, at::ScalarType dtype) const;
  at::Tensor narrow_as(const std::string& name, int64_t dim, int64_t start, int64_t length, at::ScalarType dtype) const;
  void narrow_into(const std::string& name, int64_t dim, int64_t start, at::Tensor& out) const;
  void release(const std::string& name) const;  // SafetensorsFile::release in the file holding it

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> owner_;  // tensor name -> index into files_
};

/// Writes `tensors` (contiguous CPU copies are made as needed) to `path` in safetensors format.
/// The uint8 tensors named in `fp8_tensors` are written with that FP8 dtype.
void save_safetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {},
                      const std::map<std::string, Fp8Format>& fp8_tensors = {});

}  // namespace vlmgen
