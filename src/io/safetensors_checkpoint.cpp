// Checkpoints made of one model.safetensors or of shards listed in model.safetensors.index.json.

#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "json_parse.h"
#include "vlmgen/error.h"
#include "vlmgen/io/files.h"
#include "vlmgen/io/json.h"
#include "vlmgen/io/safetensors.h"

namespace vlmgen {
namespace {

using Json = nlohmann::json;

// Indexes of the largest public checkpoints are a few MB; this leaves two orders of magnitude.
constexpr int64_t kMaxIndexBytes = int64_t{64} << 20;
constexpr size_t kMaxNameInMessage = 96;

// At most `limit` names for a message (each cut short), then how many more there were.
std::string name_list(const std::vector<std::string>& names, size_t limit = 20) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < limit; ++i) {
    if (i > 0) out += ", ";
    out += quote_excerpt(names[i], kMaxNameInMessage);
  }
  if (names.size() > limit) out += fmt::format(" and {} more", names.size() - limit);
  return out;
}

// Exists at all (of any type): a FIFO named like a shard is then refused by SafetensorsFile,
// naming what it is, rather than reported missing.
bool exists(const std::string& path) { return file_exists(path, "checkpoint file"); }

}  // namespace

SafetensorsCheckpoint::SafetensorsCheckpoint(const std::string& dir) {
  const std::string index_path = dir + "/model.safetensors.index.json";
  const std::string single_path = dir + "/model.safetensors";
  if (!exists(index_path)) {
    VLMGEN_CHECK(exists(single_path),
                 "checkpoint directory '{}' holds neither model.safetensors nor model.safetensors.index.json", dir);
    files_.push_back(std::make_unique<SafetensorsFile>(single_path));
    for (const auto& name : files_.back()->names()) owner_[name] = 0;
    return;
  }

  const std::string what = fmt::format("checkpoint index '{}'", index_path);
  const Json index = detail::parse_json(read_regular_file(index_path, "checkpoint index", kMaxIndexBytes), what,
                                        JsonLimits().max_bytes(kMaxIndexBytes).unique_keys(true));
  VLMGEN_CHECK(index.is_object(), "{} must be a JSON object, got {}", what, index.type_name());
  VLMGEN_CHECK(index.contains("weight_map") && index.at("weight_map").is_object(), "{} has no \"weight_map\" object",
               what);

  std::map<std::string, size_t> shard_of_file;
  std::vector<std::string> missing_shards;
  std::map<std::string, std::string> wanted;  // tensor -> shard file
  for (const auto& item : index.at("weight_map").items()) {
    VLMGEN_CHECK(item.value().is_string(), "{}: weight_map['{}'] must be a file name, got {}", what,
                 quote_excerpt(item.key(), kMaxNameInMessage), item.value().type_name());
    const std::string shard = item.value().get<std::string>();
    wanted[item.key()] = shard;
    if (shard_of_file.count(shard) > 0) continue;
    // Shards live next to the index; a path component would let an index reach anywhere, and a
    // NUL would make the name opened differ from the name checked.
    VLMGEN_CHECK(!shard.empty() && shard.find_first_of(std::string("/\0", 2)) == std::string::npos && shard != ".." &&
                     shard != ".",
                 "{}: shard name '{}' must be a plain file name", what, quote_excerpt(shard, kMaxNameInMessage));
    shard_of_file[shard] = 0;
    if (!exists(fmt::format("{}/{}", dir, shard))) missing_shards.push_back(shard);
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
      missing_tensors.push_back(fmt::format("{} (in {})", quote_excerpt(kv.first, kMaxNameInMessage),
                                            quote_excerpt(kv.second, kMaxNameInMessage)));
      continue;
    }
    owner_[kv.first] = file;
  }
  VLMGEN_CHECK(missing_tensors.empty(),
               "checkpoint '{}': {} tensor(s) listed in the index are missing from their shard: {}", dir,
               missing_tensors.size(), name_list(missing_tensors));
}

int64_t SafetensorsCheckpoint::data_bytes() const {
  int64_t total = 0;
  for (const auto& file : files_) total += file->data_bytes();  // each below its file's size
  return total;
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
  VLMGEN_CHECK(it != owner_.end(), "checkpoint has no tensor '{}' ({} tensors in {} file(s))",
               quote_excerpt(name, kMaxNameInMessage), owner_.size(), files_.size());
  return files_[it->second]->entry(name);
}

at::Tensor SafetensorsCheckpoint::tensor(const std::string& name) const {
  entry(name);  // throws naming the tensor when absent
  return files_[owner_.at(name)]->tensor(name);
}

void SafetensorsCheckpoint::release(const std::string& name) const {
  entry(name);
  files_[owner_.at(name)]->release(name);
}

at::Tensor SafetensorsCheckpoint::narrow(const std::string& name, int64_t dim, int64_t start, int64_t length) const {
  entry(name);
  return files_[owner_.at(name)]->narrow(name, dim, start, length);
}

at::Tensor SafetensorsCheckpoint::tensor_as(const std::string& name, at::ScalarType dtype) const {
  entry(name);
  return files_[owner_.at(name)]->tensor_as(name, dtype);
}

at::Tensor SafetensorsCheckpoint::narrow_as(const std::string& name, int64_t dim, int64_t start, int64_t length,
                                            at::ScalarType dtype) const {
  entry(name);
  return files_[owner_.at(name)]->narrow_as(name, dim, start, length, dtype);
}

void SafetensorsCheckpoint::narrow_into(const std::string& name, int64_t dim, int64_t start, at::Tensor& out) const {
  entry(name);
  files_[owner_.at(name)]->narrow_into(name, dim, start, out);
}

}  // namespace vlmgen
