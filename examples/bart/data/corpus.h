// corpus.h — sentences (what `bart_pretrain prepare` makes a token store's
// sequences of; packed_examples.h packs them into examples).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace bart {

// Sentences: text split after '.', '!' or '?' followed by whitespace, and at
// blank lines; whitespace collapsed to single spaces; empty pieces dropped.
std::vector<std::string> split_sentences(const std::string& text);
// The same sentences, each handed to `sentence` as it is found (a long text's
// sentences are never all held at once).
void each_sentence(std::string_view text, const std::function<void(const std::string&)>& sentence);

}  // namespace bart
