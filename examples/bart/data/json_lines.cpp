// json_lines.cpp — a JSON line's text, by simdjson's On-Demand parser.
#include "data/json_lines.h"

#include "io/byte_stream.h"

#include <simdjson.h>

#include <utility>
#include <vector>

namespace bart {

namespace {

std::string_view shape_of(simdjson::ondemand::json_type t) {
  switch (t) {
    case simdjson::ondemand::json_type::array: return "an array";
    case simdjson::ondemand::json_type::object: return "an object";
    case simdjson::ondemand::json_type::string: return "a string";
    case simdjson::ondemand::json_type::null: return "null";
    case simdjson::ondemand::json_type::boolean: return "a boolean";
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
  simdjson::ondemand::parser parser;
  std::vector<char> line;  // the line, padded as simdjson reads it
};

JsonLineDecoder::JsonLineDecoder(std::string key) : impl_(std::make_unique<Impl>()) { impl_->key = std::move(key); }

JsonLineDecoder::~JsonLineDecoder() = default;

std::string_view JsonLineDecoder::text(std::string_view line, size_t readable, std::string& problem) {
  static_assert(kJsonPadding >= simdjson::SIMDJSON_PADDING, "kJsonPadding is simdjson's padding");
  problem.clear();
  size_t blank = 0;
  while (blank < line.size() && (line[blank] == ' ' || line[blank] == '\t' || line[blank] == '\r')) ++blank;
  if (blank == line.size()) return {};
  auto& s = *impl_;
  // A parser sized for a long line keeps that memory (the text it unescaped, its indexes): a much
  // shorter line gets a fresh one, so a worker does not hold a long line's cost to the end.
  constexpr size_t kLong = size_t{16} << 20;
  if (s.parser.capacity() > kLong && s.parser.capacity() > 4 * line.size()) s.parser = simdjson::ondemand::parser();
  const char* at = line.data();
  size_t capacity = readable;
  if (readable < line.size() + simdjson::SIMDJSON_PADDING) {
    if (s.line.size() < line.size() + simdjson::SIMDJSON_PADDING) s.line.resize(line.size() + simdjson::SIMDJSON_PADDING);
    std::copy(line.begin(), line.end(), s.line.begin());
    at = s.line.data();
    capacity = s.line.size();
  }
  auto not_json = [&](simdjson::error_code e, const char* what = nullptr) {
    problem = std::string("is not JSON (") + (what ? what : "simdjson: " + std::string(simdjson::error_message(e))) + ")";
    return std::string_view{};
  };
  simdjson::ondemand::document doc;
  if (const auto e = s.parser.iterate(at, line.size(), capacity).get(doc)) return not_json(e);
  simdjson::ondemand::json_type type;
  if (const auto e = doc.type().get(type)) return not_json(e);
  if (type != simdjson::ondemand::json_type::object) {
    problem = "is " + std::string(shape_of(type)) + ", not a JSON object (a JSON lines file holds one object per line)";
    return {};
  }
  simdjson::ondemand::object object;
  if (const auto e = doc.get_object().get(object)) return not_json(e);
  // Every field is walked, and only the text's value read: what Python's json (Megatron's reader)
  // accepts in the others (NaN, integers past 64 bits, 1e400, lone surrogates) is skipped unread.
  // A key given twice: the last one's, as Python's.
  std::string_view text;
  bool found = false;
  for (auto item : object) {
    simdjson::ondemand::field field;
    if (const auto e = std::move(item).get(field)) return not_json(e);
    std::string_view key;
    if (const auto e = field.unescaped_key().get(key)) return not_json(e);
    if (key != s.key) continue;
    simdjson::ondemand::json_type vt;
    if (const auto e = field.value().type().get(vt)) return not_json(e);
    if (vt != simdjson::ondemand::json_type::string) {
      problem = "has " + std::string(shape_of(vt)) + " under \"" + s.key + "\", not a string";
      return {};
    }
    if (const auto e = field.value().get_string().get(text)) return not_json(e);
    found = true;
  }
  const char* after = nullptr;  // past the object: the end of the line (OUT_OF_BOUNDS), or more
  if (doc.current_location().get(after) != simdjson::OUT_OF_BOUNDS) return not_json(simdjson::SUCCESS, "more after the object");
  if (!found) {
    problem = "has no field \"" + s.key + "\" (the text's field is given by --json-key)";
    return {};
  }
  return text;
}

}  // namespace bart
