// bart_pretrain: BART denoising pretraining on zeroshard.
//
//   zeroshard-run --nproc-per-node 4 --max-restarts 3 -- bart_pretrain --config base --data DIR
//       --run-dir runs/base --stage 3 --global-batch 64 --micro-batches 4 --max-steps 20000
//   bart_pretrain train-tokenizer --data DIR --vocab-size 8000 --out tokenizer/
//   bart_pretrain encode --tokenizer tokenizer/ < texts.jsonl   (ids per line)
//
// Every rank reads the corpus, noises its share of each global batch (the
// noise depends only on the example and epoch, so any world size sees the same
// batch), and trains with ZeRO stage 1/2 (ShardedAdamW), 3 (fully_shard +
// FullyShardedAdamW) or 0 (ShardedAdamW replicating everything, as DDP).
// The run directory holds the tokenizer, the checkpoints,
// metrics.jsonl, loss.png and (with --trace) trace-rank-N.json. Run again with
// the same --run-dir and it resumes from the last checkpoint; SIGTERM (a spot
// notice) makes every rank stop after the same step, save and exit with 75,
// which zeroshard-run answers with a restart. Also runs alone (1 rank) or
// under torchrun. This file is part of the zs_bart library (it compiles in the
// library's unity unit); main.cpp is the program.
#include "data/prepare.h"
#include "data/training_data.h"
#include "train/run.h"

#include "model/bart_model.h"

#include <zeroshard/log.h>
#include <zeroshard/lr_schedule.h>

#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdlib>
#include <exception>
#include <filesystem>

