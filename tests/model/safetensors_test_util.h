#pragma once

// Helpers shared by the safetensors tests (safetensors_test.cpp, safetensors_malformed_test.cpp):
// a fresh directory per test and the raw bytes of the files written there.

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <ios>
#include <iterator>
#include <string>
#include <vector>

namespace vlmgen::safetensors_test {

// A fresh directory per test so parallel ctest runs do not share files.
class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = ::testing::TempDir() + "vlmgen_safetensors_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    // Best effort; files are small and live under the test temp dir.
    for (const auto& f : created_) ::unlink(f.c_str());
    ::rmdir(dir_.c_str());
  }
  std::string file(const std::string& name) {
    created_.push_back(dir_ + "/" + name);
    return created_.back();
  }

  std::string dir_;
  std::vector<std::string> created_;
};

inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline uint64_t header_length(const std::string& bytes) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[i]);
  return n;
}

}  // namespace vlmgen::safetensors_test
