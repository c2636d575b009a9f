#include "vlmgen/io/safetensors.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string_view>
#include <tuple>
#include <utility>

#include "json_parse.h"
#include "vlmgen/error.h"
#include "vlmgen/io/files.h"

namespace vlmgen {
namespace {

using Json = nlohmann::json;

// Same bound as the reference implementation: a header larger than this is not a checkpoint
// header but garbage, and parsing it would cost memory proportional to its size.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr const char* kMetadataKey = "__metadata__";
// Far above any real tensor (ATen kernels stop at 25); a million-dimension shape is an attack.
constexpr size_t kMaxRank = 64;
// Tensor names are untrusted text too: messages quote a prefix.
constexpr size_t kMaxNameInMessage = 96;

struct DtypeName {
  const char* name;
  at::ScalarType type;
};

// Only dtypes that LibTorch 1.13 can hold (U16/U32/U64 are rejected by name); the F8 formats are
// read as bytes (SafetensorsEntry::fp8).
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
std::string short_dump(const Json& value) { return detail::json_excerpt(value, 120); }

bool checked_mul(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }

SafetensorsEntry parse_entry(const std::string& path, const std::string& name, const Json& value, int64_t data_size) {
  const std::string shown = quote_excerpt(name, kMaxNameInMessage);
  VLMGEN_CHECK(value.is_object(), "safetensors file '{}': entry '{}' must be a JSON object, got {}", path, shown,
               value.type_name());
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    VLMGEN_CHECK(value.contains(key), "safetensors file '{}': entry '{}' has no \"{}\"", path, shown, key);
  }
  SafetensorsEntry entry;
  entry.name = name;

  const Json& dtype = value.at("dtype");
  VLMGEN_CHECK(dtype.is_string(), "safetensors file '{}': entry '{}' dtype must be a string, got {}", path, shown,
               dtype.type_name());
  const auto& dtype_str = dtype.get_ref<const std::string&>();
  // The FP8 formats have no LibTorch 1.13 dtype: their bytes are read as uint8 and the entry
  // says which format they hold (vlmgen/io/fp8.h decodes them).
  entry.fp8 = fp8_format_from_dtype_name(dtype_str);
  if (entry.fp8) {
    entry.dtype = at::kByte;
  } else {
    VLMGEN_CHECK(dtype_from_name(dtype_str, &entry.dtype),
                 "safetensors file '{}': entry '{}' has unsupported dtype '{}' (supported: {}, F8_E4M3, F8_E5M2)", path,
                 shown, quote_excerpt(dtype_str, 16), supported_dtype_list());
  }

  const Json& shape = value.at("shape");
  VLMGEN_CHECK(shape.is_array(), "safetensors file '{}': entry '{}' shape must be an array, got {}", path, shown,
               shape.type_name());
  VLMGEN_CHECK(shape.size() <= kMaxRank, "safetensors file '{}': entry '{}' has {} dimensions, above the limit of {}",
               path, shown, shape.size(), kMaxRank);
  // Bounds the product of max(dim, 1) so that ATen's contiguous strides cannot overflow either,
  // even when a zero dim makes the tensor empty.
  int64_t numel = 1;
  int64_t stride_bound = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    const int64_t dim = non_negative_int(shape[i], path, fmt::format("entry '{}' shape[{}]", shown, i));
    entry.shape.push_back(dim);
    VLMGEN_CHECK(checked_mul(stride_bound, std::max<int64_t>(dim, 1), &stride_bound),
                 "safetensors file '{}': entry '{}' shape {} overflows int64 elements", path, shown, short_dump(shape));
    numel *= dim;  // cannot overflow: |numel| <= stride_bound
  }
  const int64_t element_size = static_cast<int64_t>(c10::elementSize(entry.dtype));
  int64_t byte_size = 0;
  VLMGEN_CHECK(checked_mul(numel, element_size, &byte_size),
               "safetensors file '{}': entry '{}' shape {} x {} bytes overflows int64", path, shown, short_dump(shape),
               element_size);