namespace bart {

void check_options(const RunOptions& o) {
  // "--name value: must be ..." for the first option out of range.
  const auto need = [](bool ok, const char* name, const auto& value, const char* what) {
    TORCH_CHECK_VALUE(ok, name, " ", value, ": must be ", what);
  };
  for (const auto& [path, weight] : o.dataset.empty() ? decltype(parse_datasets("")){} : parse_datasets(o.dataset)) {
    need(std::filesystem::exists(path) || std::filesystem::exists(path + ".idx"), "--dataset", "'" + path + "'",
         "a dataset directory (bart_pretrain prepare writes one) or a token store's prefix (PREFIX.idx and "
         "PREFIX.bin); several blend as A:0.7,B:0.3");
  }
  need(!o.dataset.empty() || std::filesystem::exists(o.data), "--data", "'" + o.data + "'",
       "a directory or file of text or JSON lines (or give a prepared dataset with --dataset)");
  try {
    (void)BartConfig::named(o.config);  // names the config it cannot read, and where
  } catch (const c10::Error& e) {
    TORCH_CHECK_VALUE(false, "--config: ", e.what_without_backtrace());
  }
  need(o.vocab_size >= 262 && o.vocab_size <= (int64_t{1} << 31), "--vocab-size", o.vocab_size,
       "at least 262 (the 5 specials, 256 bytes and a merge) and below 2^31");
  need(o.max_tokens >= 8, "--max-tokens", o.max_tokens, "at least 8 (bos, eos and some text)");
  need(o.validation_docs >= 0, "--validation-docs", o.validation_docs,
       "0 (the default: the validation set is a share of the tokens, --validation-tokens) or more");
  need(o.validation_tokens >= 0, "--validation-tokens", o.validation_tokens,
       "0 (the default: 1% of the dataset's tokens, at least 20,000 or 5%, at most 1,000,000) or more");
  need(o.validation_docs == 0 || o.validation_tokens == 0, "--validation-docs", o.validation_docs,
       "0 with --validation-tokens: give one of the two");
  need(o.global_batch >= 1, "--global-batch", o.global_batch, "at least 1");
  need(o.micro_batches >= 1, "--micro-batches", o.micro_batches, "at least 1");
  need(o.max_steps >= 1, "--max-steps", o.max_steps, "at least 1");
  need(std::isfinite(o.lr) && o.lr > 0, "--lr", o.lr, "a positive number (the peak learning rate)");
  (void)zeroshard::LrSchedule::parse_kind(o.schedule);  // names the kinds
  need(o.warmup_steps >= 0, "--warmup-steps", o.warmup_steps, "0 or more");
  need(o.min_lr_ratio >= 0 && o.min_lr_ratio <= 1, "--min-lr-ratio", o.min_lr_ratio, "between 0 and 1");
  need(std::isfinite(o.weight_decay) && o.weight_decay >= 0, "--weight-decay", o.weight_decay, "0 or more");
  need(o.beta2 > 0 && o.beta2 < 1, "--beta2", o.beta2, "between 0 and 1, both excluded");
  need(std::isfinite(o.max_grad_norm) && o.max_grad_norm >= 0, "--max-grad-norm", o.max_grad_norm,
       "0 (no clipping) or more");
  need(std::isfinite(o.reference_batch) && o.reference_batch > 0, "--reference-batch", o.reference_batch,
       "a positive number of sequences (statistical efficiency is relative to it)");
  need(o.noise_smoothing >= 0 && o.noise_smoothing < 1, "--noise-smoothing", o.noise_smoothing,
       "in [0, 1) (the moving averages' weight of the past)");
  need(o.dropout == -1 || (o.dropout >= 0 && o.dropout < 1), "--dropout", o.dropout, "in [0, 1)");
  need(o.stage >= 0 && o.stage <= 3, "--stage", o.stage, "0, 1, 2 or 3");
  need(o.shard_size == "host" || (!o.shard_size.empty() && o.shard_size.find_first_not_of("0123456789") ==
                                  std::string::npos && o.shard_size.size() < 6),
       "--shard-size", "'" + o.shard_size + "'", "0 (every data-parallel rank), host, or a number of ranks");
  need(o.gather_dtype == "fp32" || o.gather_dtype == "bf16" || o.gather_dtype == "int8", "--gather-dtype",
       "'" + o.gather_dtype + "'", "fp32, bf16 or int8");
  need(o.gather_dtype == "fp32" || o.stage == 3, "--gather-dtype", o.gather_dtype,
       "fp32 below --stage 3 (only ZeRO-3 gathers parameters in forward and backward)");
  need(!o.activation_checkpointing || o.pp == 1, "--activation-checkpointing with --pp", o.pp,
       "1: pipeline stages do not recompute their layers yet");
  need(o.stage != 0 || o.shard_size == "0", "--shard-size", o.shard_size,
       "0 at --stage 0, which shards nothing (hybrid sharding needs stage 1, 2 or 3)");
  need(o.device_comm == "auto" || o.device_comm == "nccl" || o.device_comm == "staged", "--device-comm",
       "'" + o.device_comm + "'", "auto, nccl or staged");
  need(std::isfinite(o.liveness) && o.liveness >= 1, "--liveness", o.liveness,
       "at least 1 second (more than moving 512 KiB over the slowest link takes)");
  need(o.replica_group.empty() == o.coordinator.empty(), "--replica-group",
       "'" + o.replica_group + "' with --coordinator '" + o.coordinator + "'",
       "both given (a group and where the groups meet) or neither");
  need(o.replica_group.empty() || o.pp == 1, "--replica-group with --pp", o.pp,
       "1: pipeline stages do not train in replica groups yet");
  need(o.replica_group.empty() || o.device == "cpu", "--replica-group with --device", o.device,
       "cpu: the groups' communicator moves host memory (GPU groups are not supported yet)");
  need(o.replica_group.empty() || o.shard_size == "0", "--replica-group with --shard-size", o.shard_size,
       "0: the other groups are the shards' replicas (no hybrid sharding inside a group)");
  need(o.save_every >= 1, "--save-every", o.save_every, "at least 1");
  need(o.crash_after_save == 0 || (o.crash_after_save > 0 && o.crash_after_save % o.save_every == 0 &&
                                   o.crash_after_save <= o.max_steps),
       "--crash-after-save", o.crash_after_save, "0 (off), or a step that saves (a multiple of --save-every, at "
       "most --max-steps)");
  need(std::isfinite(o.grace_period) && o.grace_period > 0, "--grace-period", o.grace_period, "a number of seconds above 0");
  need(o.keep >= 2, "--keep", o.keep, "at least 2 (a crash while replacing one checkpoint leaves the other)");
  need(o.eval_every >= 0, "--eval-every", o.eval_every, "0 (only at the start and the end) or more");
  need(o.eval_batch >= 1, "--eval-batch", o.eval_batch, "at least 1");
  need(o.eval_iters >= 0, "--eval-iters", o.eval_iters, "0 (automatic) or more");
  need(o.noise.mask_ratio >= 0 && o.noise.mask_ratio < 1, "--mask-ratio", o.noise.mask_ratio, "in [0, 1)");
  need(o.noise.poisson_lambda > 0 && std::isfinite(o.noise.poisson_lambda), "--poisson-lambda",
       o.noise.poisson_lambda, "a positive number (the mean masked span length)");
  need(o.sample_sentences >= 1, "--sample-sentences", o.sample_sentences, "at least 1 (or --no-sample)");
  need(o.progress_interval > 0, "--progress-interval", o.progress_interval, "a positive number of seconds");
  need(o.pp >= 1, "--pp", o.pp, "at least 1");
  need(o.loader_threads >= 0, "--loader-threads", o.loader_threads, "0 or more");
  need(o.prefetch >= 1, "--prefetch", o.prefetch, "at least 1");
  need(o.chunks >= 1, "--chunks", o.chunks, "at least 1");
  need(!o.partition.empty(), "--partition", "''", "uniform, balanced, timed or a layout");
}

}  // namespace bart

