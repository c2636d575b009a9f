#include "vlmgen/io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <utility>

#include "vlmgen/error.h"

namespace vlmgen {
namespace {

using Json = nlohmann::json;

// Same bound as the reference implementation: a header larger than this is not a checkpoint
// header but garbage, and parsing it would cost memory proportional to its size.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr const char* kMetadataKey = "__metadata__";

struct DtypeName {
  const char* name;
  at::ScalarType type;
};

// Only dtypes that LibTorch 1.13 can hold; U16/U32/U64 and the F8 formats are rejected by name.
constexpr DtypeName kDtypes[] = {
    {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf}, {"BF16", at::kBFloat16}, {"I64", at::kLong},
    {"I32", at::kInt},    {"I16", at::kShort}, {"I8", at::kChar},  {"U8", at::kByte},       {"BOOL", at::kBool},
};

bool dtype_from_name(const std::string& name, at::ScalarType* type) {
  for (const auto& d : kDtypes) {
    if (name == d.name) {
      *type = d.type;
      return true;
    }
  }
  return false;
}

const char* dtype_name(at::ScalarType type) {
  for (const auto& d : kDtypes) {
    if (type == d.type) return d.name;
  }
  return nullptr;
}

std::string supported_dtype_list() {
  std::string out;
  for (const auto& d : kDtypes) {
    if (!out.empty()) out += ", ";
    out += d.name;
  }
  return out;
}

// Reads a JSON integer that fits int64 and is >= 0; anything else throws naming `what`.
int64_t non_negative_int(const Json& value, const std::string& path, const std::string& what) {
  if (value.is_number_unsigned()) {
    const uint64_t v = value.get<uint64_t>();
    VLMGEN_CHECK(v <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
                 "safetensors file '{}': {} is {}, beyond the int64 range", path, what, v);
    return static_cast<int64_t>(v);
  }
  if (value.is_number_integer()) {
    const int64_t v = value.get<int64_t>();
    VLMGEN_CHECK(v >= 0, "safetensors file '{}': {} must be >= 0, got {}", path, what, v);
    return v;
  }
  VLMGEN_FAIL("safetensors file '{}': {} must be a non-negative integer, got JSON {}", path, what, value.type_name());
}

// JSON for a message, cut short: a hostile header could hold a million-element shape.
std::string short_dump(const Json& value) {
  std::string text = value.dump();
  if (text.size() > 120) text = text.substr(0, 120) + "...";
  return text;
}

// At most `limit` names for a message, then how many more there were.
std::string name_list(const std::vector<std::string>& names, size_t limit = 20) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < limit; ++i) {
    if (i > 0) out += ", ";
    out += names[i];
  }
  if (names.size() > limit) out += fmt::format(" and {} more", names.size() - limit);
  return out;
}

bool checked_mul(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }

