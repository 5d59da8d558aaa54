#include "runtime/rank_agreement.h"

#include <c10/util/Exception.h>

#include <xxhash.h>

#include <algorithm>
#include <sstream>

namespace zeroshard::runtime {
namespace {

int64_t hash_of(const std::string& s) {
  return static_cast<int64_t>(XXH3_64bits(s.data(), s.size()));
}

// Every rank's copy of `mine` (int64 values), rank-major.
std::vector<int64_t> gather(Communicator& comm, const std::vector<int64_t>& mine) {
  auto in = at::tensor(mine, at::kLong);
  auto out = at::empty({static_cast<int64_t>(mine.size()) * comm.size()}, at::kLong);
  comm.all_gather(out, in)->wait();
  return std::vector<int64_t>(out.data_ptr<int64_t>(), out.data_ptr<int64_t>() + out.numel());
}

constexpr size_t kTextBytes = 320;  // an entry's text as exchanged (longer text is cut)

}  // namespace

void check_same_on_all_ranks(Communicator& comm, const std::vector<std::string>& entries,
                             const std::string& what) {
  const int n = comm.size();
  std::string joined;
  for (const auto& e : entries) joined += e + "\n";
  const auto summary = gather(comm, {hash_of(joined), static_cast<int64_t>(entries.size())});
  bool same = true;
  int64_t longest = 0;
  for (int r = 0; r < n; ++r) {
    same = same && summary[2 * r] == summary[0] && summary[2 * r + 1] == summary[1];
    longest = std::max(longest, summary[2 * r + 1]);
  }
  if (same) return;

  // Per-entry hashes (0 past a rank's end) locate the first difference.
  std::vector<int64_t> hashes(static_cast<size_t>(longest), 0);
  for (size_t i = 0; i < entries.size(); ++i) hashes[i] = hash_of(entries[i]) | 1;
  const auto all = gather(comm, hashes);
  int64_t index = longest;
  int other = 0;
  for (int64_t i = 0; i < longest && index == longest; ++i) {
    for (int r = 1; r < n; ++r) {
      if (all[static_cast<size_t>(r * longest + i)] != all[static_cast<size_t>(i)]) {
        index = i;
        other = r;
        break;
      }
    }
  }
  // Exchange the text of that entry.
  const auto texts = all_gather_text(
      comm, index < static_cast<int64_t>(entries.size()) ? entries[static_cast<size_t>(index)].substr(0, kTextBytes)
                                                         : "(none: only " + std::to_string(entries.size()) + " entries)");
  auto text_of = [&](int r) { return texts[static_cast<size_t>(r)]; };
  std::ostringstream msg;
  msg << what << " differ between ranks: entry #" << index << " is " << text_of(0) << " on rank 0 but "
      << text_of(other) << " on rank " << other << " (rank 0 has " << summary[1] << " entries, rank "
      << other << " has " << summary[2 * other + 1]
      << "); every rank must build the same model and pass the same options";
  TORCH_CHECK(false, msg.str());
}

}  // namespace zeroshard::runtime
