// cost_model.h — what a training step costs under each sharding strategy, from
// the model's size, the cluster's links and the compute per token.
//
// Pure functions, no LibTorch and no communication: `zeroshard-plan` prints
// their predictions, the tests check them against closed forms, and the
// benches compare them with measured steps.
//
// Links: an α-β model per link class (inside a host, between hosts): moving
// `bytes` over one link takes α + bytes / bandwidth. Collectives are rings in
// host order (what the TCP transport runs from 2 MiB slices and NCCL runs
// between hosts): an all-gather or reduce-scatter over n ranks sends
// (n - 1)/n of the buffer over every link of the ring, in n - 1 steps; when
// the ring spans hosts each host's link carries one ring edge. Memory: the
// ZeRO model-state formulas of docs/drop-in.md and docs/fully-shard.md.
//
// Thread-safety: plain values.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace zeroshard::plan {

// One class of link: α (seconds per message) and β as a bandwidth (bytes/s, each way).
struct Link {
  double alpha_s = 0;
  double bytes_per_s = 0;
};

struct Cluster {
  int hosts = 1;
  int ranks_per_host = 1;
  Link intra;                  // between two ranks of one host
  Link inter;                  // a host's link to the others (shared by its ranks)
  double flops_per_s = 0;      // what one rank's compute delivers on the model (peak × utilization)
  double seconds_per_token = 0;  // > 0: measured forward + backward seconds per token on one rank (overrides flops_per_s)
  double memory_bytes = 0;     // per rank; 0: unlimited
  // The share of the communication a strategy could hide behind compute that
  // compute does hide, for ZeRO-3's prefetched gathers and for gradient
  // reductions (reduce-scatters, all-reduces, replica averages): 1 where
  // collectives run on their own streams and links (GPUs); fitted for a
  // cluster by bench/plan_validate.sh (CPU hosts, whose cores the
  // communication needs too, hide less).
  double gather_overlap = 1;
  double reduce_overlap = 1;
  int ranks() const { return hosts * ranks_per_host; }
};

// A transformer, as the costs see it.
struct Model {
  std::string name;
  double unit_params = 0;      // parameters in the sharded units (the layers)
  double root_params = 0;      // parameters outside them (embeddings, head, final norms)
  int units = 1;               // layers (ZeRO-3 units)
  int param_bytes = 4;         // 4 fp32, 2 bf16 (then an fp32 master too)
  int64_t d_model = 0;         // for activations and pipeline messages
  int64_t heads = 1;
  int64_t seq_len = 0;
  double params() const { return unit_params + root_params; }
};

struct Strategy {
  int zero_stage = 3;          // 0 (replicated), 1, 2, 3
  int shard_size = 0;          // 0: every data-parallel rank; else ranks per shard group (hybrid)
  int pp = 1;                  // pipeline stages (1F1B)
  int micro_batches = 1;       // per step, per pipeline (or rank): gradient accumulation
  bool activation_checkpointing = false;
  int gather_bytes = 0;        // ZeRO-3 gathers in this many bytes per parameter; 0: param_bytes
  std::string describe() const;
};

struct Step {
  double tokens = 0;           // global tokens per step
};

struct Prediction {
  // Memory per rank, bytes.
  double model_states = 0;     // parameters, gradients, master and moments by the ZeRO formulas
  double working_set = 0;      // ZeRO-3: units gathered at once (the current one and two prefetched; a pipeline stage's all)
  double activations = 0;      // saved for backward (Korthikanti et al.'s per-layer estimate)
  double memory() const { return model_states + working_set + activations; }
  // Bytes per step through each host's link, and each rank's bytes inside its host.
  double inter_host_bytes = 0;
  double intra_host_bytes = 0;
  // Seconds per step.
  double compute_s = 0;        // forward + backward (+ recompute) of this rank's tokens
  double comm_s = 0;           // every collective, as if alone on the links
  double exposed_comm_s = 0;   // what compute does not hide
  double bubble_s = 0;         // pipeline fill and drain
  double step_s = 0;
  bool fits = true;            // memory() <= Cluster::memory_bytes
};

// The ring time of an all-gather (or reduce-scatter) of `bytes` in total over
// `ranks` ranks of which `hosts` hosts hold equal consecutive shares.
double ring_gather_s(const Cluster& c, double bytes, int ranks, int hosts);

Prediction predict(const Model& m, const Cluster& c, const Strategy& s, const Step& step);

// `s` with the fewest micro-batches per step (a power of 2 dividing each
// rank's `sequences`; at least 4 per pipeline stage) with which it fits the
// ranks' memory; the fewest at all when none fits; 0 when no count divides.
Strategy with_micro_batches(const Model& m, const Cluster& c, Strategy s, const Step& step, int64_t sequences);

// Every strategy worth comparing on `c` for a step of `sequences` sequences
// (ZeRO 0-3 flat, ZeRO-1/2/3 sharded per host, pipelines of 2-8 stages over
// ZeRO-1 or 3), with and without activation checkpointing, each with the
// micro-batches with_micro_batches() gives it.
std::vector<Strategy> candidates(const Cluster& c, const Model& m, const Step& step, int64_t sequences);

// Models by name: "bart-base", "bart-large" (Hugging Face's shapes), "7b" (a
// LLaMA-7B-shaped decoder: d 4096, 32 layers, SwiGLU FFN 11008, vocabulary
// 32000, untied head), at `seq_len` tokens per sequence. Throws
// std::invalid_argument naming the known ones.
Model named_model(const std::string& name, int64_t seq_len);
// BART with L encoder and L decoder layers (bench/memory_wall.sh's search).
Model bart(int64_t d_model, int64_t ffn, int64_t heads, int64_t layers, int64_t vocab, int64_t positions, int64_t seq_len);
// A decoder-only transformer of LLaMA's layout (attention 4 d^2, SwiGLU 3 d ffn,
// RMSNorms, untied embedding and head): GPT-like models of a user's own shape.
Model llama(int64_t d_model, int64_t ffn, int64_t heads, int64_t layers, int64_t vocab, int64_t seq_len);

}  // namespace zeroshard::plan
