// rank_agreement.h — make sure every rank set up the same thing before any data moves.
//
// Each rank describes what it built as a list of text entries (one per
// parameter, plus the options). check_same_on_all_ranks() exchanges one hash;
// when the hashes differ it finds the first entry where some rank differs from
// rank 0 and throws on every rank with both versions of that entry, instead of
// letting mismatched collectives hang or corrupt memory later.
#pragma once

#include "zeroshard/comm.h"

#include <string>
#include <vector>

namespace zeroshard::runtime {

// Collective. `what` names the thing compared in the error ("ShardedAdamW parameters").
void check_same_on_all_ranks(Communicator& comm, const std::vector<std::string>& entries,
                             const std::string& what);
}  // namespace zeroshard::runtime
