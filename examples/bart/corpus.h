// corpus.h — text: the files of a directory, and sentences (what
// `bart_pretrain prepare` makes a token store's sequences of; packed_examples.h
// packs them into examples).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace bart {

// The contents of every regular file under `dir` (recursively, by sorted
// path; links to a file already read and binary files, those holding a NUL
// byte, are skipped). Throws naming the directory
// when it holds no readable file.
std::vector<std::string> read_texts(const std::string& dir);

// Sentences: text split after '.', '!' or '?' followed by whitespace, and at
// blank lines; whitespace collapsed to single spaces; empty pieces dropped.
std::vector<std::string> split_sentences(const std::string& text);

}  // namespace bart