namespace {

// The subcommands' options and what they parsed into.
struct Subcommands {
  CLI::App *tok = nullptr, *enc = nullptr, *prep = nullptr, *merge = nullptr, *insp = nullptr, *hf = nullptr;
  bart::TokenizerTrainingOptions to;
  bart::PrepareOptions po;
  std::vector<std::string> merge_parts;
  std::string merge_out;
  std::string insp_dataset, insp_range;
  bool insp_verify = false;
  std::string hf_out;
  int64_t hf_step = -1;
};

// How JSON lines are read: for prepare, train-tokenizer and a run that prepares --data.
void add_json_options(CLI::App* app, std::string& json_key, bool& skip_bad_lines) {
  app->add_option("--json-key", json_key, "JSON lines (.jsonl, .json, .ndjson; .gz, .zst): the field that holds "
                                          "each line's text")->capture_default_str();
  app->add_flag("--skip-bad-lines", skip_bad_lines, "JSON lines: skip a malformed line (not JSON, no string under "
                                                    "--json-key) and count it, instead of stopping at it");
}

void add_subcommands(CLI::App& app, bart::RunOptions& o, Subcommands& c) {
  c.tok = app.add_subcommand("train-tokenizer", "learn a byte-level BPE vocabulary from a text directory");
  c.to.data = {o.data};
  c.to.out = "tokenizer";
  c.tok->add_option("--data", c.to.data, "directories (read recursively) or files: text or JSON lines, plain or "
                                        ".gz/.zst")->capture_default_str();
  add_json_options(c.tok, c.to.json_key, c.to.skip_bad_lines);
  c.tok->add_option("--vocab-size", c.to.vocab_size, "entries, specials and the 256 bytes included")->capture_default_str();
  c.tok->add_option("--sample-mb", c.to.sample_mb, "learn from this many MB of the text, in windows spread evenly over "
                                               "it (all of it when it holds less)")->capture_default_str();
  c.tok->add_option("--workers", c.to.workers, "counting threads (default: every core)");
  c.tok->add_option("--document-separator", c.to.document_separator,
                  "a line of this text ends a document and is dropped, as prepare's");
  c.tok->add_option("--out", c.to.out, "writes vocab.json, merges.txt and training.json here")->capture_default_str();
  c.tok->add_option("--chunk-bytes", c.to.chunk_bytes, "text per counting task, and per window of the sample")
      ->capture_default_str();

  c.enc = app.add_subcommand("encode", "tokenize text: one JSON string per line on stdin -> its ids, a JSON "
                                          "array per line on stdout");
  c.enc->add_option("--tokenizer", o.tokenizer_dir, "directory with vocab.json + merges.txt")->required();

  c.prep = app.add_subcommand("prepare", "a text corpus, once, into a dataset directory training maps (a "
                                             "Megatron-LM indexed token store, the tokenizer, a manifest)");
  c.prep->add_option("--data", c.po.data, "directories (read recursively) or files: text (a document per file) or "
                                         "JSON lines (a document per line), plain or .gz/.zst")->required();
  add_json_options(c.prep, c.po.json_key, c.po.skip_bad_lines);
  c.prep->add_option("--tokenizer", c.po.tokenizer_dir, "directory with vocab.json + merges.txt")->required();
  c.prep->add_option("--out", c.po.out, "the dataset directory to write (must not exist)")->required();
  c.prep->add_option("--workers", c.po.workers, "tokenizing threads (default: every core)");
  c.prep->add_option("--document-separator", c.po.document_separator,
                   "a line of this text ends a document and is dropped (fortune's %); default: a document per file");
  c.prep->add_option("--chunk-bytes", c.po.chunk_bytes, "text per tokenizing task, cut where a sentence ends")
      ->capture_default_str();

  c.merge = app.add_subcommand("merge", "datasets prepared in parts (on several hosts) into one");
  c.merge->add_option("parts", c.merge_parts, "the prepared dataset directories, in order")->required();
  c.merge->add_option("--out", c.merge_out, "the dataset directory to write (must not exist)")->required();

  c.insp = app.add_subcommand("inspect", "a token store's counts as JSON; with --sequences, those sequences' "
                                             "ids, a JSON array per line");
  c.insp->add_option("--dataset", c.insp_dataset, "a prepared dataset directory, or a store's prefix (PREFIX.idx, "
                                              "PREFIX.bin: Megatron's)")->required();
  c.insp->add_option("--sequences", c.insp_range, "FIRST:END, the sequences to print");
  c.insp->add_flag("--verify", c.insp_verify, "read the whole index and both files' checksums (against the manifest)");

  c.hf = app.add_subcommand("export-hf", "write a run's checkpoint as a Hugging Face directory (config.json, "
                                            "model.safetensors, tokenizer): from_pretrained loads it as is");
  c.hf->add_option("--out", c.hf_out, "the directory to write")->required();
  c.hf->add_option("--step", c.hf_step, "the checkpoint's step (default: the latest committed)");
  // The run's options export-hf reads, also after the subcommand (as a user types them).
  c.hf->add_option("--run-dir", o.run_dir, "the run: its tokenizer/ and checkpoints/")->capture_default_str();
  c.hf->add_option("--ckpt-dir", o.ckpt_dir, "checkpoints (default RUN_DIR/checkpoints)");
  c.hf->add_option("--tokenizer", o.tokenizer_dir, "directory with vocab.json + merges.txt (default RUN_DIR/tokenizer)");
  c.hf->add_option("--config", o.config, "the run's --config: tiny, base, large, or a config.json")->capture_default_str();
  c.hf->add_option("--max-tokens", o.max_tokens, "the run's --max-tokens")->capture_default_str();

}

// Training: the model, the data, the batch and the pipeline.
void add_data_options(CLI::App& app, bart::RunOptions& o) {
  app.add_option("--config", o.config, "tiny, base, large, or a Hugging Face config.json")->capture_default_str();
  app.add_option("--dataset", o.dataset, "a dataset directory bart_pretrain prepare wrote (or a token store's "
                                         "prefix, PREFIX.idx + PREFIX.bin, with --tokenizer), or several blended by "
                                         "weight: A:0.7,B:0.3; every host needs a copy");
  app.add_option("--data", o.data, "without --dataset: a directory or file of text or JSON lines (as prepare "
                                   "reads), prepared into RUN_DIR/dataset first (each host's local rank 0 prepares "
                                   "its own copy)")->capture_default_str();
  add_json_options(&app, o.json_key, o.skip_bad_lines);
  app.add_option("--run-dir", o.run_dir, "tokenizer, checkpoints, metrics, plots, traces")->capture_default_str();
  app.add_option("--tokenizer", o.tokenizer_dir,
                 "directory with vocab.json + merges.txt (a real BART vocabulary works); default: "
                 "RUN_DIR/tokenizer, trained from --data when missing");
  app.add_option("--vocab-size", o.vocab_size, "size of a vocabulary trained from --data")->capture_default_str();
  app.add_option("--sample-mb", o.tokenizer_sample_mb, "MB of --data a vocabulary trained by the run learns from")
      ->capture_default_str();
  app.add_option("--max-tokens", o.max_tokens, "tokens per example, bos/eos included")->capture_default_str();
  app.add_option("--validation-tokens", o.validation_tokens, "about this many tokens held out for validation: whole "
                 "documents spread over the dataset, or spans within documents when they are few (0: 1% of the "
                 "tokens, at least 20,000 or 5%, at most 1,000,000)")->capture_default_str();
  app.add_option("--validation-docs", o.validation_docs, "instead: this many whole documents held out, spread evenly "
                                                         "over the dataset (at most half of them)")
      ->capture_default_str();
  app.add_option("--global-batch", o.global_batch, "examples per optimizer step, all ranks")->capture_default_str();
  app.add_option("--micro-batches", o.micro_batches,
                 "gradient accumulation: forward/backward passes per step and rank (with --pp: the pipeline's "
                 "microbatches per step and data-parallel rank)")
      ->capture_default_str();
  app.add_option("--pp", o.pp, "pipeline stages: the ranks form pp x dp (rank = stage * dp + d); 1: no pipeline")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--schedule-pp", o.schedule_pp, "pipeline schedule: gpipe, 1f1b, or interleaved-1f1b (with --chunks)")
      ->check(CLI::IsMember({"gpipe", "1f1b", "interleaved-1f1b"}))
      ->capture_default_str();
  app.add_option("--pp-gather", o.pp_gather,
                 "with --stage 3: gather each stage's parameters once per step (step; memory for speed) or for "
                 "every forward and backward pass (pass)")
      ->check(CLI::IsMember({"step", "pass"}))
      ->capture_default_str();
  app.add_option("--chunks", o.chunks, "interleaved-1f1b: stages per pipeline rank (2 or more)")->capture_default_str();
  app.add_option("--partition", o.partition,
                 "blocks per stage: uniform, balanced (by parameters), timed (by each kind of block's measured "
                 "forward + backward time), or a layout of the blocks E e d L, e.g. 'E e*6 | e*6 d*2 | d*10 L'")
      ->capture_default_str();
}

// Training: the schedule, the optimizer, the sharding, the devices.
void add_optimizer_options(CLI::App& app, bart::RunOptions& o) {
  app.add_option("--max-steps", o.max_steps, "optimizer steps of the whole run")->capture_default_str();
  app.add_option("--lr", o.lr, "peak learning rate")->capture_default_str();
  app.add_option("--schedule", o.schedule, "constant, inverse-sqrt or cosine (after linear warmup)")
      ->capture_default_str();
  app.add_option("--warmup-steps", o.warmup_steps, "linear warmup")->capture_default_str();
  app.add_option("--min-lr-ratio", o.min_lr_ratio, "cosine: final lr / peak")->capture_default_str();
  app.add_option("--weight-decay", o.weight_decay, "AdamW weight decay")->capture_default_str();
  app.add_option("--beta2", o.beta2, "AdamW beta2 (BART: 0.98)")->capture_default_str();
  app.add_option("--max-grad-norm", o.max_grad_norm, "clip the global gradient norm (0: off)")->capture_default_str();
  app.add_option("--reference-batch", o.reference_batch,
                 "sequences; statistical efficiency E = (noise scale + this) / (noise scale + global batch)")
      ->capture_default_str();
  app.add_option("--noise-smoothing", o.noise_smoothing, "weight of the past in the gradient noise scale's averages")
      ->capture_default_str();
  app.add_option("--dropout", o.dropout, "dropout of every layer (default: the config's)");
  app.add_option("--stage", o.stage, "ZeRO stage: 1 optimizer states, 2 + gradients, 3 + parameters (fully_shard); "
                 "0 shards nothing (DDP-style replication)")
      ->capture_default_str();
  app.add_option("--shard-size", o.shard_size,
                 "hybrid sharding: shard inside groups of this many ranks and replicate across the groups "
                 "(only 1/shard-size of the gradients crosses between groups); 0: every data-parallel rank, "
                 "host: the ranks of one host")
      ->capture_default_str();
  app.add_option("--gather-dtype", o.gather_dtype,
                 "ZeRO-3: the dtype units are all-gathered in; bf16 halves the gather bytes of fp32 units, "
                 "int8 (block-quantized, an fp32 scale per 256 values) quarters them (forward and backward then "
                 "see the rounded parameters; the master stays fp32)")
      ->capture_default_str();
  app.add_flag("--activation-checkpointing", o.activation_checkpointing,
               "keep only each layer's input in forward and recompute the layer in backward (less activation "
               "memory, one more forward of every layer)");
  app.add_option("--precision", o.precision, "fp32, or bf16 (bf16 parameters, fp32 master and AdamW states)")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
  app.add_option("--device", o.device,
                 "cpu, or cuda: rank r trains on cuda:(LOCAL_RANK mod GPUs), with NCCL when every local rank has a "
                 "GPU of its own")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--device-comm", o.device_comm,
                 "with --device cuda, the ranks' collectives: auto (NCCL when every local rank has a GPU of its own, "
                 "else staged through host memory), nccl (always; ranks sharing a GPU need NCCL 2.30's "
                 "NCCL_MULTI_RANK_GPU_ENABLE=1, or a NCCL_HOSTID of their own each), or staged")
      ->capture_default_str();
  app.add_option("--liveness", o.liveness,
                 "seconds a peer may stay silent before its host is taken for dead or cut off: every rank then "
                 "stops, naming it; with --replica-group, also how soon a lost group is seen gone")
      ->capture_default_str();
  if (const char* g = std::getenv("ZS_REPLICA_GROUP")) o.replica_group = g;
  if (const char* c = std::getenv("ZS_COORDINATOR")) o.coordinator = c;
  app.add_option("--replica-group", o.replica_group,
                 "train as this replica group of a job of groups that goes on when a group is lost, and heals it "
                 "from a live group when it returns (each group launched on its own; docs/cluster.md; default: "
                 "ZS_REPLICA_GROUP)");
  app.add_option("--coordinator", o.coordinator,
                 "with --replica-group: the groups' coordinator, etcd://HOST:PORT[,HOST:PORT...] (default: "
                 "ZS_COORDINATOR)");
  app.add_option("--replica-job", o.replica_job, "with --replica-group: the job's name in the coordinator")
      ->capture_default_str();
  app.add_option("--replica-listen", o.replica_listen,
                 "with --replica-group: the address of this host the other groups reach its ranks at")
      ->capture_default_str();
  app.add_option("--replica-alone", o.replica_alone,
                 "with --replica-group, a group alone with no state (no checkpoint) in a job whose lost groups "
                 "trained on: wait for a live group to take the state from, or exit (it never starts over silently)")
      ->check(CLI::IsMember({"wait", "exit"}))
      ->capture_default_str();
}

