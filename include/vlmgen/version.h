#pragma once

/// vlmgen's version, the one place it is written down (CMake reads it from here).
#define VLMGEN_VERSION_MAJOR 0
#define VLMGEN_VERSION_MINOR 1
#define VLMGEN_VERSION_PATCH 0

#define VLMGEN_VERSION (VLMGEN_VERSION_MAJOR * 10000 + VLMGEN_VERSION_MINOR * 100 + VLMGEN_VERSION_PATCH)
