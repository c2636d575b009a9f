// libFuzzer target: a sharded checkpoint. The input is split at kFileSeparator into
// model.safetensors.index.json and up to three shards named shard-0.safetensors, ... (the seed
// index refers to them by those names).

#include <cstdint>
#include <cstdio>
#include <string>

#include "fuzz_util.h"
#include "vlmgen/error.h"
#include "vlmgen/io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& dir = vlmgen::fuzz::scratch_dir();
  const auto parts = vlmgen::fuzz::split_files(data, size, 4);
  vlmgen::fuzz::write_file(dir + "/model.safetensors.index.json", parts[0]);
  for (size_t i = 0; i < 3; ++i) {
    const std::string shard = dir + "/shard-" + std::to_string(i) + ".safetensors";
    if (i + 1 < parts.size()) {
      vlmgen::fuzz::write_file(shard, parts[i + 1]);
    } else {
      std::remove(shard.c_str());  // left over from an earlier input
    }
  }
  try {
    const vlmgen::SafetensorsCheckpoint checkpoint(dir);
    int64_t bytes = 0;
    for (const std::string& name : checkpoint.names()) bytes += checkpoint.tensor(name).nbytes();
    if (bytes > checkpoint.data_bytes()) __builtin_trap();  // tensors read more than the files hold
  } catch (const vlmgen::Error&) {
  }
  return 0;
}
