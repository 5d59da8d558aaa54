// run.cpp — what a run needs besides its training (pretraining.cpp): the
// tokenizer (given, or trained by rank 0), the model's config, and the
// train-tokenizer and encode commands.
#include "train/run.h"

#include "data/prepare.h"
#include "tokenizer/tokenizer.h"

#include <zeroshard/comm.h>
#include <zeroshard/log.h>
#include <zeroshard/token_store.h>

#include <c10/util/StringUtil.h>
#include <nlohmann/json.hpp>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <atomic>
#include <exception>
#include <functional>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <thread>

#include <signal.h>
#include <unistd.h>

namespace bart {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

// What a prepare of this host that was killed (its process gone) left: DATASET.partial.HOST.PID,
// removed, with one line each. Other hosts' are theirs to remove (their processes cannot be asked).
void remove_killed_prepares(const std::string& dataset, const std::string& host) {
  const std::string prefix = fs::path(dataset).filename().string() + ".partial." + host + ".";
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(fs::path(dataset).parent_path(), ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    const std::string digits = name.substr(prefix.size());
    char* end = nullptr;
    const long pid = std::strtol(digits.c_str(), &end, 10);
    if (digits.empty() || *end != '\0' || pid <= 0) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;  // alive, or not ours to ask
    std::error_code removed;
    fs::remove_all(entry.path(), removed);
    if (!removed) {
      zeroshard::log_info("data: removed '" + entry.path().string() + "', left by a prepare (pid " +
                          std::to_string(pid) + ") that did not finish");
    }
  }
}

// Runs `job` (when this rank has one) on a thread while every rank takes part
// in a small all-reduce of how many jobs are still running, a few milliseconds
// apart at first and a second apart later, until none is. A job may take long
// (rank 0 training a tokenizer, a host preparing its data), yet no collective
// waits on it, so the communicator's timeout still finds a rank that died.
// Returns this rank's job's error, if any.
std::exception_ptr run_while_ranks_wait(zeroshard::Communicator& comm, const std::function<void()>& job) {
  std::atomic<bool> running{static_cast<bool>(job)};
  std::exception_ptr error;
  std::thread worker;
  if (job) {
    worker = std::thread([&] {
      try {
        job();
      } catch (const std::exception&) {
        error = std::current_exception();
      }
      running = false;
    });
  }
  auto pause = std::chrono::milliseconds(2);
  try {
    for (;;) {
      auto busy = torch::tensor({running ? 1.0 : 0.0}, torch::kDouble);
      comm.all_reduce(busy, zeroshard::ReduceOp::kSum)->wait();
      if (busy.item<double>() == 0) break;
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(1000));
    }
  } catch (...) {  // a rank is gone: this one's job ends first (it holds references to the caller's state)
    if (worker.joinable()) worker.join();
    throw;
  }
  if (worker.joinable()) worker.join();
  return error;
}

}  // namespace

