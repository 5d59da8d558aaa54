// run.h — the bart_pretrain program: options, the training run, the summary.
#pragma once

#include "model/bart_model.h"
#include "data/noise.h"
#include "tokenizer/tokenizer.h"

#include <cstdint>
#include <string>
#include <vector>

namespace zeroshard {
class Communicator;
}

namespace bart {

struct RunOptions {
  std::string config = "tiny";
  std::string data = "/usr/share/common-licenses";  // prepared into RUN_DIR/dataset, when --dataset is not given
  std::string json_key = "text";  // --data's JSON lines: the field of the text (PrepareOptions)
  bool skip_bad_lines = false;    // --data's malformed JSON lines skipped and counted (PrepareOptions)
  std::string dataset;  // a prepared dataset directory (bart_pretrain prepare), or a token store's prefix
  std::string run_dir = "bart-run";
  std::string tokenizer_dir;  // "": RUN_DIR/tokenizer, trained when missing
  int64_t vocab_size = 2048;
  double tokenizer_sample_mb = 1000;  // MB of --data a tokenizer trained by the run learns from
  int64_t max_tokens = 128;
  int64_t validation_docs = 0;    // > 0: this many whole documents held out for validation (held_out.h)
  int64_t validation_tokens = 0;  // > 0: about this many tokens held out; 0 (and no documents): about 1%
  int64_t global_batch = 16;
  int64_t micro_batches = 1;
  int pp = 1;                          // pipeline stages; 1: the whole model on every rank
  std::string schedule_pp = "1f1b";    // gpipe, 1f1b, interleaved-1f1b
  int chunks = 1;                      // interleaved-1f1b: stages per pipeline rank
  std::string partition = "uniform";   // uniform, balanced, timed, or a layout string
  std::string pp_gather = "step";      // ZeRO-3 stages: gather once per step, or per pass
  int64_t max_steps = 300;
  double lr = 1e-3;
  std::string schedule = "inverse-sqrt";
  int64_t warmup_steps = 30;
  double min_lr_ratio = 0.1;
  double weight_decay = 0.01;
  double beta2 = 0.98;
  double max_grad_norm = 1.0;
  double dropout = -1;  // < 0: the config's
  double reference_batch = 1;    // sequences: statistical efficiency's reference batch (noise_scale.h)
  double noise_smoothing = 0.95; // the gradient noise scale's moving averages
  int stage = 3;
  std::string shard_size = "0";
  std::string gather_dtype = "fp32";  // ZeRO-3: the dtype units are all-gathered in (fp32 or bf16)
  bool activation_checkpointing = false;  // recompute each layer in backward (without a pipeline)
  std::string precision = "fp32";
  std::string device = "cpu";  // cpu, or cuda (each rank on cuda:LOCAL_RANK modulo the GPUs)
  std::string device_comm = "auto";  // cuda: auto, nccl or staged (zeroshard::DeviceTransport)
  double liveness = 30;  // seconds a peer may stay silent before its host is taken for lost (CommOptions::liveness)
  // Replica groups (zeroshard/replica_groups.h): this launch is one group of a job that trains on when a
  // group is lost. "": off.
  std::string replica_group;  // this group's name
  std::string coordinator;    // etcd://HOST:PORT[,HOST:PORT...]
  std::string replica_job = "bart";
  std::string replica_listen = "127.0.0.1";  // the address the other groups reach this group's ranks at
  std::string replica_alone = "wait";  // alone with no state in a job that trained on: wait for a group, or exit
  std::string ckpt_dir;  // "": RUN_DIR/checkpoints; "none": off; s3://bucket/prefix: the durable tier
  std::string ckpt_local_dir;  // with an s3:// ckpt_dir: the local first tier ("": RUN_DIR/checkpoints)
  int64_t save_every = 100;
  bool async_save = false;
  int64_t crash_after_save = 0;  // > 0: rank 0 SIGKILLs itself once this step's checkpoint has committed (tests)
  int keep = 3;
  // Seconds a preemption notice leaves (PreemptionOptions::grace_period_s): zeroshard-run's
  // --grace-period (ZS_GRACE_PERIOD_S) when launched by it; else 30.
  double grace_period = 30;
  int64_t eval_every = 50;
  int64_t eval_batch = 16;
  // Batches of eval_batch per rank in an evaluation during the run (the same examples each time, spread
  // evenly over each validation set); 0: enough to cost about 5% of the training between two evaluations
  // (15% of eval_every × global_batch examples: a forward pass costs about a third of a training step),
  // at least 1. The end of the run evaluates the whole set too; eval_full: every evaluation does.
  int64_t eval_iters = 0;
  bool eval_full = false;
  int loader_threads = 2;  // threads building batches ahead of the step; 0: on the training thread
  int prefetch = 4;        // batches built ahead
  uint64_t seed = 1;
  NoiseOptions noise;
  double progress_interval = 10;
  bool trace = false;
  // Denormal floats (below 1.2e-38) cost CPUs 10-100x per operation; trained
  // attention makes many (softmax tails). Flushed to zero unless kept.
  bool keep_denormals = false;
  std::string simd;  // the AdamW kernel's instruction set (set_adamw_simd); "": the CPU's best
  bool no_plot = false;
  std::string tensorboard_dir;  // "" for RUN_DIR/tensorboard; "none" for no event files
  double straggler_threshold = 1.3;  // a rank's compute over the median rank's (RankTimesOptions)
  int64_t straggler_window = 50;     // steps; 0: no straggler rule
  std::string config_text;      // the options as parsed (every one, as a config file reads), for TensorBoard's text tab
  bool no_sample = false;
  int64_t sample_sentences = 64;  // held-out sentences the closing denoising check decodes
  std::string save_logits;
};

// Throws, naming the option, its value and what it may be, for any option out
// of range, before a run does any work. run_pretraining calls it first.
void check_options(const RunOptions& o);

// `bart_pretrain train-tokenizer`: learns a vocabulary from o.data into out_dir.

// `bart_pretrain encode --tokenizer DIR`: stdin holds one JSON string per line
// (any text: "\t", "\n", "\u00e9" escapes); stdout gets, per line, the ids of
// its encoding as a JSON array. For comparing the tokenizer with others.
int encode_command(const std::string& tokenizer_dir);

// The run's tokenizer: --tokenizer's, or the dataset's (DATASET/tokenizer), or
// RUN_DIR/tokenizer, which rank 0 trains from --data first when it is not there
// yet. Rank 0 reads the files and sends them to every rank; `vocab` and
// `merges` receive their contents. Collective.
ByteLevelBpe obtain_tokenizer(const RunOptions& o, zeroshard::Communicator& comm, std::string& vocab,
                              std::string& merges);

// The run's dataset: --dataset, or RUN_DIR/dataset, which each host's local rank
// 0 prepares from --data (prepare_dataset) when it is not there yet, while the
// host's other ranks wait for it; one prepared earlier from other text or with
// another tokenizer is refused by name. Then, on every rank, a prepared
// dataset's manifest must name this tokenizer, and every rank must hold the
// same store (its index's checksum, compared with rank 0's). Collective.
std::string obtain_dataset(const RunOptions& o, const std::string& vocab, const std::string& merges, int local_rank,
                           zeroshard::Communicator& comm);

// The model a run trains: the named config with the tokenizer's vocabulary
// and special tokens, room for --max-tokens, and --dropout.
BartConfig run_config(const RunOptions& o, const ByteLevelBpe& tokenizer);

// `bart_pretrain export-hf --out DIR` (export_hf.cpp): the run's last committed checkpoint
// (o.ckpt_dir, or RUN_DIR/checkpoints; `step` -1: the latest) as a directory
// Hugging Face loads as is: config.json, model.safetensors, vocab.json,
// merges.txt, tokenizer_config.json and special_tokens_map.json, so that
// BartForConditionalGeneration.from_pretrained(DIR) and
// BartTokenizer.from_pretrained(DIR) work. The model's config is the run's
// (--config, --max-tokens, --dropout and the tokenizer, as training derives
// it), checked against the checkpoint's shapes. Written beside and renamed.
int export_hf_command(const RunOptions& o, const std::string& out_dir, int64_t step);

// The training run (pretraining.cpp); returns the exit status (kPreemptedExitCode after a
// preemption save). Collective: every rank calls it with the same options.
int run_pretraining(const RunOptions& o);

}  // namespace bart
