#pragma once

#include <string>

namespace vlmgen {

/// What the compiled library was built with: vlmgen version, LibTorch version, and whether
/// that LibTorch has CUDA, NCCL and Gloo. One line, for logs and bug reports.
std::string build_info();

}  // namespace vlmgen
