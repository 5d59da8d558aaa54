// zeroshard/log.h — the "zeroshard" logger, for the library and for trainers.
//
// Every line carries the rank and world size. Info and below come from rank 0
// only; warnings and errors from every rank. The level comes from ZS_LOG_LEVEL
// (trace, debug, info, warn, error, off; Default: info); at debug or trace every
// rank logs at that level. Thread-safe. The logger writes to stderr.
#pragma once

#include <exception>
#include <string>

namespace zeroshard {

enum class LogLevel { kTrace, kDebug, kInfo, kWarn, kError, kOff };
std::string to_string(LogLevel level);

// Sets the rank shown in every line and applies the rank-0 rule. Called by
// init_communicator(); call it yourself only to log before that. Idempotent.
void init_logging(int rank, int world_size);

// The effective level of this process (after the rank-0 rule).
LogLevel log_level();

void log(LogLevel level, const std::string& message);
inline void log_debug(const std::string& message) { log(LogLevel::kDebug, message); }
inline void log_info(const std::string& message) { log(LogLevel::kInfo, message); }
inline void log_warn(const std::string& message) { log(LogLevel::kWarn, message); }
inline void log_error(const std::string& message) { log(LogLevel::kError, message); }

// What an exception says, for a person: a c10::Error's message without LibTorch's
// C++ backtrace ("frame #0: ..."), any other exception's what().
std::string error_message(const std::exception& e);

}  // namespace zeroshard
