#pragma once

#include <fmt/format.h>

#include <functional>
#include <mutex>
#include <string>
#include <utility>

namespace vlmgen {

enum class LogLevel { kDebug, kInfo, kWarning, kError };

/// Receives every message vlmgen logs. The default prints "[vlmgen] <level>: <message>" to stderr.
using LogSink = std::function<void(LogLevel, const std::string&)>;

namespace detail {
struct LogState {
  std::mutex mutex;
  LogSink sink;
  LogLevel min_level = LogLevel::kInfo;
};
inline LogState& log_state() {
  static LogState state;
  return state;
}
inline const char* level_name(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarning: return "warning";
    case LogLevel::kError: return "error";
  }
  return "?";
}
}  // namespace detail

/// Replaces the sink (an empty function restores the stderr default); returns the previous one.
inline LogSink set_log_sink(LogSink sink) {
  auto& state = detail::log_state();
  std::lock_guard<std::mutex> lock(state.mutex);
  std::swap(state.sink, sink);
  return sink;
}

/// Messages below `level` are dropped. Default: kInfo.
inline void set_log_level(LogLevel level) {
  auto& state = detail::log_state();
  std::lock_guard<std::mutex> lock(state.mutex);
  state.min_level = level;
}

/// Sends `message` to the sink. The sink runs outside vlmgen's lock (so it may log itself) and
/// may be called from several threads at once.
inline void log_message(LogLevel level, const std::string& message) {
  auto& state = detail::log_state();
  LogSink sink;
  {
    std::lock_guard<std::mutex> lock(state.mutex);
    if (level < state.min_level) return;
    sink = state.sink;
  }
  if (sink) {
    sink(level, message);
  } else {
    fmt::print(stderr, "[vlmgen] {}: {}\n", detail::level_name(level), message);
  }
}

template <typename... Args>
void log(LogLevel level, fmt::string_view format, Args&&... args) {
  log_message(level, fmt::vformat(format, fmt::make_format_args(args...)));
}

}  // namespace vlmgen
