// lineage.cpp — a run's line of checkpoints (lineage.h).
#include "lineage.h"

#include <c10/util/Exception.h>

#include <cstdio>
#include <random>

namespace zeroshard::ckpt {

using json = nlohmann::json;

json lineage_of(const json& manifest) {
  if (!manifest.contains("lineage")) return fresh_lineage("");
  const json& l = manifest.at("lineage");
  bool ok = l.is_array() && !l.empty();
  int64_t after = -2;
  for (const auto& s : ok ? l : json::array()) {
    ok = ok && s.is_object() && s.contains("line") && s.at("line").is_string() && s.contains("after") &&
         s.at("after").is_number_integer() && s.at("after").get<int64_t>() > after;
    if (ok) after = s.at("after").get<int64_t>();
  }
  TORCH_CHECK(ok, "checkpoint: the manifest's lineage ", l.dump().substr(0, 200),
              " is not a list of {\"line\", \"after\"} with rising steps: the manifest is corrupt or was edited");
  return l;
}

std::string line_of(const json& manifest) { return lineage_of(manifest).back().at("line").get<std::string>(); }

json branched(const json& lineage, int64_t step, const std::string& line) {
  json out = json::array();
  for (const auto& s : lineage) {
    if (s.at("after").get<int64_t>() < step) out.push_back(s);  // a segment that began after `step` is not history
  }
  if (out.empty()) out = fresh_lineage("");
  out.push_back({{"line", line}, {"after", step}});
  return out;
}

json fresh_lineage(const std::string& line) { return json::array({{{"line", line}, {"after", -1}}}); }

bool in_history(const json& lineage, int64_t step, const std::string& line) {
  for (size_t i = 0; i < lineage.size(); ++i) {
    const int64_t from = lineage[i].at("after").get<int64_t>();
    const bool until = i + 1 == lineage.size() || step <= lineage[i + 1].at("after").get<int64_t>();
    // A segment's own branch step is in it too: a run that saves the step it loaded saves that state again.
    if (lineage[i].at("line").get<std::string>() == line && step >= from && until) return true;
  }
  return false;
}

std::string new_line_id() {
  std::random_device device;
  const uint64_t x = (static_cast<uint64_t>(device()) << 32) ^ device();
  char buf[20];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(x));
  return buf;
}

}  // namespace zeroshard::ckpt
