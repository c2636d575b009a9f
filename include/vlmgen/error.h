#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <stdexcept>
#include <string>
#include <utility>

namespace vlmgen {

/// The one exception type vlmgen throws for caller errors (bad shapes, bad ids, overflow).
/// Messages say what was expected and what came, with the numbers.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

namespace detail {
// The format string is checked at compile time against the arguments (fmt::format_string), so
// a message with more `{}` than values cannot build, instead of throwing fmt::format_error at
// the moment it should have thrown vlmgen::Error.
template <typename... Args>
[[noreturn]] void throw_error(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}
}  // namespace detail

}  // namespace vlmgen

/// Throws vlmgen::Error with a {fmt}-formatted message when `cond` is false.
///   VLMGEN_CHECK(ids.size(0) == n, "expected {} rows, got {}", n, ids.size(0));
#define VLMGEN_CHECK(cond, ...)                   \
  do {                                            \
    if (!(cond)) {                                \
      ::vlmgen::detail::throw_error(__VA_ARGS__); \
    }                                             \
  } while (false)

/// Throws vlmgen::Error unconditionally.
#define VLMGEN_FAIL(...) ::vlmgen::detail::throw_error(__VA_ARGS__)
