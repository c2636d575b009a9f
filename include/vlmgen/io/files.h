#pragma once

// Reading files that may come from a stranger. A FIFO, a socket, a device or a directory given
// where a file is expected (config.json, a shard, an index, an image) is refused instead of
// blocking forever or reading without end: the file is opened non-blocking and its type checked
// before a byte is read.
//
//   std::string text = vlmgen::read_regular_file(path, "config file", 4 << 20);

#include <cstdint>
#include <string>

namespace vlmgen {

/// A read-only descriptor of a regular file, opened with O_NONBLOCK (opening a FIFO for reading
/// would otherwise wait for a writer) and checked with fstat. Closes the descriptor on
/// destruction. Throws vlmgen::Error naming `what` and `path` when the file cannot be opened or
/// is not a regular file (saying what it is instead).
class RegularFile {
 public:
  RegularFile(const std::string& path, const std::string& what);
  ~RegularFile();
  RegularFile(const RegularFile&) = delete;
  RegularFile& operator=(const RegularFile&) = delete;

  int fd() const { return fd_; }
  /// Size in bytes when opened.
  int64_t size() const { return size_; }

 private:
  int fd_ = -1;
  int64_t size_ = 0;
};

/// Whether `path` names something (a file of any type, or a link to one). False only where it does
/// not exist (no such entry, or a parent that is not a folder); a path that cannot be checked (a
/// link that loops, a folder without search permission) is a vlmgen::Error naming `what`, `path`
/// and the reason, not "absent" and not a std::filesystem exception.
bool file_exists(const std::string& path, const std::string& what);

/// The whole content of the regular file `path`. Throws vlmgen::Error naming `what`, `path` and
/// the numbers when the file is not regular, is larger than `max_bytes`, or cannot be read.
std::string read_regular_file(const std::string& path, const std::string& what, int64_t max_bytes);

}  // namespace vlmgen