SafetensorsEntry parse_entry(const std::string& path, const std::string& name, const Json& value, int64_t data_size) {
  VLMGEN_CHECK(value.is_object(), "safetensors file '{}': entry '{}' must be a JSON object, got {}", path, name,
               value.type_name());
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    VLMGEN_CHECK(value.contains(key), "safetensors file '{}': entry '{}' has no \"{}\"", path, name, key);
  }
  SafetensorsEntry entry;
  entry.name = name;

  const Json& dtype = value.at("dtype");
  VLMGEN_CHECK(dtype.is_string(), "safetensors file '{}': entry '{}' dtype must be a string, got {}", path, name,
               dtype.type_name());
  const auto& dtype_str = dtype.get_ref<const std::string&>();
  VLMGEN_CHECK(dtype_from_name(dtype_str, &entry.dtype),
               "safetensors file '{}': entry '{}' has unsupported dtype '{}' (supported: {})", path, name, dtype_str,
               supported_dtype_list());

  const Json& shape = value.at("shape");
  VLMGEN_CHECK(shape.is_array(), "safetensors file '{}': entry '{}' shape must be an array, got {}", path, name,
               shape.type_name());
  // Bounds the product of max(dim, 1) so that ATen's contiguous strides cannot overflow either,
  // even when a zero dim makes the tensor empty.
  int64_t numel = 1;
  int64_t stride_bound = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    const int64_t dim = non_negative_int(shape[i], path, fmt::format("entry '{}' shape[{}]", name, i));
    entry.shape.push_back(dim);
    VLMGEN_CHECK(checked_mul(stride_bound, std::max<int64_t>(dim, 1), &stride_bound),
                 "safetensors file '{}': entry '{}' shape {} overflows int64 elements", path, name, short_dump(shape));
    numel *= dim;  // cannot overflow: |numel| <= stride_bound
  }
  const int64_t element_size = static_cast<int64_t>(c10::elementSize(entry.dtype));
  int64_t byte_size = 0;
  VLMGEN_CHECK(checked_mul(numel, element_size, &byte_size),
               "safetensors file '{}': entry '{}' shape {} x {} bytes overflows int64", path, name, short_dump(shape),
               element_size);

  const Json& offsets = value.at("data_offsets");
  VLMGEN_CHECK(offsets.is_array() && offsets.size() == 2,
               "safetensors file '{}': entry '{}' data_offsets must be [begin, end], got {}", path, name,
               short_dump(offsets));
  entry.begin = non_negative_int(offsets[0], path, fmt::format("entry '{}' begin offset", name));
  entry.end = non_negative_int(offsets[1], path, fmt::format("entry '{}' end offset", name));
  VLMGEN_CHECK(entry.begin <= entry.end, "safetensors file '{}': entry '{}' data_offsets [{}, {}] end before begin",
               path, name, entry.begin, entry.end);
  VLMGEN_CHECK(entry.end <= data_size,
               "safetensors file '{}': entry '{}' data_offsets [{}, {}] beyond the data section of "
               "{} bytes",
               path, name, entry.begin, entry.end, data_size);
  VLMGEN_CHECK(entry.end - entry.begin == byte_size,
               "safetensors file '{}': entry '{}' {} {} needs {} bytes, data_offsets [{}, {}] hold {}", path, name,
               dtype_str, short_dump(shape), byte_size, entry.begin, entry.end, entry.end - entry.begin);
  return entry;
}

