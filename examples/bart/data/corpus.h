// corpus.h — sentences (what `bart_pretrain prepare` makes a token store's
// sequences of; packed_examples.h packs them into examples).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace bart {

// Sentences: text split after '.', '!' or '?' followed by whitespace, and at
// blank lines; whitespace collapsed to single spaces; empty pieces dropped.
std::vector<std::string> split_sentences(const std::string& text);

}  // namespace bart
