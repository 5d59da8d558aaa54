// partition.cpp — layout strings, uniform and balanced partitions, and their check.
#include "zeroshard/pipeline_partition.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <limits>
#include <sstream>

namespace zeroshard::pipeline {
namespace {

std::string block_name(const std::vector<Block>& blocks, size_t i) {
  return "block " + std::to_string(i) + " '" + blocks[i].name + "' (" + blocks[i].symbol + ")";
}

bool is_symbol(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return std::isalpha(static_cast<unsigned char>(c)) || c == '_'; });
}

// One stage of a layout string: its symbols, repeats expanded.
std::vector<std::string> read_stage(const std::string& text, const std::string& layout) {
  std::vector<std::string> out;
  std::istringstream words(text);
  std::string word;
  while (words >> word) {
    const size_t star = word.find('*');
    const std::string sym = word.substr(0, star);
    int64_t count = 1;
    if (star != std::string::npos) {
      const std::string n = word.substr(star + 1);
      const bool digits = !n.empty() && n.size() <= 6 && std::all_of(n.begin(), n.end(), [](char c) { return c >= '0' && c <= '9'; });
      count = digits ? std::stoll(n) : 0;
    }
    TORCH_CHECK_VALUE(is_symbol(sym) && count >= 1, "pipeline partition: '", word, "' in layout '", layout,
                      "' is not a block symbol or symbol*count (letters, then an optional *N with N >= 1)");
    out.insert(out.end(), static_cast<size_t>(count), sym);
  }
  return out;
}

}  // namespace

size_t Partition::stage_of(size_t block) const {
  for (size_t s = 0; s < stages.size(); ++s) {
    if (std::find(stages[s].begin(), stages[s].end(), block) != stages[s].end()) return s;
  }
  TORCH_CHECK(false, "Partition::stage_of: block ", block, " is in no stage");
}

Partition partition_by_layout(const std::vector<Block>& blocks, const std::string& layout) {
  Partition p;
  size_t next = 0;
  std::string rest = layout;
  for (size_t s = 0;; ++s) {
    const size_t bar = rest.find('|');
    const auto symbols = read_stage(rest.substr(0, bar), layout);
    TORCH_CHECK_VALUE(!symbols.empty(), "pipeline partition: stage ", s, " of layout '", layout,
                      "' holds no block; every stage needs at least one");
    std::vector<size_t> stage;
    for (const auto& sym : symbols) {
      TORCH_CHECK_VALUE(next < blocks.size(), "pipeline partition: layout '", layout, "' names ", next + 1,
                        " or more blocks but the model has ", blocks.size(), "; remove the extra '", sym,
                        "' from stage ", s);
      TORCH_CHECK_VALUE(blocks[next].symbol == sym, "pipeline partition: layout '", layout, "' puts a '", sym,
                        "' in stage ", s, " where the model has ", block_name(blocks, next),
                        "; the layout's symbols must read as the blocks' symbols, in order");
      stage.push_back(next++);
    }
    p.stages.push_back(std::move(stage));
    if (bar == std::string::npos) break;
    rest = rest.substr(bar + 1);
  }
  TORCH_CHECK_VALUE(next == blocks.size(), "pipeline partition: layout '", layout, "' covers ", next, " of the model's ",
                    blocks.size(), " blocks; ", block_name(blocks, next), " and ", blocks.size() - next - 1,
                    " after it are in no stage (they would be dropped): add them to the layout");
  check_partition(blocks, p);
  return p;
}

Partition partition_uniform(const std::vector<Block>& blocks, int stages) {
  TORCH_CHECK_VALUE(stages >= 1 && static_cast<size_t>(stages) <= blocks.size(), "pipeline partition: ", stages,
                    " stages for ", blocks.size(), " blocks; use 1 to ", blocks.size(), " stages");
  Partition p;
  const size_t n = blocks.size(), k = static_cast<size_t>(stages);
  size_t next = 0;
  for (size_t s = 0; s < k; ++s) {
    const size_t count = n / k + (s < n % k ? 1 : 0);
    std::vector<size_t> stage;
    for (size_t i = 0; i < count; ++i) stage.push_back(next++);
    p.stages.push_back(std::move(stage));
  }
  check_partition(blocks, p);
  return p;
}