// Bool tensors with bytes other than 0/1 are undefined behaviour in ATen kernels.
void check_bool_bytes(const at::Tensor& t, const std::string& path, const std::string& name) {
  if (t.scalar_type() != at::kBool) return;
  const auto* bytes = static_cast<const uint8_t*>(t.data_ptr());
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) {
    VLMGEN_CHECK(bytes[i] <= 1,
                 "safetensors file '{}': BOOL tensor '{}' holds byte {} at element {}; expected 0 "
                 "or 1",
                 path, name, static_cast<int>(bytes[i]), i);
  }
}

}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  VLMGEN_CHECK(fd >= 0, "cannot open safetensors file '{}': {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    VLMGEN_FAIL("cannot stat safetensors file '{}': {}", path, std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    VLMGEN_FAIL("safetensors path '{}' is not a regular file", path);
  }
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < 8) {
    ::close(fd);
    VLMGEN_FAIL("safetensors file '{}' is {} bytes, shorter than the 8-byte header length", path, file_size);
  }
  void* mapping = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  ::close(fd);  // the mapping keeps the file alive
  VLMGEN_CHECK(mapping != MAP_FAILED, "cannot mmap safetensors file '{}' ({} bytes): {}", path, file_size,
               std::strerror(map_err));
  mapping_ = mapping;
  mapped_size_ = file_size;

  // From here on the destructor will not run if we throw, so unmap by hand on failure.
  try {
    const auto* base = static_cast<const uint8_t*>(mapping_);
    uint64_t header_size = 0;
    for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | base[i];  // little-endian
    VLMGEN_CHECK(header_size <= kMaxHeaderBytes,
                 "safetensors file '{}': header length {} exceeds the limit of {} bytes", path, header_size,
                 kMaxHeaderBytes);
    VLMGEN_CHECK(header_size <= file_size - 8,
                 "safetensors file '{}': header length {} runs past the end of the file ({} bytes "
                 "after the length field)",
                 path, header_size, file_size - 8);
    data_ = base + 8 + header_size;
    const auto data_size = static_cast<int64_t>(file_size - 8 - header_size);

    Json header = Json::parse(base + 8, base + 8 + header_size, /*cb=*/nullptr,
                              /*allow_exceptions=*/false);
    VLMGEN_CHECK(!header.is_discarded(), "safetensors file '{}': the {}-byte header is not valid JSON", path,
                 header_size);
    VLMGEN_CHECK(header.is_object(), "safetensors file '{}': the header must be a JSON object, got {}", path,
                 header.type_name());

    for (const auto& item : header.items()) {
      if (item.key() == kMetadataKey) {
        const Json& meta = item.value();
        VLMGEN_CHECK(meta.is_object(), "safetensors file '{}': {} must be an object, got {}", path, kMetadataKey,
                     meta.type_name());
        for (const auto& kv : meta.items()) {
          VLMGEN_CHECK(kv.value().is_string(), "safetensors file '{}': {} value of '{}' must be a string, got {}", path,
                       kMetadataKey, kv.key(), kv.value().type_name());
          metadata_[kv.key()] = kv.value().get<std::string>();
        }
        continue;
      }
      entries_[item.key()] = parse_entry(path, item.key(), item.value(), data_size);
    }
  } catch (const Error&) {
    ::munmap(mapping_, mapped_size_);
    mapping_ = nullptr;
    throw;
  } catch (const std::exception& e) {
    // nlohmann's own exceptions (and allocation failures) become the one error type.
    ::munmap(mapping_, mapped_size_);
    mapping_ = nullptr;
    VLMGEN_FAIL("safetensors file '{}': malformed header: {}", path, e.what());
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (mapping_ != nullptr) ::munmap(mapping_, mapped_size_);
}

bool SafetensorsFile::contains(const std::string& name) const { return entries_.count(name) > 0; }

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const auto& kv : entries_) out.push_back(kv.first);
  return out;
}

const SafetensorsEntry& SafetensorsFile::entry(const std::string& name) const {
  auto it = entries_.find(name);
  VLMGEN_CHECK(it != entries_.end(), "safetensors file '{}' has no tensor '{}' ({} tensors)", path_, name,
               entries_.size());
  return it->second;
}

at::Tensor SafetensorsFile::tensor(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  // A fresh tensor + memcpy rather than from_blob().clone(): the mapping gives no alignment.
  at::Tensor out = at::empty(e.shape, at::TensorOptions().dtype(e.dtype).device(at::kCPU));
  const int64_t bytes = e.end - e.begin;
  if (bytes > 0) std::memcpy(out.data_ptr(), data_ + e.begin, static_cast<size_t>(bytes));
  check_bool_bytes(out, path_, name);
  return out;
}

