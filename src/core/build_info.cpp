#include "vlmgen/build_info.h"

#include <ATen/Context.h>
#include <fmt/format.h>

#include "vlmgen/detail/torch_compat.h"
#include "vlmgen/version.h"

namespace vlmgen {

std::string build_info() {
#ifdef USE_C10D_NCCL
  constexpr bool nccl = true;
#else
  constexpr bool nccl = false;
#endif
#ifdef USE_C10D_GLOO
  constexpr bool gloo = true;
#else
  constexpr bool gloo = false;
#endif
  return fmt::format("vlmgen {}.{}.{}, LibTorch {}, CUDA {}, NCCL {}, Gloo {}", VLMGEN_VERSION_MAJOR,
                     VLMGEN_VERSION_MINOR, VLMGEN_VERSION_PATCH, detail::torch_version(), at::hasCUDA() ? "yes" : "no",
                     nccl ? "yes" : "no", gloo ? "yes" : "no");
}

}  // namespace vlmgen
