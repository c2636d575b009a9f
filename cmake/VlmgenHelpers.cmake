# Common settings for vlmgen's own compiled targets.
function(vlmgen_target_defaults target)
  target_compile_features(${target} PRIVATE cxx_std_17)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE -Wall -Wextra -Wno-unused-parameter)
  endif()
endfunction()

# Precompiles the heavy headers (ATen, GoogleTest) of a test or example executable.
function(vlmgen_precompile target)
  if(VLMGEN_USE_PCH)
    target_precompile_headers(${target} PRIVATE <ATen/ATen.h> <fmt/format.h> ${ARGN})
  endif()
endfunction()