Partition partition_balanced(const std::vector<Block>& blocks, int stages) {
  TORCH_CHECK_VALUE(stages >= 1 && static_cast<size_t>(stages) <= blocks.size(), "pipeline partition: ", stages,
                    " stages for ", blocks.size(), " blocks; use 1 to ", blocks.size(), " stages");
  const size_t n = blocks.size(), k = static_cast<size_t>(stages);
  std::vector<int64_t> prefix(n + 1, 0);
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(blocks[i].params >= 0, "pipeline partition: ", block_name(blocks, i), " has ", blocks[i].params,
                      " parameters");
    prefix[i + 1] = prefix[i] + blocks[i].params;
  }
  // best[j][i]: the smallest largest stage over splits of blocks [0, i) into j stages; cut[j][i]: where the last starts.
  constexpr int64_t kInf = std::numeric_limits<int64_t>::max();
  std::vector<std::vector<int64_t>> best(k + 1, std::vector<int64_t>(n + 1, kInf));
  std::vector<std::vector<size_t>> cut(k + 1, std::vector<size_t>(n + 1, 0));
  best[0][0] = 0;
  for (size_t j = 1; j <= k; ++j) {
    for (size_t i = j; i <= n; ++i) {
      for (size_t c = j - 1; c < i; ++c) {  // the last stage is [c, i)
        if (best[j - 1][c] == kInf) continue;
        const int64_t worst = std::max(best[j - 1][c], prefix[i] - prefix[c]);
        if (worst < best[j][i]) {  // ties keep the earliest cut: later stages take more blocks (under 1F1B the
          // earlier stages hold more microbatches of activations)
          best[j][i] = worst;
          cut[j][i] = c;
        }
      }
    }
  }
  Partition p;
  p.stages.resize(k);
  for (size_t j = k, i = n; j > 0; --j) {
    for (size_t b = cut[j][i]; b < i; ++b) p.stages[j - 1].push_back(b);
    i = cut[j][i];
  }
  check_partition(blocks, p);
  return p;
}

void check_partition(const std::vector<Block>& blocks, const Partition& partition) {
  TORCH_CHECK_VALUE(!partition.stages.empty(), "pipeline partition: no stages");
  size_t next = 0;
  for (size_t s = 0; s < partition.stages.size(); ++s) {
    const auto& stage = partition.stages[s];
    TORCH_CHECK_VALUE(!stage.empty(), "pipeline partition: stage ", s, " holds no block; every stage needs one");
    for (size_t b : stage) {
      TORCH_CHECK_VALUE(b < blocks.size(), "pipeline partition: stage ", s, " names block ", b, " of ", blocks.size());
      TORCH_CHECK_VALUE(b >= next, "pipeline partition: stage ", s, " holds ", block_name(blocks, b),
                        " again or out of order (the next block is ", next, "); stages hold contiguous runs, in order");
      TORCH_CHECK_VALUE(b == next, "pipeline partition: ", block_name(blocks, next), " is in no stage (stage ", s,
                        " jumps to ", block_name(blocks, b), "); it would be dropped");
      ++next;
    }
  }
  TORCH_CHECK_VALUE(next == blocks.size(), "pipeline partition: ", block_name(blocks, next),
                    " and every block after it are in no stage; they would be dropped");
}

std::string to_layout(const std::vector<Block>& blocks, const Partition& partition) {
  check_partition(blocks, partition);
  std::string out;
  for (size_t s = 0; s < partition.stages.size(); ++s) {
    if (s > 0) out += " | ";
    const auto& stage = partition.stages[s];
    for (size_t i = 0; i < stage.size();) {
      size_t run = 1;
      while (i + run < stage.size() && blocks[stage[i + run]].symbol == blocks[stage[i]].symbol) ++run;
      if (i > 0) out += " ";
      out += blocks[stage[i]].symbol;
      if (run > 1) {
        out += '*';
        out += std::to_string(run);
      }
      i += run;
    }
  }
  return out;
}

}  // namespace zeroshard::pipeline
