// json_lines.cpp — a JSON line's text, by simdjson's DOM parser.
#include "data/json_lines.h"

#include "io/byte_stream.h"

#include <simdjson.h>

#include <vector>

namespace bart {

namespace {

std::string_view shape_of(simdjson::dom::element_type t) {
  switch (t) {
    case simdjson::dom::element_type::ARRAY: return "an array";
    case simdjson::dom::element_type::OBJECT: return "an object";
    case simdjson::dom::element_type::STRING: return "a string";
    case simdjson::dom::element_type::NULL_VALUE: return "null";
    case simdjson::dom::element_type::BOOL: return "a boolean";
    default: return "a number";
  }
}

}  // namespace

bool is_json_lines(const std::string& path) {
  const std::string name = without_compression(path);
  return name_ends_with(name, ".jsonl") || name_ends_with(name, ".json") || name_ends_with(name, ".ndjson");
}

struct JsonLineDecoder::Impl {
  std::string key;
  simdjson::dom::parser parser;
  std::vector<char> line;  // the line, padded as simdjson reads it
};

JsonLineDecoder::JsonLineDecoder(std::string key) : impl_(std::make_unique<Impl>()) { impl_->key = std::move(key); }

JsonLineDecoder::~JsonLineDecoder() = default;

std::string_view JsonLineDecoder::text(std::string_view line, std::string& problem) {
  problem.clear();
  size_t blank = 0;
  while (blank < line.size() && (line[blank] == ' ' || line[blank] == '\t' || line[blank] == '\r')) ++blank;
  if (blank == line.size()) return {};
  auto& s = *impl_;
  if (s.line.size() < line.size() + simdjson::SIMDJSON_PADDING) s.line.resize(line.size() + simdjson::SIMDJSON_PADDING);
  std::copy(line.begin(), line.end(), s.line.begin());
  simdjson::dom::element doc;
  if (const auto e = s.parser.parse(s.line.data(), line.size(), false).get(doc)) {
    problem = std::string("is not JSON (simdjson: ") + simdjson::error_message(e) + ")";
    return {};
  }
  simdjson::dom::object object;
  if (doc.get(object)) {
    problem = "is " + std::string(shape_of(doc.type())) + ", not a JSON object (a JSON lines file holds one object "
              "per line)";
    return {};
  }
  simdjson::dom::element value;
  if (object.at_key(s.key).get(value)) {
    problem = "has no field \"" + s.key + "\" (the text's field is given by --json-key)";
    return {};
  }
  std::string_view text;
  if (value.get(text)) {
    problem = "has " + std::string(shape_of(value.type())) + " under \"" + s.key + "\", not a string";
    return {};
  }
  return text;
}

}  // namespace bart
