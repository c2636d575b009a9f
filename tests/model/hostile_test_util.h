#pragma once

// Helpers for the tests that feed vlmgen hostile files (hostile_*_test.cpp).

#include <fcntl.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <string>
#include <thread>

#include "vlmgen/error.h"

namespace vlmgen::hostile_test {

/// A fresh directory per test, removed afterwards.
class TempDir {
 public:
  TempDir() {
    std::string pattern = ::testing::TempDir() + "vlmgen_hostile_XXXXXX";
    if (::mkdtemp(pattern.data()) != nullptr) path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

/// Seconds since `start` on the steady clock.
inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

/// The message of the vlmgen::Error `call` throws; "<no error>" when it returns, and a
/// description of any other exception (a test failure in itself).
inline std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("<not a vlmgen::Error: ") + e.what() + ">";
  }
  return "<no error>";
}

/// error_of(call), run on a thread: when it has not returned within `limit`, the test fails and
/// the FIFO at `fifo` is opened for writing and closed, which lets a reader blocked on it
/// return, so that the old behaviour (blocking forever) fails the test instead of hanging it.
inline std::string error_within(std::chrono::milliseconds limit, const std::string& fifo,
                                const std::function<void()>& call) {
  std::packaged_task<std::string()> task([&] { return error_of(call); });
  std::future<std::string> result = task.get_future();
  std::thread worker(std::move(task));
  if (result.wait_for(limit) != std::future_status::ready) {
    ADD_FAILURE() << "still blocked after " << limit.count() << " ms on " << fifo;
    while (result.wait_for(std::chrono::milliseconds(50)) != std::future_status::ready) {
      const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
      if (fd >= 0) ::close(fd);  // the reader sees end of file
    }
  }
  worker.join();
  return result.get();
}

}  // namespace vlmgen::hostile_test
