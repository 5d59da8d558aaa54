// zeroshard/metrics.h — what a training run reports while it runs.
//
//   zeroshard::MetricsOptions mo;
//   mo.tensorboard_dir = run_dir + "/tensorboard";  // the same scalars for TensorBoard ("" for none)
//   zeroshard::MetricsLog metrics(run_dir + "/metrics.jsonl", resumed_step, mo);  // rank 0
//   metrics.write_text("config", resumed_step, "...");  // the run's configuration, in TensorBoard's text tab
//   zeroshard::ProgressLine progress(max_steps);
//   for (...) {
//     ...one step...
//     metrics.write(m);                      // one JSON object per line, flushed
//     progress.update(m);                    // "step 120/400 (30%) | loss 5.214 | ... | ETA 1m58s"
//     zeroshard::publish_step(env, m.step);  // for zeroshard-run (dist_env.h)
//   }
//   zeroshard::plot_metrics(run_dir + "/metrics.jsonl", run_dir + "/loss.png");
//
// The JSON lines are the run's record; the plot is drawn from them with gnuplot, and TensorBoard
// reads the same scalars from its event files while the run goes on. MetricsLog and ProgressLine
// are for one thread (the training loop's). Every field: docs/observability.md.
#pragma once

#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>

namespace zeroshard {

namespace runtime {
class EventFile;
}

// One optimizer step ("all ranks" figures: agreed by a collective the trainer runs; the others
// are this rank's).
struct StepMetrics {
  int64_t step = 0;  // optimizer steps done, this one included (1 = the first)
  double loss = std::numeric_limits<double>::quiet_NaN();       // mean per token, all ranks
  double lr = 0;
  double grad_norm = std::numeric_limits<double>::quiet_NaN();  // global L2, before clipping
  int64_t tokens = 0;              // target tokens of the step, all ranks
  double seconds = 0;              // wall time of the step, data to data
  double compute_seconds = 0;      // forward and backward, less the communication they waited for
  double exposed_comm_seconds = 0; // the training thread blocked on collectives (not hidden by compute)
  double optimizer_seconds = 0;    // step(), less its exposed communication
  double checkpoint_stall_seconds = 0;  // a save's wait in this step (0 without one)
  double other_seconds = 0;        // the rest: data, loss bookkeeping, logging
  int64_t peak_rss_bytes = 0;      // this rank's peak resident memory so far
  int64_t bytes_sent = 0;          // this rank's collective bytes in the step
  double loss_scale = 1;           // dynamic loss scale (1 when off)
  bool skipped = false;            // the update was skipped (gradient overflow)
  std::string extra_json;          // a JSON object whose members join the line; "" for none
  double tokens_per_second() const { return seconds > 0 ? static_cast<double>(tokens) / seconds : 0; }
};

struct MetricsOptions {
  // Where TensorBoard's event files go ("" for none): every number of every line, as a scalar
  // at the line's step and time (a step's fields under their names, an event's under
  // "EVENT/FIELD", an object's members under "NAME/MEMBER"). Each process writes a file of its
  // own there; a resumed run's new file replaces the steps after `resume_step` (one curve).
  // Open it with `tensorboard --logdir DIR`.
  std::string tensorboard_dir;
};

// JSON lines, one object per step (and per event), each flushed as written.
class MetricsLog {
 public:
  MetricsLog();  // disabled: writes nothing
  // Creates `path` (and its directory), or continues it, dropping the lines of steps after
  // `resume_step` (work the resumed run redoes), so the file reads as one run. Throws naming
  // the path (or the TensorBoard directory) when it cannot be written.
  MetricsLog(const std::string& path, int64_t resume_step, const MetricsOptions& options = {});
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;
  MetricsLog(MetricsLog&& other) noexcept;
  MetricsLog& operator=(MetricsLog&& other) noexcept;

  // {"step":…, "loss":…, "lr":…, …, plus extra_json's members}. Flushed.
  void write(const StepMetrics& m);
  // The line write(m) writes: carry it in the checkpoint of m's step, so that the step's record
  // survives a crash between the checkpoint's commit and write() (see restore()).
  static std::string step_line(const StepMetrics& m);
  // The last step with a line in the file: of the lines kept on opening, then
  // of write() and restore(); 0 for none.
  int64_t last_step() const { return last_step_; }
  // Writes a step_line() carried in the checkpoint a run resumed from, with "restored": true,
  // when the file holds no line of that step or a later one; returns whether it wrote.
  // Throws when `line` is not a step_line().
  bool restore(const std::string& line);
  // Any other record: {"event": `event`, "step": step, plus `json_object`'s members}.
  void write_event(const std::string& event, int64_t step, const std::string& json_object = "{}");
  // Text (markdown) for TensorBoard's text tab under `tag` (the run's configuration, say); not a
  // line of the JSON file. Nothing without a TensorBoard directory.
  void write_text(const std::string& tag, int64_t step, const std::string& markdown);
  bool enabled() const { return file_ != nullptr; }
  const std::string& path() const { return path_; }
  // The event file this process writes ("" without one).
  std::string tensorboard_path() const;

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
  int64_t last_step_ = 0;
  std::unique_ptr<runtime::EventFile> tensorboard_;
  void line(const std::string& text);            // to the file, then to_tensorboard()
  void to_tensorboard(const std::string& text);  // a line's numbers, as scalars
};

// A one-line progress report, logged on rank 0 at most every `interval_s` seconds and at the
// last step. Rates and the ETA count from this process's first update().
class ProgressLine {
 public:
  explicit ProgressLine(int64_t total_steps, double interval_s = 10.0);
  // Returns whether it printed.
  bool update(const StepMetrics& m, const std::string& extra = "");
  // "1h02m", "3m05s", "12s"
  static std::string duration(double seconds);
  // 1234567 -> "1,234,567" (progress lines, run summaries).
  static std::string with_commas(int64_t v);

 private:
  int64_t total_;
  double interval_s_;
  int64_t first_step_ = -1;
  double start_ = 0, last_print_ = -1e300;
  int64_t tokens_ = 0;
};

// Now, as Unix time from the system clock in seconds (to the microsecond): the "time" of every
// metrics line.
double unix_time();

// This process's peak and current resident memory (VmHWM, VmRSS); 0 where /proc is absent.
int64_t peak_rss_bytes();
int64_t current_rss_bytes();
// Bytes malloc has handed out and not taken back, every arena and mapping
// (glibc's mallinfo2): what LibTorch's CPU tensors hold, unlike the resident
// set, which keeps freed pages. 0 where the C library does not say.
int64_t heap_bytes_in_use();

// Draws the loss curve of a metrics file (train loss, and validation loss where lines carry
// "val_loss") into a PNG with gnuplot, marking its "checkpoint", "durable", "interruption" and
// "resume" events. Returns "" on success, else why not (no gnuplot on PATH, no steps in the
// file, gnuplot's error).
std::string plot_metrics(const std::string& metrics_path, const std::string& png_path,
                         const std::string& title = "training loss");

}  // namespace zeroshard