  const Json& offsets = value.at("data_offsets");
  VLMGEN_CHECK(offsets.is_array() && offsets.size() == 2,
               "safetensors file '{}': entry '{}' data_offsets must be [begin, end], got {}", path, shown,
               short_dump(offsets));
  entry.begin = non_negative_int(offsets[0], path, fmt::format("entry '{}' begin offset", shown));
  entry.end = non_negative_int(offsets[1], path, fmt::format("entry '{}' end offset", shown));
  VLMGEN_CHECK(entry.begin <= entry.end, "safetensors file '{}': entry '{}' data_offsets [{}, {}] end before begin",
               path, shown, entry.begin, entry.end);
  VLMGEN_CHECK(entry.end <= data_size,
               "safetensors file '{}': entry '{}' data_offsets [{}, {}] beyond the data section of "
               "{} bytes",
               path, shown, entry.begin, entry.end, data_size);
  VLMGEN_CHECK(entry.end - entry.begin == byte_size,
               "safetensors file '{}': entry '{}' {} {} needs {} bytes, data_offsets [{}, {}] hold {}", path, shown,
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

// FP8 tensors are held as their bytes (uint8): converting those bytes as numbers would give
// values of 0 to 255, not the weights, so a read as another dtype is refused (the FP8 loaders decode).
void check_fp8_as_bytes(const SafetensorsEntry& e, const std::string& path, const std::string& name,
                        at::ScalarType dtype) {
  VLMGEN_CHECK(!e.fp8 || dtype == at::kByte,
               "safetensors file '{}': FP8 tensor '{}' is read as its bytes (uint8), not as {}; decode it with "
               "its scales (vlmgen/io/fp8.h)",
               path, name, c10::toString(dtype));
}

// Drops the resident pages of a private read-only file mapping that lie wholly inside [begin,
// end): they are clean, so nothing is lost (a later read maps them from the file again).
void drop_pages(const uint8_t* begin, const uint8_t* end) {
  static const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t first = (reinterpret_cast<uintptr_t>(begin) + page - 1) / page * page;
  const uintptr_t last = reinterpret_cast<uintptr_t>(end) / page * page;
  if (last > first) ::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

// The format requires the data section to be indexed entirely and without overlap: sorted by
// offsets, each tensor starts where the previous one ends, the first at 0 and the last at the
// end. Overlapping tensors would alias each other's bytes and holes or trailing bytes carry data
// no tensor accounts for (a spliced or truncated file). Empty tensors may sit at any boundary.
void check_packed_layout(const std::string& path, const std::map<std::string, SafetensorsEntry>& entries,
                         int64_t data_size) {
  std::vector<const SafetensorsEntry*> order;
  order.reserve(entries.size());
  for (const auto& kv : entries) order.push_back(&kv.second);
  std::sort(order.begin(), order.end(), [](const SafetensorsEntry* a, const SafetensorsEntry* b) {
    return std::tie(a->begin, a->end, a->name) < std::tie(b->begin, b->end, b->name);
  });
  const SafetensorsEntry* previous = nullptr;
  int64_t covered = 0;  // end of the packed prefix
  for (const SafetensorsEntry* e : order) {
    const std::string shown = quote_excerpt(e->name, kMaxNameInMessage);
    if (e->begin < covered) {
      VLMGEN_FAIL(
          "safetensors file '{}': tensor '{}' data_offsets [{}, {}] overlap tensor '{}' [{}, {}]; tensors must "
          "not share bytes",
          path, shown, e->begin, e->end, quote_excerpt(previous->name, kMaxNameInMessage), previous->begin,
          previous->end);
    }
    if (e->begin > covered) {
      VLMGEN_FAIL(
          "safetensors file '{}': tensor '{}' starts at byte {} but the data before it ends at byte {} ({}): "
          "a hole of {} bytes; tensors must be packed back to back",
          path, shown, e->begin, covered,
          previous == nullptr ? std::string("start of the data section")
                              : fmt::format("end of '{}'", quote_excerpt(previous->name, kMaxNameInMessage)),
          e->begin - covered);
    }
    covered = e->end;
    previous = e;
  }
  if (covered != data_size) {
    VLMGEN_FAIL(
        "safetensors file '{}': the data section holds {} bytes but the tensors cover only [0, {}) ({}): {} "
        "trailing bytes",
        path, data_size, covered,
        previous == nullptr ? std::string("no tensors")
                            : fmt::format("last tensor '{}'", quote_excerpt(previous->name, kMaxNameInMessage)),
        data_size - covered);
  }
}

}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  // Non-blocking open + fstat: a FIFO named like a shard is refused instead of waiting forever.
  const RegularFile file(path, "safetensors file");
  const auto file_size = static_cast<uint64_t>(file.size());
  VLMGEN_CHECK(file_size >= 8, "safetensors file '{}' is {} bytes, shorter than the 8-byte header length", path,
               file_size);
  void* mapping = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, file.fd(), 0);
  VLMGEN_CHECK(mapping != MAP_FAILED, "cannot mmap safetensors file '{}' ({} bytes): {}", path, file_size,
               std::strerror(errno));
  mapping_ = mapping;  // the mapping keeps the file alive after the descriptor closes
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
    data_size_ = static_cast<int64_t>(file_size - 8 - header_size);
    const std::string_view header_text(reinterpret_cast<const char*>(base + 8), header_size);
    read_header(header_text);
  } catch (const Error&) {
    ::munmap(mapping_, mapped_size_);
    mapping_ = nullptr;
    throw;
  } catch (const std::exception& e) {
    // nlohmann's own exceptions (and allocation failures) become the one error type.
    ::munmap(mapping_, mapped_size_);
    mapping_ = nullptr;
    VLMGEN_FAIL("safetensors file '{}': malformed header: {}", path, quote_excerpt(e.what(), 200));
  }
}

