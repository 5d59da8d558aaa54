// training.h — the pieces of BART pretraining between the corpus and the
// optimizer: noised batches, the token-weighted loss, validation across ranks
// and a denoising sample.
#pragma once

#include "model/bart_model.h"
#include "data/packed_examples.h"
#include "data/training_data.h"
#include "data/noise.h"
#include "train/pipeline_training.h"
#include "tokenizer/tokenizer.h"

#include <zeroshard/comm.h>

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

namespace bart {

struct Batch {
  torch::Tensor input_ids;  // [B, S] noised, padded with pad_id
  torch::Tensor labels;     // [B, T] original, padded with pad_id (ignored by the loss)
  int64_t target_tokens = 0;  // labels that are not padding
  bool source_padded = true;  // some source is shorter than the longest (known on the host: no mask when false)
};

// The noise of an example depends only on (seed, epoch, index), never on the
// rank or the world size, so any number of ranks sees the same global batch and
// a resumed run sees the same noise.
NoisedExample noised_example(const Example& example, int64_t index, const NoiseOptions& noise, uint64_t seed,
                             int64_t epoch);

// The examples at `indices` (epochs[i] is the epoch of indices[i]), noised and
// padded to the longest in the batch, on `device`.
Batch make_batch(const PackedExamples::Split& examples, const std::vector<int64_t>& indices,
                 const std::vector<int64_t>& epochs, const NoiseOptions& noise, uint64_t seed, int64_t pad_id,
                 torch::Device device = torch::kCPU);

// The training examples at the sampler's `positions` (of epochs[i]): each its
// source's example (TrainingData::draw), noised by (seed + source, the
// source's epoch, the example); with one dataset, make_batch of its training split.
Batch make_batch(const TrainingData& data, const std::vector<int64_t>& positions, const std::vector<int64_t>& epochs,
                 const NoiseOptions& noise, uint64_t seed, int64_t pad_id, torch::Device device = torch::kCPU);

// Sum over target tokens of the cross-entropy (pad ignored), as a scalar
// tensor with gradients.
torch::Tensor summed_loss(BartForConditionalGeneration& model, const Batch& batch);

struct Validation {
  double loss = 0;       // mean cross-entropy per target token, all ranks
  int64_t tokens = 0;    // target tokens evaluated, all ranks
  int64_t examples = 0;  // examples evaluated, all ranks
};
// How many of a validation set's `n` examples an evaluation limited to `limit` takes (0: all).
inline int64_t validation_examples(int64_t n, int64_t limit) { return limit > 0 && limit < n ? limit : n; }
// The validation examples split over the ranks (index % world == rank), in
// batches of `batch_size`; every rank runs the same number of forward passes
// (ranks with fewer examples run padding batches that count for nothing), as
// ZeRO-3 needs. Noise is fixed (seed 0, epoch 0), so values compare across steps.
// `limit` > 0: that many examples at most, spread evenly over the set (the
// same ones every time). Batches go to `device` (the model's). Collective over
// `comm` (a CPU one). Leaves the model in training mode.
Validation validate(BartForConditionalGeneration& model, const PackedExamples::Split& validation,
                    const NoiseOptions& noise, int64_t batch_size, int64_t pad_id, zeroshard::Communicator& comm,
                    torch::Device device = torch::kCPU, int64_t limit = 0);

// The same split over `ranks` data-parallel ranks, as one rank's batches:
// every rank gets the same number; a rank that ran out gets padding batches
// (padding = true: an example that counts for nothing).
struct ValidationBatch {
  Batch batch;
  bool padding = false;
};
std::vector<ValidationBatch> validation_batches(const PackedExamples::Split& validation, const NoiseOptions& noise,
                                               int64_t batch_size, int64_t pad_id, int rank, int ranks,
                                               torch::Device device = torch::kCPU, int64_t limit = 0);

// validate() through pipeline stages: the split over the data-parallel ranks,
// each rank's batches as microbatches of a forward schedule. Collective over
// the pipeline's world.
Validation validate(PipelinedBart& pipe, const PackedExamples::Split& validation, const NoiseOptions& noise,
                    int64_t batch_size, int64_t pad_id, torch::Device device = torch::kCPU, int64_t limit = 0);

// A batch as the pipeline's microbatch: the decoder's input is the labels
// shifted right; dropout keyed by `dropout`.
Microbatch pipeline_microbatch(const Batch& b, const BartConfig& c, DropoutKey dropout);

struct DenoisingSample {
  std::string original, masked, reconstruction;
};
// How well greedy decoding reconstructs held-out sentences: each sentence of
// the validation split with 12 to `max_len` tokens (the first `count`), masked
// by text infilling (seed 0, example i: noise epoch 0, index i), decoded
// greedily in batches of `batch`. Scored by aligning token sequences (a
// longest common subsequence): the original's unmasked tokens are those the
// masked input kept; one counts as reproduced when the alignment of the
// reconstruction with the original pairs it with the same token; likewise the
// masked ones. Collective under fully_shard (every rank decodes).
struct DenoisingAccuracy {
  int64_t sentences = 0;
  int64_t unmasked = 0, unmasked_right = 0;  // tokens the input kept, and how many the decoding reproduced
  int64_t masked = 0, masked_right = 0;      // tokens inside masked spans, and how many it recovered
  int64_t exact = 0;                         // sentences reconstructed exactly
  double unmasked_accuracy() const { return unmasked > 0 ? static_cast<double>(unmasked_right) / unmasked : 0.0; }
  double masked_accuracy() const { return masked > 0 ? static_cast<double>(masked_right) / masked : 0.0; }
  DenoisingSample sample;  // the first whole sentence (else the first), as text
};
DenoisingAccuracy denoising_accuracy(BartForConditionalGeneration& model, const PackedExamples::Split& validation,
                                     int64_t count, int64_t max_len, const NoiseOptions& noise,
                                     const ByteLevelBpe& tokenizer, torch::Device device = torch::kCPU,
                                     int64_t batch = 16);

// Per element of `a`: whether a longest common subsequence of `a` and `b`
// pairs it with an equal element of `b` (dynamic programming, |a|·|b|).
std::vector<char> aligned_in(const std::vector<int64_t>& a, const std::vector<int64_t>& b);

}  // namespace bart