// Rank 0 alone touches the tokenizer's files: it reads --tokenizer, or the run's own
// tokenizer, or trains one into the run directory, and sends both files' contents to every
// rank. No rank reads another host's disk, so hosts need no shared filesystem.
ByteLevelBpe obtain_tokenizer(const RunOptions& o, zeroshard::Communicator& comm, std::string& vocab,
                              std::string& merges) {
  const bool given = !o.tokenizer_dir.empty(), from_dataset = !given && !o.dataset.empty();
  const std::string dir = given          ? o.tokenizer_dir
                          : from_dataset ? (fs::path(o.dataset) / "tokenizer").string()
                                         : (fs::path(o.run_dir) / "tokenizer").string();
  std::function<void()> job;
  if (comm.rank() == 0) {
    job = [&] {
      TORCH_CHECK_VALUE(!given || fs::exists(tokenizer_files_in(dir)), "--tokenizer '", dir,
                        "' has no vocab.json; give a directory with vocab.json and merges.txt, or leave --tokenizer "
                        "out to train one from --data");
      TORCH_CHECK_VALUE(!from_dataset || fs::exists(tokenizer_files_in(dir)), "--dataset '", o.dataset,
                        "' holds no tokenizer (a store prepared by other tools): give its vocabulary with --tokenizer");
      if (!given && !from_dataset && !fs::exists(tokenizer_files_in(dir))) {
        TokenizerTrainingOptions t;
        t.data = {o.data};
        t.json_key = o.json_key;
        t.skip_bad_lines = o.skip_bad_lines;
        t.vocab_size = o.vocab_size;
        t.sample_mb = o.tokenizer_sample_mb;
        t.out = dir;
        train_tokenizer_command(t);
      }
      for (auto [file, out] : {std::pair{"vocab.json", &vocab}, std::pair{"merges.txt", &merges}}) {
        std::ifstream in(fs::path(dir) / file);
        TORCH_CHECK_VALUE(in, "tokenizer: cannot read '", (fs::path(dir) / file).string(), "'");
        out->assign(std::istreambuf_iterator<char>(in), {});
      }
    };
  }
  // The others wait while rank 0 trains, however long that takes.
  const std::exception_ptr error = run_while_ranks_wait(comm, job);
  const bool failed = !zeroshard::failed_ranks(comm, error != nullptr).empty();
  if (error) std::rethrow_exception(error);
  TORCH_CHECK(!failed, "tokenizer: rank 0 could not provide it (its output says why)");
  vocab = zeroshard::broadcast_text(comm, vocab, 0);
  merges = zeroshard::broadcast_text(comm, merges, 0);
  try {
    return ByteLevelBpe::parse(vocab, merges, (fs::path(dir) / "vocab.json").string(),
                               (fs::path(dir) / "merges.txt").string());
  } catch (const c10::Error& e) {
    // Rank 0 read the files and every rank parses them: each names the option it came from.
    TORCH_CHECK_VALUE(false, given ? "--tokenizer: " : "the run's tokenizer (delete it to train one again): ",
                      e.what_without_backtrace());
  }
}