void SafetensorsFile::read_header(std::string_view text) {
  const Json header =
      detail::parse_json(text, fmt::format("safetensors file '{}' header", path_),
                         JsonLimits().max_bytes(static_cast<int64_t>(kMaxHeaderBytes)).unique_keys(true));
  VLMGEN_CHECK(header.is_object(), "safetensors file '{}': the header must be a JSON object, got {}", path_,
               header.type_name());
  for (const auto& item : header.items()) {
    if (item.key() == kMetadataKey) {
      const Json& meta = item.value();
      VLMGEN_CHECK(meta.is_object(), "safetensors file '{}': {} must be an object, got {}", path_, kMetadataKey,
                   meta.type_name());
      for (const auto& kv : meta.items()) {
        VLMGEN_CHECK(kv.value().is_string(), "safetensors file '{}': {} value of '{}' must be a string, got {}", path_,
                     kMetadataKey, quote_excerpt(kv.key(), kMaxNameInMessage), kv.value().type_name());
        metadata_[kv.key()] = kv.value().get<std::string>();
      }
      continue;
    }
    entries_[item.key()] = parse_entry(path_, item.key(), item.value(), data_size_);
  }
  check_packed_layout(path_, entries_, data_size_);
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

at::Tensor SafetensorsFile::tensor(const std::string& name) const { return tensor_as(name, entry(name).dtype); }

at::Tensor SafetensorsFile::tensor_as(const std::string& name, at::ScalarType dtype) const {
  const SafetensorsEntry& e = entry(name);
  check_fp8_as_bytes(e, path_, name, dtype);
  const int64_t bytes = e.end - e.begin;
  // A fresh tensor + memcpy rather than from_blob().clone(): the mapping gives no alignment.
  at::Tensor out = at::empty(e.shape, at::TensorOptions().dtype(e.dtype == at::kBool ? at::kBool : dtype));
  copy_runs(e, 0, 1, bytes, bytes, out);
  check_bool_bytes(out, path_, name);
  return e.dtype == at::kBool ? out.to(dtype) : out;
}

void SafetensorsFile::copy_runs(const SafetensorsEntry& e, int64_t first, int64_t outer, int64_t run, int64_t stride,
                                at::Tensor& out) const {
  constexpr int64_t kPiece = int64_t{4} << 20;  // a multiple of every element size
  const auto element = static_cast<int64_t>(c10::elementSize(e.dtype));
  const bool same = out.scalar_type() == e.dtype;
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  at::Tensor staging;  // converting: pieces of the file's dtype, then one copy_ into `out`
  if (!same && run > 0 && outer > 0) staging = at::empty({std::min(kPiece, outer * run) / element}, e.dtype);
  const at::Tensor flat = out.view({-1});
  int64_t staged = 0, converted = 0;  // bytes in staging; elements of `out` written
  auto flush = [&] {
    if (staged == 0) return;
    flat.narrow(0, converted, staged / element).copy_(staging.narrow(0, 0, staged / element));
    converted += staged / element;
    staged = 0;
  };
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t done = 0; done < run;) {
      const int64_t n = std::min(run - done, same ? kPiece : kPiece - staged);
      const uint8_t* src = data_ + e.begin + first + o * stride + done;
      if (same) {
        std::memcpy(dst + o * run + done, src, static_cast<size_t>(n));
      } else {
        std::memcpy(static_cast<uint8_t*>(staging.data_ptr()) + staged, src, static_cast<size_t>(n));
        staged += n;
        if (staged == kPiece) flush();
      }
      drop_pages(src, src + n);
      done += n;
    }
  }
  if (!same) flush();
}

