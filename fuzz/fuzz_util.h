#pragma once

// Helpers shared by the fuzz targets: a private scratch directory (the readers under test take
// paths, and mmap is part of what is tested) and splitting one input into several files.

#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

namespace vlmgen::fuzz {

/// Separates the files packed into one fuzz input (also in fuzz/vlmgen.dict, so that mutations
/// can insert it).
inline constexpr std::string_view kFileSeparator = "\n#vlmgen-file#\n";

/// A directory of this process's own, made once (under $TMPDIR or /tmp).
inline const std::string& scratch_dir() {
  static const std::string dir = [] {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/vlmgen_fuzz_XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) {
      std::perror("mkdtemp");
      std::abort();
    }
    return pattern;
  }();
  return dir;
}

inline void write_file(const std::string& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

/// The parts of `input` between separators (at most `max_parts`; the last takes the rest).
inline std::vector<std::string_view> split_files(const uint8_t* data, size_t size, size_t max_parts) {
  std::string_view rest(reinterpret_cast<const char*>(data), size);
  std::vector<std::string_view> parts;
  while (parts.size() + 1 < max_parts) {
    const size_t at = rest.find(kFileSeparator);
    if (at == std::string_view::npos) break;
    parts.push_back(rest.substr(0, at));
    rest.remove_prefix(at + kFileSeparator.size());
  }
  parts.push_back(rest);
  return parts;
}

}  // namespace vlmgen::fuzz