// Training: checkpoints, evaluation, the data loader, noise, reports.
void add_run_options(CLI::App& app, bart::RunOptions& o, bool& no_permute) {
  app.add_option("--ckpt-dir", o.ckpt_dir,
                 "checkpoints: a directory (default RUN_DIR/checkpoints; 'none': no checkpoints), or s3://BUCKET/PREFIX, "
                 "a durable tier on any S3-compatible store (AWS_* settings; docs/checkpoints.md) with the local copies "
                 "in --ckpt-local-dir");
  app.add_option("--ckpt-local-dir", o.ckpt_local_dir,
                 "with --ckpt-dir s3://...: the local first tier, saved to first and read first (default RUN_DIR/checkpoints)");
  app.add_option("--save-every", o.save_every, "checkpoint every n steps (and at the end)")->capture_default_str();
  app.add_flag("--async-save", o.async_save, "write checkpoints in the background");
  app.add_option("--keep", o.keep, "committed checkpoints kept")->capture_default_str();
  if (const char* g = std::getenv("ZS_GRACE_PERIOD_S")) o.grace_period = std::atof(g);  // zeroshard-run's
  app.add_option("--grace-period", o.grace_period,
                 "seconds a preemption notice leaves to save and exit (default: zeroshard-run's --grace-period, "
                 "else 30)")
      ->capture_default_str();
  app.add_option("--crash-after-save", o.crash_after_save,
                 "for crash tests: rank 0 kills itself (SIGKILL) as soon as the checkpoint of this step has "
                 "committed, before anything else of the step is recorded");
  app.add_option("--eval-every", o.eval_every, "validation loss every n steps (and at start and end)")
      ->capture_default_str();
  app.add_option("--loader-threads", o.loader_threads,
                 "threads building batches ahead of the step (0: the training thread builds each when it needs it)")
      ->capture_default_str();
  app.add_option("--prefetch", o.prefetch, "batches built ahead of the step")->capture_default_str();
  app.add_option("--eval-batch", o.eval_batch, "validation examples per forward pass and rank")->capture_default_str();
  app.add_option("--eval-iters", o.eval_iters,
                 "validation batches per rank in each evaluation during the run, the same examples each time "
                 "(0: about 5% of the training between two evaluations); the end of the run also evaluates the "
                 "whole validation set")->capture_default_str();
  app.add_flag("--eval-full", o.eval_full, "every evaluation on the whole validation set");
  app.add_option("--seed", o.seed, "initialisation, shuffling, noise and dropout")->capture_default_str();
  app.add_option("--mask-ratio", o.noise.mask_ratio, "fraction of tokens in masked spans")->capture_default_str();
  app.add_option("--poisson-lambda", o.noise.poisson_lambda, "mean masked span length")->capture_default_str();
  app.add_flag("--no-permute", no_permute, "keep the sentences of an example in order (no sentence permutation)");
  app.add_option("--progress-interval", o.progress_interval, "seconds between progress lines")->capture_default_str();
  app.add_flag("--keep-denormals", o.keep_denormals,
               "compute with denormal floats (default: flushed to zero, on the CPU 10x faster where they occur)");
  app.add_option("--simd", o.simd, "the AdamW kernel's instruction set: avx512, avx2 or scalar (the same bits; "
                                   "default: the best this CPU has)")
      ->check(CLI::IsMember({"avx512", "avx2", "scalar"}));
  app.add_flag("--trace", o.trace, "write RUN_DIR/trace-rank-N.json (Chrome trace; open in Perfetto)");
  app.add_flag("--no-plot", o.no_plot, "do not draw RUN_DIR/loss.png");
  app.add_option("--straggler-threshold", o.straggler_threshold,
                 "name a rank whose compute, averaged over --straggler-window steps, is this many times the "
                 "other ranks' median, or whose links to other hosts move data this many times slower than the other "
                 "ranks' (a straggler: logged once per episode, a 'straggler' event in metrics.jsonl)")
      ->check(CLI::Range(1.01, 1000.0));
  app.add_option("--straggler-window", o.straggler_window, "steps the straggler rule averages over (0: no rule)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--tensorboard", o.tensorboard_dir,
                 "TensorBoard's event files of the run's metrics (tensorboard --logdir DIR), or 'none' "
                 "(default: RUN_DIR/tensorboard)");
  app.add_flag("--no-sample", o.no_sample, "skip the closing denoising check (greedy reconstruction of held-out sentences)");
  app.add_option("--sample-sentences", o.sample_sentences, "held-out sentences the closing denoising check decodes")
      ->capture_default_str();
  app.add_option("--save-logits", o.save_logits,
                 "at the end, rank 0 writes the logits of the first validation batch here (raw float32, "
                 "for comparing models)");
}

}  // namespace

