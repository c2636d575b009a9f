#pragma once

#include <fmt/format.h>

#include <atomic>
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
  // Read without the lock by log(), so a dropped message costs one load, not a format.
  std::atomic<int> min_level{static_cast<int>(LogLevel::kInfo)};
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
  detail::log_state().min_level.store(static_cast<int>(level), std::memory_order_relaxed);
}

/// True when a message of `level` would reach the sink.
inline bool log_enabled(LogLevel level) {
  return static_cast<int>(level) >= detail::log_state().min_level.load(std::memory_order_relaxed);
}

/// Sends `message` to the sink. The sink runs outside vlmgen's lock (so it may log itself) and
/// may be called from several threads at once.
inline void log_message(LogLevel level, const std::string& message) {
  auto& state = detail::log_state();
  LogSink sink;
  {
    if (!log_enabled(level)) return;
    std::lock_guard<std::mutex> lock(state.mutex);
    sink = state.sink;
  }
  if (sink) {
    sink(level, message);
  } else {
    fmt::print(stderr, "[vlmgen] {}: {}\n", detail::level_name(level), message);
  }
}

/// Formats and logs; the level is checked first, so a dropped message is never formatted. The
/// format string is checked against the arguments at compile time.
template <typename... Args>
void log(LogLevel level, fmt::format_string<Args...> format, Args&&... args) {
  if (!log_enabled(level)) return;
  log_message(level, fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace vlmgen
