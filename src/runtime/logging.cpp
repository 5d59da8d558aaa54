#include "zeroshard/log.h"

#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>

namespace zeroshard {
namespace {

constexpr const char* kLoggerName = "zeroshard";

spdlog::level::level_enum to_spdlog(LogLevel level) {
  switch (level) {
    case LogLevel::kTrace: return spdlog::level::trace;
    case LogLevel::kDebug: return spdlog::level::debug;
    case LogLevel::kInfo: return spdlog::level::info;
    case LogLevel::kWarn: return spdlog::level::warn;
    case LogLevel::kError: return spdlog::level::err;
    case LogLevel::kOff: return spdlog::level::off;
  }
  return spdlog::level::info;
}

LogLevel level_from_env() {
  const char* value = std::getenv("ZS_LOG_LEVEL");
  if (value == nullptr || *value == '\0') return LogLevel::kInfo;
  std::string s(value);
  std::transform(s.begin(), s.end(), s.begin(), ::tolower);
  for (LogLevel l : {LogLevel::kTrace, LogLevel::kDebug, LogLevel::kInfo, LogLevel::kWarn,
                     LogLevel::kError, LogLevel::kOff}) {
    if (s == to_string(l)) return l;
  }
  TORCH_CHECK_VALUE(false, "ZS_LOG_LEVEL='", value,
                    "' is not a log level; set it to one of trace, debug, info, warn, error, off");
  return LogLevel::kInfo;
}

// Guards creation and the rank shown in the pattern.
std::mutex g_mutex;
LogLevel g_level = LogLevel::kInfo;

std::shared_ptr<spdlog::logger> get_logger() {
  auto logger = spdlog::get(kLoggerName);
  if (logger) return logger;
  std::lock_guard<std::mutex> lock(g_mutex);
  logger = spdlog::get(kLoggerName);
  if (logger) return logger;
  logger = spdlog::stderr_logger_mt(kLoggerName);
  logger->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [zeroshard %l] %v");
  g_level = level_from_env();
  logger->set_level(to_spdlog(g_level));
  return logger;
}

}  // namespace

std::string to_string(LogLevel level) {
  switch (level) {
    case LogLevel::kTrace: return "trace";
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarn: return "warn";
    case LogLevel::kError: return "error";
    case LogLevel::kOff: return "off";
  }
  return "?";
}

void init_logging(int rank, int world_size) {
  auto logger = get_logger();
  std::lock_guard<std::mutex> lock(g_mutex);
  LogLevel level = level_from_env();
  // Info comes from rank 0 only; debug/trace were asked for everywhere.
  if (rank != 0 && level == LogLevel::kInfo) level = LogLevel::kWarn;
  g_level = level;
  logger->set_level(to_spdlog(level));
  logger->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [zeroshard %l] [rank " + std::to_string(rank) + "/" +
                      std::to_string(world_size) + "] %v");
}

LogLevel log_level() {
  get_logger();
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_level;
}

void log(LogLevel level, const std::string& message) {
  get_logger()->log(to_spdlog(level), message);
}

std::string error_message(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

}  // namespace zeroshard
