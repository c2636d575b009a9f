# Which c10d backends the compiled library can use. The c10d headers hide ProcessGroupGloo /
# ProcessGroupNCCL behind USE_C10D_GLOO / USE_C10D_NCCL, and torch's exported targets are no
# guide: Debian's define USE_C10D_GLOO for every consumer even when the Gloo headers those
# classes include (libgloo-dev) are missing, other builds may define nothing. So look for the backend's own
# headers, then compile and link a use of the group against libtorch, and tell the sources with
# VLMGEN_HAVE_C10D_GLOO / _NCCL. The result is cached; without a backend vlmgen still
# communicates through the c10d store (slow, correct).
include(CheckCXXSourceCompiles)
include(CMakePushCheckState)

option(VLMGEN_WITH_GLOO "Use c10d's Gloo backend for CPU tensors when LibTorch has it" ON)
option(VLMGEN_WITH_NCCL "Use c10d's NCCL backend for CUDA tensors when LibTorch has it" ON)

function(_vlmgen_check_c10d_backend result define include_dir source)
  cmake_push_check_state(RESET)
  set(CMAKE_CXX_STANDARD 17)
  set(CMAKE_REQUIRED_DEFINITIONS -D${define})
  set(CMAKE_REQUIRED_INCLUDES ${include_dir})
  # nlohmann-json: some 2.x c10d headers (NCCLUtils.hpp) include it.
  set(CMAKE_REQUIRED_LIBRARIES ${TORCH_LIBRARIES} nlohmann_json::nlohmann_json)
  set(CMAKE_REQUIRED_QUIET ON)
  check_cxx_source_compiles("${source}" ${result})
  cmake_pop_check_state()
endfunction()

if(VLMGEN_WITH_GLOO)
  find_path(VLMGEN_GLOO_INCLUDE_DIR gloo/context.h)
  if(VLMGEN_GLOO_INCLUDE_DIR)
    _vlmgen_check_c10d_backend(VLMGEN_HAVE_C10D_GLOO USE_C10D_GLOO ${VLMGEN_GLOO_INCLUDE_DIR} [[
      #include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
      int main() { return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1") ? 0 : 1; }
    ]])
  endif()
  if(VLMGEN_HAVE_C10D_GLOO)
    target_compile_definitions(vlmgen PRIVATE VLMGEN_HAVE_C10D_GLOO USE_C10D_GLOO)
    target_include_directories(vlmgen PRIVATE ${VLMGEN_GLOO_INCLUDE_DIR})
    message(STATUS "vlmgen: c10d Gloo backend: yes")
  else()
    message(STATUS "vlmgen: c10d Gloo backend: no (needs the Gloo headers, e.g. libgloo-dev); CPU collectives go "
                   "through the c10d store")
  endif()
else()
  message(STATUS "vlmgen: c10d Gloo backend: off (VLMGEN_WITH_GLOO); CPU collectives go through the c10d store")
endif()

if(VLMGEN_WITH_NCCL)
  find_path(VLMGEN_NCCL_INCLUDE_DIR nccl.h)
  if(VLMGEN_NCCL_INCLUDE_DIR)
    _vlmgen_check_c10d_backend(VLMGEN_HAVE_C10D_NCCL USE_C10D_NCCL ${VLMGEN_NCCL_INCLUDE_DIR} [[
      #include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
      int main() { return c10d::ProcessGroupNCCL::Options::create() ? 0 : 1; }
    ]])
  endif()
  if(VLMGEN_HAVE_C10D_NCCL)
    target_compile_definitions(vlmgen PRIVATE VLMGEN_HAVE_C10D_NCCL USE_C10D_NCCL)
    target_include_directories(vlmgen PRIVATE ${VLMGEN_NCCL_INCLUDE_DIR})
    message(STATUS "vlmgen: c10d NCCL backend: yes")
  else()
    message(STATUS "vlmgen: c10d NCCL backend: no")
  endif()
endif()
