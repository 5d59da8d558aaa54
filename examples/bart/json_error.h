// json_error.h — nlohmann::json's error text without its "[json.exception.parse_error.101] "
// prefix: what a person reads after the file's name ("parse error at line 3, column 7: ...").
#pragma once

#include <nlohmann/json.hpp>

#include <string>

namespace bart {

inline std::string json_error_text(const nlohmann::json::exception& e) {
  const std::string what = e.what();
  const size_t end = what.find("] ");
  return what.rfind("[json.exception.", 0) == 0 && end != std::string::npos ? what.substr(end + 2) : what;
}

}  // namespace bart
