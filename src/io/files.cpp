#include "vlmgen/io/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "vlmgen/error.h"

namespace vlmgen {
namespace {

const char* file_type_name(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "not a regular file";
}

}  // namespace

RegularFile::RegularFile(const std::string& path, const std::string& what) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  VLMGEN_CHECK(fd_ >= 0, "cannot open {} '{}': {}", what, path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    const int err = errno;
    ::close(fd_);
    VLMGEN_FAIL("cannot stat {} '{}': {}", what, path, std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd_);
    VLMGEN_FAIL("{} '{}' must be a regular file, got {}", what, path, file_type_name(st.st_mode));
  }
  size_ = static_cast<int64_t>(st.st_size);
}

RegularFile::~RegularFile() {
  if (fd_ >= 0) ::close(fd_);
}

bool file_exists(const std::string& path, const std::string& what) {
  std::error_code ec;
  const std::filesystem::file_status status = std::filesystem::status(path, ec);
  if (status.type() == std::filesystem::file_type::not_found) return false;
  if (ec == std::errc::not_a_directory) return false;  // a parent is a file
  VLMGEN_CHECK(!ec, "{} {}: cannot tell whether it exists ({}); expected a file or nothing there", what, path,
               ec.message());
  return true;
}

std::string read_regular_file(const std::string& path, const std::string& what, int64_t max_bytes) {
  RegularFile file(path, what);
  VLMGEN_CHECK(file.size() <= max_bytes, "{} '{}' is {} bytes, above the limit of {} bytes", what, path, file.size(),
               max_bytes);
  std::string out(static_cast<size_t>(file.size()), '\0');
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::read(file.fd(), &out[done], out.size() - done);
    if (n < 0 && errno == EINTR) continue;
    VLMGEN_CHECK(n >= 0, "cannot read {} '{}': {}", what, path, std::strerror(errno));
    if (n == 0) break;  // shrank while we read: keep what is there
    done += static_cast<size_t>(n);
  }
  out.resize(done);
  return out;
}

}  // namespace vlmgen