at::Tensor SafetensorsFile::narrow(const std::string& name, int64_t dim, int64_t start, int64_t length) const {
  const SafetensorsEntry& e = entry(name);
  const auto rank = static_cast<int64_t>(e.shape.size());
  VLMGEN_CHECK(rank > 0, "safetensors file '{}': cannot narrow 0-d tensor '{}'", path_, name);
  VLMGEN_CHECK(dim >= -rank && dim < rank,
               "safetensors file '{}': narrow of '{}' (rank {}) along dim {}, expected [{}, {})", path_, name, rank,
               dim, -rank, rank);
  if (dim < 0) dim += rank;
  const int64_t size = e.shape[dim];
  VLMGEN_CHECK(start >= 0 && length >= 0 && start <= size && length <= size - start,
               "safetensors file '{}': narrow of '{}' dim {} start {} length {} outside its size {}", path_, name, dim,
               start, length, size);

  // Shape products cannot overflow: the entry's total byte size was checked when parsing.
  const auto element_size = static_cast<int64_t>(c10::elementSize(e.dtype));
  int64_t outer = 1;
  for (int64_t i = 0; i < dim; ++i) outer *= e.shape[i];
  int64_t inner_bytes = element_size;
  for (int64_t i = dim + 1; i < rank; ++i) inner_bytes *= e.shape[i];

  std::vector<int64_t> out_shape = e.shape;
  out_shape[dim] = length;
  at::Tensor out = at::empty(out_shape, at::TensorOptions().dtype(e.dtype).device(at::kCPU));
  const int64_t chunk = length * inner_bytes;
  if (chunk > 0) {
    auto* dst = static_cast<uint8_t*>(out.data_ptr());
    const uint8_t* src = data_ + e.begin + start * inner_bytes;
    const int64_t src_stride = size * inner_bytes;
    for (int64_t o = 0; o < outer; ++o) {
      std::memcpy(dst + o * chunk, src + o * src_stride, static_cast<size_t>(chunk));
    }
  }
  check_bool_bytes(out, path_, name);
  return out;
}

SafetensorsCheckpoint::SafetensorsCheckpoint(const std::string& dir) {
  const std::string index_path = dir + "/model.safetensors.index.json";
  const std::string single_path = dir + "/model.safetensors";
  auto is_file = [](const std::string& p) {
    struct stat st {};
    return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
  };

  if (!is_file(index_path)) {
    VLMGEN_CHECK(is_file(single_path),
                 "checkpoint directory '{}' holds neither model.safetensors nor "
                 "model.safetensors.index.json",
                 dir);
    files_.push_back(std::make_unique<SafetensorsFile>(single_path));
    for (const auto& name : files_.back()->names()) owner_[name] = 0;
    return;
  }

  std::ifstream in(index_path, std::ios::binary);
  VLMGEN_CHECK(in.good(), "cannot read checkpoint index '{}'", index_path);
  const Json index = Json::parse(in, /*cb=*/nullptr, /*allow_exceptions=*/false);
  VLMGEN_CHECK(!index.is_discarded() && index.is_object(), "checkpoint index '{}' is not a JSON object", index_path);
  VLMGEN_CHECK(index.contains("weight_map") && index.at("weight_map").is_object(),
               "checkpoint index '{}' has no \"weight_map\" object", index_path);

  std::map<std::string, size_t> shard_of_file;
  std::vector<std::string> missing_shards;
  std::map<std::string, std::string> wanted;  // tensor -> shard file
  for (const auto& item : index.at("weight_map").items()) {
    VLMGEN_CHECK(item.value().is_string(), "checkpoint index '{}': weight_map['{}'] must be a file name, got {}",
                 index_path, item.key(), item.value().type_name());
    const std::string shard = item.value().get<std::string>();
    wanted[item.key()] = shard;
    if (shard_of_file.count(shard) > 0) continue;
    // Shards live next to the index; a path component would let an index reach anywhere.
    VLMGEN_CHECK(!shard.empty() && shard.find('/') == std::string::npos && shard != ".." && shard != ".",
                 "checkpoint index '{}': shard name '{}' must be a plain file name", index_path, shard);
    shard_of_file[shard] = 0;
    if (!is_file(fmt::format("{}/{}", dir, shard))) missing_shards.push_back(shard);
  }
  VLMGEN_CHECK(missing_shards.empty(), "checkpoint '{}': {} shard file(s) listed in the index are missing: {}", dir,
               missing_shards.size(), name_list(missing_shards));

  for (auto& kv : shard_of_file) {
    kv.second = files_.size();
    files_.push_back(std::make_unique<SafetensorsFile>(fmt::format("{}/{}", dir, kv.first)));
  }
  std::vector<std::string> missing_tensors;
  for (const auto& kv : wanted) {
    const size_t file = shard_of_file.at(kv.second);
    if (!files_[file]->contains(kv.first)) {
      missing_tensors.push_back(fmt::format("{} (in {})", kv.first, kv.second));
      continue;
    }
    owner_[kv.first] = file;
  }
  VLMGEN_CHECK(missing_tensors.empty(),
               "checkpoint '{}': {} tensor(s) listed in the index are missing from their shard: {}", dir,
               missing_tensors.size(), name_list(missing_tensors));
}

