// libFuzzer target: one .safetensors file. Every tensor the reader accepts is read whole and
// narrowed, so that an accepted header whose offsets do not fit the data would be caught by
// AddressSanitizer here.

#include <cstdint>
#include <string>

#include "fuzz_util.h"
#include "vlmgen/error.h"
#include "vlmgen/io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = vlmgen::fuzz::scratch_dir() + "/model.safetensors";
  vlmgen::fuzz::write_file(path, std::string_view(reinterpret_cast<const char*>(data), size));
  try {
    const vlmgen::SafetensorsFile file(path);
    for (const std::string& name : file.names()) {
      const vlmgen::SafetensorsEntry& entry = file.entry(name);
      at::Tensor whole = file.tensor(name);
      if (!entry.shape.empty() && entry.shape[0] > 0) {
        at::Tensor part = file.narrow(name, 0, entry.shape[0] / 2, entry.shape[0] - entry.shape[0] / 2);
        (void)part;
      }
    }
  } catch (const vlmgen::Error&) {
    // Refusing a malformed file is the expected outcome; any other exception is a finding.
  }
  return 0;
}
