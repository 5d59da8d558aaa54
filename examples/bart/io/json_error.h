// json_error.h — JSON files a person gives on the command line, read with errors that name the
// file and the position: nlohmann::json's error text without its "[json.exception.parse_error.101] "
// prefix ("parse error at line 3, column 7: ..."), and a JSON object parsed with such errors.
#pragma once

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <string>

namespace bart {

inline std::string json_error_text(const nlohmann::json::exception& e) {
  const std::string what = e.what();
  const size_t end = what.find("] ");
  return what.rfind("[json.exception.", 0) == 0 && end != std::string::npos ? what.substr(end + 2) : what;
}

// `text` as a JSON object; else an error that starts with `what` (the file, named) and says
// where the text stops being JSON, or that it is not an object (`shape`: what one looks like).
inline nlohmann::json parse_json_object(const std::string& text, const std::string& what, const std::string& shape) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK_VALUE(false, what, " is not JSON: ", json_error_text(e));
  }
  TORCH_CHECK_VALUE(j.is_object(), what, " is not a JSON object (", shape, ")");
  return j;
}

}  // namespace bart