bool SafetensorsCheckpoint::contains(const std::string& name) const { return owner_.count(name) > 0; }

std::vector<std::string> SafetensorsCheckpoint::names() const {
  std::vector<std::string> out;
  out.reserve(owner_.size());
  for (const auto& kv : owner_) out.push_back(kv.first);
  return out;
}

const SafetensorsEntry& SafetensorsCheckpoint::entry(const std::string& name) const {
  auto it = owner_.find(name);
  VLMGEN_CHECK(it != owner_.end(), "checkpoint has no tensor '{}' ({} tensors in {} file(s))", name, owner_.size(),
               files_.size());
  return files_[it->second]->entry(name);
}

at::Tensor SafetensorsCheckpoint::tensor(const std::string& name) const {
  entry(name);  // throws naming the tensor when absent
  return files_[owner_.at(name)]->tensor(name);
}

at::Tensor SafetensorsCheckpoint::narrow(const std::string& name, int64_t dim, int64_t start, int64_t length) const {
  entry(name);
  return files_[owner_.at(name)]->narrow(name, dim, start, length);
}

void save_safetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  Json header = Json::object();
  std::vector<at::Tensor> contiguous;
  contiguous.reserve(tensors.size());
  int64_t offset = 0;
  for (const auto& kv : tensors) {  // std::map: sorted names, so data is laid out in that order
    VLMGEN_CHECK(kv.first != kMetadataKey, "save_safetensors('{}'): '{}' is reserved for metadata", path, kv.first);
    const at::Tensor& t = kv.second;
    VLMGEN_CHECK(t.defined(), "save_safetensors('{}'): tensor '{}' is undefined", path, kv.first);
    const char* dtype = dtype_name(t.scalar_type());
    VLMGEN_CHECK(dtype != nullptr,
                 "save_safetensors('{}'): tensor '{}' has unsupported dtype {} "
                 "(supported: {})",
                 path, kv.first, c10::toString(t.scalar_type()), supported_dtype_list());
    at::Tensor c = t.to(at::kCPU).contiguous();
    const auto bytes = static_cast<int64_t>(c.nbytes());
    Json entry = Json::object();
    entry["dtype"] = dtype;
    entry["shape"] = c.sizes().vec();
    entry["data_offsets"] = Json::array({offset, offset + bytes});
    header[kv.first] = std::move(entry);
    offset += bytes;
    contiguous.push_back(std::move(c));
  }
  if (!metadata.empty()) header[kMetadataKey] = metadata;

  std::string text;
  try {
    text = header.dump();
  } catch (const Json::exception& e) {
    // dump() refuses strings that are not UTF-8; the format requires JSON text.
    VLMGEN_FAIL("save_safetensors('{}'): tensor names and metadata must be valid UTF-8: {}", path, e.what());
  }
  // Padding keeps the data section 8-byte aligned inside the file (and the mapping).
  text.append((8 - text.size() % 8) % 8, ' ');
  uint8_t length_bytes[8];
  uint64_t n = text.size();
  for (auto& b : length_bytes) {
    b = static_cast<uint8_t>(n & 0xff);
    n >>= 8;
  }

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  VLMGEN_CHECK(out.good(), "save_safetensors: cannot open '{}' for writing: {}", path, std::strerror(errno));
  out.write(reinterpret_cast<const char*>(length_bytes), sizeof(length_bytes));
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const auto& c : contiguous) {
    if (c.nbytes() > 0) {
      out.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.nbytes()));
    }
  }
  out.close();
  VLMGEN_CHECK(!out.fail(), "save_safetensors: writing {} bytes to '{}' failed", 8 + text.size() + offset, path);
}

}  // namespace vlmgen
