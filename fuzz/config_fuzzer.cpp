// libFuzzer target: config.json text. Parsed, validated, its weights counted; a config small
// enough is also built into a model, which runs the model's own checks and allocation.

#include <cstdint>
#include <string>

#include "vlmgen/error.h"
#include "vlmgen/models/qwen_vl.h"
#include "vlmgen/models/qwen_vl_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const vlmgen::QwenVlConfig config =
        vlmgen::QwenVlConfig::from_json(std::string(reinterpret_cast<const char*>(data), size));
    config.validate();
    const int64_t parameters = config.parameter_count();
    (void)config.kv_cache_bytes_per_token(4);
    (void)vlmgen::QwenVlConfig::from_json(config.to_json());
    if (parameters <= (1 << 18)) {
      vlmgen::QwenVl model(config, /*seed=*/0);
      (void)model;
    }
  } catch (const vlmgen::Error&) {
  }
  return 0;
}
