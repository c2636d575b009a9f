# Sanitizer and fuzzing builds (clang). Both are off by default; scripts/dev.sh sanitize turns
# them on in a build folder of its own (build-asan):
#
#   cmake -S . -B build-asan -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
#         -DVLMGEN_SANITIZE=address,undefined -DVLMGEN_BUILD_FUZZERS=ON
#
# Only vlmgen's own code is instrumented: LibTorch, GoogleTest and the system libraries are
# used as installed. See fuzz/README.md for running the fuzzers.

set(VLMGEN_SANITIZE "" CACHE STRING
  "Sanitizers for vlmgen's own code, as for -fsanitize= (e.g. address,undefined); empty for none")
option(VLMGEN_BUILD_FUZZERS "Build the libFuzzer targets in fuzz/ (clang only)" OFF)

if(VLMGEN_SANITIZE)
  # -fno-sanitize-recover: a UBSan finding fails the test run instead of scrolling past.
  add_compile_options(-fsanitize=${VLMGEN_SANITIZE} -fno-sanitize-recover=undefined -fno-omit-frame-pointer)
  add_link_options(-fsanitize=${VLMGEN_SANITIZE})
endif()

if(VLMGEN_BUILD_FUZZERS)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "VLMGEN_BUILD_FUZZERS needs clang (libFuzzer); configure with -DCMAKE_CXX_COMPILER=clang++")
  endif()
  # Coverage feedback from the library the fuzzers call into, not only from the fuzzers' own
  # files; the tests built in the same tree get the (cheap) counters too, so the library is
  # compiled once for both.
  add_compile_options(-fsanitize=fuzzer-no-link)
endif()