std::string obtain_dataset(const RunOptions& o, const std::string& vocab, const std::string& merges, int local_rank,
                           zeroshard::Communicator& comm) {
  const bool prepared_here = o.dataset.empty();
  const std::string dataset = prepared_here ? (fs::path(o.run_dir) / "dataset").string() : o.dataset;
  const std::string hash = tokenizer_hash(vocab, merges);
  const auto manifest_path = fs::path(dataset) / "manifest.json";
  std::function<void()> job;
  if (prepared_here && local_rank == 0) {  // each host's local rank 0 prepares, while the others wait
    job = [&] {
      if (fs::exists(manifest_path)) {  // a restart, or a run directory used again
        const auto m = read_manifest(dataset);
        TORCH_CHECK_VALUE(m.at("sources") == corpus_sources({o.data}), "'", dataset, "' was prepared from other "
                          "text than --data '", o.data, "' holds now; delete it to prepare it again, or give another "
                          "--run-dir");
        return;
      }
      // Hosts that share the run directory's filesystem each prepare; the first rename wins.
      char host[256] = {};
      ::gethostname(host, sizeof(host) - 1);
      remove_killed_prepares(dataset, host);
      PrepareOptions po;
      po.data = {o.data};
      po.json_key = o.json_key;
      po.skip_bad_lines = o.skip_bad_lines;
      po.tokenizer_dir = (fs::path(o.run_dir) / "tokenizer").string();
      po.vocab_json = vocab;
      po.merges_txt = merges;
      po.out = dataset;
      po.partial = dataset + ".partial." + host + "." + std::to_string(::getpid());
      try {
        const auto r = prepare_dataset(po);
        char msg[200];
        std::snprintf(msg, sizeof(msg), "data: --data prepared in %.1f s (%lld tokens) into ", r.seconds,
                      static_cast<long long>(r.tokens));
        zeroshard::log_info(msg + dataset);
      } catch (const std::exception&) {
        if (!fs::exists(manifest_path)) throw;
        fs::remove_all(po.partial);  // another host's rank prepared it first
      }
    };
  }
  std::exception_ptr error = run_while_ranks_wait(comm, job);
  try {
    if (!error && fs::exists(manifest_path)) {
      const auto m = read_manifest(dataset);
      const std::string theirs = m.at("tokenizer").at("xxh3").get<std::string>();
      TORCH_CHECK_VALUE(theirs == hash, "dataset '", dataset, "' was prepared with another tokenizer (xxh3 ", theirs,
                        ") than this run's (", hash, "); train with the tokenizer it was prepared with (leave out "
                        "--tokenizer: the dataset's own), or prepare the dataset again with this one");
    }
  } catch (const std::exception&) {
    error = std::current_exception();
  }
  // Every rank holds the same store: its index's size and first bytes' hash, against rank 0's.
  std::string mine = "-";
  if (!error) {
    try {
      const zeroshard::TokenStore store(store_prefix(dataset));
      mine = std::to_string(store.sequences()) + "/" + std::to_string(store.documents()) + "/" +
             std::to_string(store.tokens());
      if (fs::exists(manifest_path)) mine += "/" + read_manifest(dataset).at("files").at("tokens.idx").at("xxh3").get<std::string>();
    } catch (const std::exception&) {
      error = std::current_exception();
    }
  }
  const auto failed = zeroshard::failed_ranks(comm, error != nullptr);
  if (error) std::rethrow_exception(error);
  TORCH_CHECK(failed.empty(), "data: rank(s) ", c10::Join(", ", failed), " could not open the dataset (their output says why)");
  const std::string rank0 = zeroshard::broadcast_text(comm, mine, 0);
  const auto differ = zeroshard::failed_ranks(comm, rank0 != mine);
  TORCH_CHECK_VALUE(differ.empty(), "data: the ranks hold different datasets at '", dataset,
                    "' (rank 0: sequences/documents/tokens/index xxh3 ", rank0, ", rank ", comm.rank(), ": ", mine,
                    "); give every host the same copy");
  return dataset;
}

BartConfig run_config(const RunOptions& o, const ByteLevelBpe& tokenizer) {
  auto config = BartConfig::named(o.config);
  config.vocab_size = tokenizer.vocab_size();
  config.pad_token_id = tokenizer.pad_id();
  config.bos_token_id = tokenizer.id("<s>");
  config.eos_token_id = config.decoder_start_token_id = tokenizer.id("</s>");
  config.max_position_embeddings = std::max(config.max_position_embeddings, o.max_tokens + 16);
  if (o.dropout >= 0) config.dropout = config.attention_dropout = config.activation_dropout = o.dropout;
  return config;
}

int encode_command(const std::string& tokenizer_dir) {
  TORCH_CHECK_VALUE(fs::exists(tokenizer_files_in(tokenizer_dir)), "encode: --tokenizer '", tokenizer_dir,
                    "' has no vocab.json; give a directory with vocab.json and merges.txt");
  const auto tokenizer = load_tokenizer(tokenizer_dir);
  ByteLevelBpe::Cache cache;
  std::string line;
  for (int64_t n = 1; std::getline(std::cin, line); ++n) {
    const json text = json::parse(line, nullptr, /*allow_exceptions=*/false);
    TORCH_CHECK_VALUE(text.is_string(), "encode: input line ", n, " is not a JSON string; give one per line, "
                      "e.g. \"it's 10\\u00b5m\"");
    std::cout << json(tokenizer.encode(text.get<std::string>(), cache)).dump() << '\n';
  }
  std::cout.flush();
  TORCH_CHECK(std::cout.good(), "encode: writing the ids failed");
  return 0;
}

}  // namespace bart