void SafetensorsFile::release(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  drop_pages(data_ + e.begin, data_ + e.end);
}

at::Tensor SafetensorsFile::narrow(const std::string& name, int64_t dim, int64_t start, int64_t length) const {
  return narrow_as(name, dim, start, length, entry(name).dtype);
}

at::Tensor SafetensorsFile::narrow_as(const std::string& name, int64_t dim, int64_t start, int64_t length,
                                      at::ScalarType dtype) const {
  const SafetensorsEntry& e = entry(name);
  check_fp8_as_bytes(e, path_, name, dtype);
  const int64_t d = checked_narrow(e, name, dim, start, length);
  std::vector<int64_t> out_shape = e.shape;
  out_shape[d] = length;
  at::Tensor out = at::empty(out_shape, at::TensorOptions().dtype(e.dtype == at::kBool ? at::kBool : dtype));
  copy_narrowed(e, d, start, out);
  check_bool_bytes(out, path_, name);
  return e.dtype == at::kBool ? out.to(dtype) : out;
}

void SafetensorsFile::narrow_into(const std::string& name, int64_t dim, int64_t start, at::Tensor& out) const {
  const SafetensorsEntry& e = entry(name);
  VLMGEN_CHECK(e.dtype != at::kBool, "safetensors file '{}': bool tensor '{}' cannot be read into a given tensor",
               path_, name);
  const auto rank = static_cast<int64_t>(e.shape.size());
  VLMGEN_CHECK(out.defined() && out.device().is_cpu() && out.is_contiguous() && out.dim() == rank,
               "safetensors file '{}': reading '{}' ({}-d) needs a contiguous CPU tensor of {} dims to read into",
               path_, name, rank, rank);
  check_fp8_as_bytes(e, path_, name, out.scalar_type());
  const int64_t d = checked_narrow(e, name, dim, start, 0);  // the dim, checked
  checked_narrow(e, name, d, start, out.size(d));
  std::vector<int64_t> want = e.shape;
  want[d] = out.size(d);
  VLMGEN_CHECK(out.sizes().vec() == want, "safetensors file '{}': '{}' rows {}.. along dim {} are [{}], not [{}]",
               path_, name, start, d, fmt::join(want, ", "), fmt::join(out.sizes(), ", "));
  copy_narrowed(e, d, start, out);
}

int64_t SafetensorsFile::checked_narrow(const SafetensorsEntry& e, const std::string& name, int64_t dim, int64_t start,
                                        int64_t length) const {
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
  return dim;
}

void SafetensorsFile::copy_narrowed(const SafetensorsEntry& e, int64_t dim, int64_t start, at::Tensor& out) const {
  // Shape products cannot overflow: the entry's total byte size was checked when parsing.
  const auto element_size = static_cast<int64_t>(c10::elementSize(e.dtype));
  int64_t outer = 1;
  for (int64_t i = 0; i < dim; ++i) outer *= e.shape[i];
  int64_t inner_bytes = element_size;
  for (int64_t i = dim + 1; i < static_cast<int64_t>(e.shape.size()); ++i) inner_bytes *= e.shape[i];
  copy_runs(e, start * inner_bytes, outer, out.size(dim) * inner_bytes, e.shape[dim] * inner_bytes, out);
}

void save_safetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata,
                      const std::map<std::string, Fp8Format>& fp8_tensors) {
  for (const auto& [name, format] : fp8_tensors) {
    auto it = tensors.find(name);
    VLMGEN_CHECK(it != tensors.end() && it->second.defined() && it->second.scalar_type() == at::kByte,
                 "save_safetensors('{}'): FP8 tensor '{}' must be one of the tensors, held as uint8 bytes", path, name);
  }
  Json header = Json::object();
  std::vector<at::Tensor> contiguous;
  contiguous.reserve(tensors.size());
  int64_t offset = 0;
  for (const auto& kv : tensors) {  // std::map: sorted names, so data is laid out in that order
    VLMGEN_CHECK(kv.first != kMetadataKey, "save_safetensors('{}'): '{}' is reserved for metadata", path, kv.first);
    const at::Tensor& t = kv.second;
    VLMGEN_CHECK(t.defined(), "save_safetensors('{}'): tensor '{}' is undefined", path, kv.first);
    auto fp8 = fp8_tensors.find(kv.first);
    const char* dtype = fp8 != fp8_tensors.end() ? fp8_dtype_name(fp8->second) : dtype_name(t.scalar_type());
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
