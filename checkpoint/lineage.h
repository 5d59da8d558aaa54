// lineage.h — a run's line of checkpoints: which saved states follow from which.
//
// A step number does not identify a state: after a rollback (load(step) of an
// older step), a fallback from a damaged step, or two jobs on one store, several
// states carry the same number. Every launch that saves therefore draws a line
// (16 random hex digits) and records, in each manifest, the lineage it descends
// from: the lines it continued, each with the step it branched after:
//
//   "lineage": [{"line": "3f0c...", "after": -1}, {"line": "a91e...", "after": 800}]
//
// reads "saved on line 3f0c... from the start, then (a load of step 800) on line
// a91e...". A step S of line X belongs to this history when X is one of its
// segments and S lies in that segment's range (from its branch point, up to the
// next one's, both included: a run that saves the step it loaded saves that state). A manifest saved before lines existed has the lineage
// [{"line": "", "after": -1}]: line "" (the durable tier's commits of that time).
// Pure functions, tested alone.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

namespace zeroshard::ckpt {

// A manifest's lineage (its "lineage", or the one of a manifest saved before lines).
// Throws, naming the problem, when it is present and malformed.
nlohmann::json lineage_of(const nlohmann::json& manifest);
// The line a manifest was saved on: its lineage's last segment's.
std::string line_of(const nlohmann::json& manifest);
// `lineage` continued after `step` on `line` (a run that loaded that step and saves on).
nlohmann::json branched(const nlohmann::json& lineage, int64_t step, const std::string& line);
// A lineage of one line from the start (a run that loaded nothing).
nlohmann::json fresh_lineage(const std::string& line);
// Whether step `step` of line `line` is in the history `lineage` describes.
bool in_history(const nlohmann::json& lineage, int64_t step, const std::string& line);
// 16 random hex digits.
std::string new_line_id();

}  // namespace zeroshard::ckpt
