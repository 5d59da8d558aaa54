// training_data.h — what a run trains on: one prepared dataset's examples, or
// several blended by weight (`--dataset A:0.7,B:0.3`; zeroshard/blend.h), each
// with its own validation set. The sampler draws positions; a position and its
// epoch name a source's example and that source's epoch (which seed the noise),
// a pure function of (seed, epoch, position). Reading is thread-safe.
#pragma once

#include "data/packed_examples.h"

#include <zeroshard/blend.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace bart {

// `--dataset`: "PATH", or "PATH:WEIGHT,PATH:WEIGHT,..." (weights positive; normalised).
// Throws naming the part that is neither.
std::vector<std::pair<std::string, double>> parse_datasets(const std::string& text);

struct DataSource {
  std::string name;  // its path as given
  double weight = 1;
  std::unique_ptr<PackedExamples> examples;
};

class TrainingData {
 public:
  // REQUIRES: sources not empty, each with examples. Throws naming a source
  // with no training examples.
  explicit TrainingData(std::vector<DataSource> sources);

  // The sampler's positions per epoch, and whether it shuffles them (one
  // dataset: yes; a blend: no, each source's own permutation shuffles).
  int64_t size() const;
  bool shuffle() const { return !blend_; }

  struct Drawn {
    int source = 0;
    int64_t index = 0;  // the source's training example
    int64_t epoch = 0;  // the source's epoch
  };
  Drawn draw(int64_t epoch, int64_t position, uint64_t seed) const;
  Example example(const Drawn& d) const;
  int64_t target_tokens(const Drawn& d) const;

  const std::vector<DataSource>& sources() const { return sources_; }
  bool blended() const { return blend_.has_value(); }
  // What a checkpoint records and a resume compares: the sources, their sizes and weights.
  std::string description() const;

 private:
  std::vector<DataSource> sources_;
  std::optional<zeroshard::Blend> blend_;
};

}  // namespace bart