int bart_pretrain_main(int argc, char** argv) {
  bart::RunOptions o;
  CLI::App app{"bart_pretrain: BART denoising pretraining, sharded with zeroshard (ZeRO-1/2/3)"};
  app.set_help_all_flag("--help-all", "every option, of the subcommands too");
  Subcommands c;
  add_subcommands(app, o, c);
  add_data_options(app, o);
  add_optimizer_options(app, o);
  bool no_permute = false;
  add_run_options(app, o, no_permute);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  o.noise.permute_sentences = !no_permute;
  o.config_text = app.config_to_str(/*default_also=*/true, /*write_description=*/false);
  try {
    if (c.tok->parsed()) return bart::train_tokenizer_command(c.to);
    if (c.enc->parsed()) return bart::encode_command(o.tokenizer_dir);
    if (c.prep->parsed()) return bart::prepare_command(c.po);
    if (c.merge->parsed()) return bart::merge_command(c.merge_parts, c.merge_out);
    if (c.insp->parsed()) return bart::inspect_command(c.insp_dataset, c.insp_range, c.insp_verify);
    if (c.hf->parsed()) return bart::export_hf_command(o, c.hf_out, c.hf_step);
    return bart::run_pretraining(o);
  } catch (const std::exception& e) {  // the message says what to fix; LibTorch's C++ backtrace at debug level
    const std::string message = zeroshard::error_message(e);
    zeroshard::log_error("bart_pretrain: " + message);
    zeroshard::log_debug(std::string("bart_pretrain: ") + e.what());
    try {
      zeroshard::record_error(zeroshard::read_dist_env(), message);  // the launcher's last line repeats it
    } catch (const std::exception&) {  // an environment read_dist_env refuses: the error above is the message
    }
    return 1;
  }
}
