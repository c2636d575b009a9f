#pragma once

// How a checkpoint is loaded: the dtype the language model's matrices are kept in.

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "vlmgen/detail/torch_compat.h"
#include "vlmgen/error.h"

namespace vlmgen {

struct LoadOptions {
  /// float32 (default; exact parity with the reference), bfloat16 or float16: the embedding,
  /// attention and MLP weights and lm_head are stored in this dtype (read without a float32
  /// copy), norms, biases and the vision tower stay float32, and compute on the CPU is float32
  /// (on an accelerator a 16-bit model computes in its dtype).
  at::ScalarType weights_dtype = at::kFloat;
  /// For an FP8 checkpoint: keep the decoder's quantized linears as their bytes and scales (one
  /// byte a weight; the CPU kernels decode them as they read them, float32 compute) instead of
  /// dequantizing them to weights_dtype. A weight whose scale blocks do not fit that (an input
  /// block not a multiple of 16, or blocks split by tensor parallelism) is dequantized, with a
  /// warning saying how many. CPU only. A checkpoint that is not FP8 is a vlmgen::Error.
  bool keep_fp8 = false;
  /// Where the weights live and the model computes: the CPU (default) or a CUDA device. Each
  /// tensor is read from the files and copied straight over. On CUDA a 16-bit weights_dtype
  /// runs the linears in that dtype (bf16 is the usual choice there); the residual stream,
  /// norms, attention and the KV cache stay float32.
  at::Device device = at::kCPU;
  /// On the CPU under Linux: read the weights each decode step reads whole (the decoder's
  /// matrices and the output head) straight into one mapping advised for transparent huge pages
  /// (madvise; the system's /sys/kernel/mm/transparent_hugepage/enabled must not be "never"). A
  /// decode step then reads them 8-21% faster here (fewer page walks, most of all under a
  /// hypervisor), for at most 2 MiB more resident memory. false keeps each weight in its own
  /// allocation.
  bool huge_pages = true;
  /// What the model's KV caches store (its traits().kv_cache.dtype, which generators and the
  /// engine allocate): float32 (default; exact parity with the reference), bfloat16 (half the
  /// cache's memory and half the bytes a long-context decode step reads, each key and value
  /// rounded to bfloat16 when written) or at::kByte, FP8 (E4M3 rows with a scale each,
  /// fp8_kv_rows.h: about a quarter, each element rounded to 3 mantissa bits at its row's scale);
  /// attention still computes in float32. The 16- and 8-bit caches on the CPU only.
  at::ScalarType kv_cache_dtype = at::kFloat;
};

/// "cpu", "cuda" (device 0) or "cuda:N" as an at::Device, checked against what this process can
/// use: a vlmgen::Error names the accepted spellings, or says that this LibTorch has no CUDA or
/// how many devices it sees.
inline at::Device parse_device(const std::string& name) {
  if (name == "cpu") return at::kCPU;
  int64_t index = -1;
  if (name == "cuda") {
    index = 0;
  } else if (name.rfind("cuda:", 0) == 0 && name.size() > 5 && name.size() <= 8 &&
             name.find_first_not_of("0123456789", 5) == std::string::npos) {
    index = std::stoll(name.substr(5));
  }
  VLMGEN_CHECK(index >= 0, "device must be 'cpu', 'cuda' or 'cuda:N', got '{}'", name);
  const int64_t count = detail::cuda_device_count();
  VLMGEN_CHECK(count > 0,
               "device '{}' asked for, but this LibTorch ({}) has no usable CUDA: it was built without CUDA, or no "
               "driver or GPU is present; use --device cpu",
               name, detail::torch_version());
  VLMGEN_CHECK(index < count, "device '{}' asked for, but this process sees {} CUDA device{} (cuda:0 .. cuda:{})", name,
               count, count == 1 ? "" : "s", count - 1);
  return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index));
}

/// The options a command line's `--dtype` names: f32, bf16, f16, or fp8 (an FP8 checkpoint's
/// linears kept as bytes, its other matrices in bfloat16).
inline LoadOptions load_options_for_dtype(const std::string& name);

/// "f32"/"float32", "bf16"/"bfloat16" or "f16"/"fp16"/"float16"; anything else is a vlmgen::Error
/// listing those.
inline at::ScalarType parse_weights_dtype(const std::string& name) {
  if (name == "f32" || name == "float32") return at::kFloat;
  if (name == "bf16" || name == "bfloat16") return at::kBFloat16;
  if (name == "f16" || name == "fp16" || name == "float16") return at::kHalf;
  VLMGEN_FAIL("weights dtype must be f32, bf16 or f16, got '{}'", name);
}

inline LoadOptions load_options_for_dtype(const std::string& name) {
  LoadOptions options;
  if (name == "fp8") {
    options.weights_dtype = at::kBFloat16;
    options.keep_fp8 = true;
    return options;
  }
  try {
    options.weights_dtype = parse_weights_dtype(name);
  } catch (const Error&) {
    VLMGEN_FAIL("dtype must be f32, bf16, f16 or fp8, got '{}'", name);
  }
  return options;
}

/// The command lines' help for --kv-dtype.
inline constexpr const char* kKvCacheDtypeHelp =
    "what the KV cache stores: f32 (default, exact), bf16 (half the cache's memory and of the bytes a "
    "long-context decode step reads; keys and values rounded to bfloat16) or fp8 (E4M3 bytes with a scale per "
    "key or value row, about a quarter; rounded to 3 mantissa bits); attention stays float32 with all three";

/// "f32"/"float32", "bf16"/"bfloat16" or "fp8"/"e4m3" (at::kByte, check_kv_cache_dtype): what the
/// model's KV caches store (LoadOptions::kv_cache_dtype); anything else is a vlmgen::Error listing those.
inline at::ScalarType parse_kv_cache_dtype(const std::string& name) {
  if (name == "f32" || name == "float32") return at::kFloat;
  if (name == "bf16" || name == "bfloat16") return at::kBFloat16;
  if (name == "fp8" || name == "e4m3") return at::kByte;
  VLMGEN_FAIL("KV cache dtype must be f32, bf16 or fp8, got '{}'", name);
}

/// The options a command line's `--dtype`, `--device` and `--kv-dtype` name. In a multi-process run a plain
/// "cuda" names the device of this process's LOCAL_RANK (torchrun's convention, and what
/// `--nproc` sets); "cuda:N" is taken as written.
inline LoadOptions load_options_for(const std::string& dtype, const std::string& device,
                                    const std::string& kv_cache_dtype = "f32") {
  LoadOptions options = load_options_for_dtype(dtype);
  options.kv_cache_dtype = parse_kv_cache_dtype(kv_cache_dtype);
  const char* local_rank = std::getenv("LOCAL_RANK");
  options.device = parse_device(
      device == "cuda" && local_rank != nullptr && *local_rank != '\0' ? "cuda:" + std::string(local_rank) : device);
  return options;
}

}  // namespace vlmgen
