// metrics.cpp — JSON-lines metrics, the progress line, memory figures, the
// launcher's progress file and the loss plot.
#include "zeroshard/metrics.h"

#include "runtime/event_file.h"
#include "zeroshard/log.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <malloc.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <stdexcept>
#include <vector>

namespace zeroshard {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// NaN and inf are not JSON: they become null.
json number(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }


void merge(json& into, const std::string& object, const char* what) {
  if (object.empty()) return;
  const json extra = json::parse(object, nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK_VALUE(extra.is_object(), "MetricsLog: ", what, " is not a JSON object: ", object.substr(0, 80));
  for (auto it = extra.begin(); it != extra.end(); ++it) into[it.key()] = it.value();
}

// Every number of a metrics line, as TensorBoard's scalars: its members by name (an object's
// under NAME/MEMBER), after `prefix`; the line's step, time and event name are the event's own.
void scalars_of(const json& j, const std::string& prefix, bool top, std::vector<std::pair<std::string, double>>& out) {
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (top && (it.key() == "step" || it.key() == "time" || it.key() == "event")) continue;
    if (it->is_number()) {
      out.emplace_back(prefix + it.key(), it->get<double>());
    } else if (it->is_object()) {
      scalars_of(*it, prefix + it.key() + "/", false, out);
    }
  }
}

int64_t proc_status_kib(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const size_t n = std::strlen(field);
  while (std::getline(in, line)) {
    if (line.compare(0, n, field) == 0 && line.size() > n && line[n] == ':') return std::atoll(line.c_str() + n + 1);
  }
  return 0;
}

}  // namespace

std::string ProgressLine::with_commas(int64_t v) {
  const std::string digits = std::to_string(v);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && digits[i - 1] != '-' && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

MetricsLog::MetricsLog() = default;

MetricsLog::MetricsLog(const std::string& path, int64_t resume_step, const MetricsOptions& options) : path_(path) {
  std::error_code ec;
  if (fs::path(path).has_parent_path()) fs::create_directories(fs::path(path).parent_path(), ec);
  // Keep what the run logged up to the step it resumes from (and lines that are not JSON
  // objects with a step: none are expected, but nothing is thrown away silently).
  std::vector<std::string> kept;
  int64_t dropped = 0;
  {
    std::ifstream in(path);
    std::string text;
    while (std::getline(in, text)) {
      if (text.empty()) continue;
      const json j = json::parse(text, nullptr, false);
      const bool has_step = j.is_object() && j.contains("step") && j["step"].is_number_integer();
      if (has_step && j["step"].get<int64_t>() > resume_step) {
        ++dropped;
        continue;
      }
      if (has_step && !j.contains("event")) last_step_ = std::max(last_step_, j["step"].get<int64_t>());
      kept.push_back(text);
    }
  }
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    for (const auto& k : kept) out << k << "\n";
    TORCH_CHECK(out, "MetricsLog: cannot write '", tmp, "': ", std::strerror(errno));
  }
  fs::rename(tmp, path, ec);
  TORCH_CHECK(!ec, "MetricsLog: cannot replace '", path, "': ", ec.message());
  file_ = std::fopen(path.c_str(), "a");
  TORCH_CHECK(file_ != nullptr, "MetricsLog: cannot open '", path, "' for appending: ", std::strerror(errno));
  if (!options.tensorboard_dir.empty()) {
    // A new file that replaces the earlier files' steps from `resume_step` on; the kept lines of
    // that step itself go into it again (the file replaced them too).
    tensorboard_ = std::make_unique<runtime::EventFile>(options.tensorboard_dir, resume_step);
    for (const auto& k : kept) {
      const json j = json::parse(k, nullptr, false);
      if (j.is_object() && j.value("step", int64_t{-1}) == resume_step) to_tensorboard(k);
    }
  }
  if (dropped > 0) {
    log_info("metrics: dropped " + std::to_string(dropped) + " lines after step " + std::to_string(resume_step) +
             " from " + path + " (work redone after the resume)");
  }
}

MetricsLog::~MetricsLog() {
  if (file_ != nullptr) std::fclose(file_);
}

MetricsLog::MetricsLog(MetricsLog&& other) noexcept
    : path_(std::move(other.path_)),
      file_(other.file_),
      last_step_(other.last_step_),
      tensorboard_(std::move(other.tensorboard_)) {
  other.file_ = nullptr;
}

MetricsLog& MetricsLog::operator=(MetricsLog&& other) noexcept {
  if (this != &other) {
    if (file_ != nullptr) std::fclose(file_);
    path_ = std::move(other.path_);
    file_ = other.file_;
    last_step_ = other.last_step_;
    tensorboard_ = std::move(other.tensorboard_);
    other.file_ = nullptr;
  }
  return *this;
}

std::string MetricsLog::tensorboard_path() const { return tensorboard_ ? tensorboard_->path() : ""; }

void MetricsLog::to_tensorboard(const std::string& text) {
  if (!tensorboard_) return;
  try {
    const json j = json::parse(text);
    std::vector<std::pair<std::string, double>> values;
    scalars_of(j, j.contains("event") ? j["event"].get<std::string>() + "/" : "", true, values);
    const double time = j.contains("time") && j["time"].is_number() ? j["time"].get<double>() : unix_time();
    tensorboard_->scalars(j.at("step").get<int64_t>(), time, values);
  } catch (const std::exception& e) {  // the run goes on; its JSON lines hold everything
    log_warn("metrics: TensorBoard's event file stops here: " + std::string(e.what()));
    tensorboard_.reset();
  }
}

void MetricsLog::write_text(const std::string& tag, int64_t step, const std::string& markdown) {
  if (!tensorboard_) return;
  try {
    tensorboard_->text(step, unix_time(), tag, markdown);
  } catch (const std::exception& e) {
    log_warn("metrics: TensorBoard's event file stops here: " + std::string(e.what()));
    tensorboard_.reset();
  }
}

double unix_time() {
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(
                      std::chrono::system_clock::now().time_since_epoch())
                      .count();
  return static_cast<double>(us) / 1e6;
}

void MetricsLog::line(const std::string& text) {
  if (file_ == nullptr) return;
  std::fputs(text.c_str(), file_);
  std::fputc('\n', file_);
  std::fflush(file_);
  to_tensorboard(text);
}

void MetricsLog::write(const StepMetrics& m) {
  if (file_ == nullptr) return;
  line(step_line(m));
  last_step_ = std::max(last_step_, m.step);
}

bool MetricsLog::restore(const std::string& text) {
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK_VALUE(j.is_object() && j.contains("step") && j["step"].is_number_integer() && !j.contains("event"),
                    "MetricsLog::restore: not a step's line (MetricsLog::step_line): ", text.substr(0, 80));
  const int64_t step = j["step"].get<int64_t>();
  if (file_ == nullptr || step <= last_step_) return false;
  json restored = j;
  restored["restored"] = true;
  line(restored.dump());
  last_step_ = step;
  return true;
}

std::string MetricsLog::step_line(const StepMetrics& m) {
  json j;
  j["step"] = m.step;
  j["time"] = unix_time();
  j["loss"] = number(m.loss);
  j["lr"] = number(m.lr);
  j["grad_norm"] = number(m.grad_norm);
  j["tokens"] = m.tokens;
  j["tokens_per_s"] = number(m.tokens_per_second());
  j["step_s"] = number(m.seconds);
  j["compute_s"] = number(m.compute_seconds);
  j["exposed_comm_s"] = number(m.exposed_comm_seconds);
  j["optimizer_s"] = number(m.optimizer_seconds);
  j["checkpoint_stall_s"] = number(m.checkpoint_stall_seconds);
  j["other_s"] = number(m.other_seconds);
  j["peak_rss_bytes"] = m.peak_rss_bytes;
  j["bytes_sent"] = m.bytes_sent;
  j["loss_scale"] = number(m.loss_scale);
  if (m.skipped) j["skipped"] = true;
  merge(j, m.extra_json, "StepMetrics::extra_json");
  return j.dump();
}

void MetricsLog::write_event(const std::string& event, int64_t step, const std::string& json_object) {
  if (file_ == nullptr) return;
  json j;
  j["event"] = event;
  j["step"] = step;
  j["time"] = unix_time();
  merge(j, json_object, "the event's JSON");
  line(j.dump());
}

ProgressLine::ProgressLine(int64_t total_steps, double interval_s) : total_(total_steps), interval_s_(interval_s) {}

std::string ProgressLine::duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto s = static_cast<int64_t>(std::llround(seconds));
  char buf[32];
  if (s >= 3600) {
    std::snprintf(buf, sizeof(buf), "%lldh%02lldm", static_cast<long long>(s / 3600), static_cast<long long>(s % 3600 / 60));
  } else if (s >= 60) {
    std::snprintf(buf, sizeof(buf), "%lldm%02llds", static_cast<long long>(s / 60), static_cast<long long>(s % 60));
  } else {
    std::snprintf(buf, sizeof(buf), "%llds", static_cast<long long>(s));
  }
  return buf;
}

bool ProgressLine::update(const StepMetrics& m, const std::string& extra) {
  const double t = now_s();
  if (first_step_ < 0) {  // the first step of this process: rates start after it (it warms up)
    first_step_ = m.step;
    start_ = t;
    tokens_ = 0;
  } else {
    tokens_ += m.tokens;
  }
  const bool last = m.step >= total_;
  if (!last && t - last_print_ < interval_s_) return false;
  last_print_ = t;
  const int64_t done = m.step - first_step_;
  const double elapsed = t - start_;
  const double per_step = done > 0 ? elapsed / static_cast<double>(done) : m.seconds;
  const double tok_s = done > 0 && elapsed > 0 ? static_cast<double>(tokens_) / elapsed : m.tokens_per_second();
  char buf[256];
  std::snprintf(buf, sizeof(buf), "step %lld/%lld (%d%%) | loss %.4f | %s tok/s | %.2f s/step | ETA %s",
                static_cast<long long>(m.step), static_cast<long long>(total_),
                total_ > 0 ? static_cast<int>(100 * m.step / total_) : 100, m.loss,
                with_commas(static_cast<int64_t>(tok_s)).c_str(), per_step,
                duration(per_step * static_cast<double>(total_ - m.step)).c_str());
  log_info(extra.empty() ? std::string(buf) : std::string(buf) + " | " + extra);
  return true;
}

int64_t peak_rss_bytes() { return proc_status_kib("VmHWM") * 1024; }
int64_t current_rss_bytes() { return proc_status_kib("VmRSS") * 1024; }

int64_t heap_bytes_in_use() {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
  const struct mallinfo2 m = mallinfo2();
  return static_cast<int64_t>(m.uordblks + m.hblkhd);  // in-use chunks of every arena, and mmapped blocks
#else
  return 0;
#endif
}

namespace {

// A string as a gnuplot double-quoted string's content.
std::string gnuplot_text(std::string s) {
  for (auto& c : s)
    if (c == '"' || c == '\\' || c == '\n') c = '\'';
  return s;
}

// The plot's marks from the metrics' events: a point on the loss curve where
// a checkpoint was saved, and a vertical line, with its cause, where the run
// was interrupted or restarted.
struct PlotMarks {
  std::map<int64_t, double> loss;        // train loss by step
  std::vector<int64_t> checkpoints;      // steps
  std::vector<int64_t> durable;          // steps committed in a durable tier
  std::map<int64_t, json> interruptions;  // by step: {"cause", ...}
  std::vector<json> resumes;             // {"step", "restart", "after", ["to_first_step_s"]}
  std::vector<json> groups;              // replica groups' changes {"step", "groups", "pause_s", ...}, in order

  // A line per change of the replica groups after the first meeting: (step, label).
  std::vector<std::pair<int64_t, std::string>> group_lines() const {
    std::vector<std::pair<int64_t, std::string>> out;
    char buf[200];
    for (size_t k = 1; k < groups.size(); ++k) {
      const json& g = groups[k];
      std::snprintf(buf, sizeof(buf), "%d group(s) from step %lld, paused %.1f s%s%s", g.value("groups", 0),
                    static_cast<long long>(g.value("step", int64_t{0})), g.value("pause_s", 0.0),
                    g.value("step_retaken", false) ? ", a step taken again" : "",
                    g.value("heal_bytes", int64_t{0}) > 0 ? ", healed" : "");
      out.emplace_back(g.value("step", int64_t{0}), buf);
    }
    return out;
  }

  // The vertical lines: (step, label).
  std::vector<std::pair<int64_t, std::string>> lines() const {
    std::vector<std::pair<int64_t, std::string>> out;
    std::map<int64_t, bool> restarted;
    char buf[200];
    for (const auto& r : resumes) {
      const int64_t step = r.value("step", int64_t{0});
      const auto it = interruptions.find(step);
      if (it != interruptions.end()) {
        std::snprintf(buf, sizeof(buf), "%s after step %lld, restart %d", it->second.value("cause", std::string("?")).c_str(),
                      static_cast<long long>(step), r.value("restart", 0));
        std::string label = buf;
        if (r.contains("to_first_step_s") && r["to_first_step_s"].is_number()) {
          std::snprintf(buf, sizeof(buf), ", training %.1f s later", r["to_first_step_s"].get<double>());
          label += buf;
        }
        out.emplace_back(step, label);
        restarted[step] = true;
      } else {
        std::snprintf(buf, sizeof(buf), "restart %d after %s, from step %lld", r.value("restart", 0),
                      r.value("after", std::string("a failure")).c_str(), static_cast<long long>(step));
        out.emplace_back(step, buf);
      }
    }
    for (const auto& [step, i] : interruptions) {
      if (restarted.count(step) > 0) continue;
      std::snprintf(buf, sizeof(buf), "%s after step %lld, stopped", i.value("cause", std::string("?")).c_str(),
                    static_cast<long long>(step));
      out.emplace_back(step, buf);
    }
    return out;
  }
};

}  // namespace

namespace {

// What a loss plot shows, read from a metrics file: steps with a loss and the
// validation points as gnuplot data blocks, and the events' marks.
struct PlotData {
  std::ostringstream train, val, saved, durable;
  int64_t n_val = 0, first_step = std::numeric_limits<int64_t>::max(), last_step = 0;
  PlotMarks marks;
};

void read_plot_data(std::istream& in, PlotData& d) {
  std::string text;
  while (std::getline(in, text)) {
    const json j = json::parse(text, nullptr, false);
    if (!j.is_object() || !j.contains("step") || !j["step"].is_number_integer()) continue;
    const int64_t step = j["step"].get<int64_t>();
    const std::string event = j.contains("event") && j["event"].is_string() ? j["event"].get<std::string>() : "";
    if (j.contains("loss") && j["loss"].is_number() && event.empty()) {
      d.train << step << " " << j["loss"].get<double>() << "\n";
      d.marks.loss[step] = j["loss"].get<double>();
      d.first_step = std::min(d.first_step, step);
      d.last_step = std::max(d.last_step, step);
    }
    if (j.contains("val_loss") && j["val_loss"].is_number()) {
      d.val << step << " " << j["val_loss"].get<double>() << "\n";
      d.first_step = std::min(d.first_step, step);
      ++d.n_val;
    }
    if (event == "checkpoint") d.marks.checkpoints.push_back(step);
    if (event == "durable") d.marks.durable.push_back(step);
    if (event == "interruption") d.marks.interruptions[step] = j;
    if (event == "resume") d.marks.resumes.push_back(j);
    if (event == "replica_groups") d.marks.groups.push_back(j);
  }
  for (int64_t step : d.marks.checkpoints) {
    const auto it = d.marks.loss.find(step);
    if (it != d.marks.loss.end()) d.saved << step << " " << it->second << "\n";
  }
  for (int64_t step : d.marks.durable) {
    const auto it = d.marks.loss.find(step);
    if (it != d.marks.loss.end()) d.durable << step << " " << it->second << "\n";
  }
}

void write_gnuplot_script(std::ostream& gp, const PlotData& d, const std::string& png_path, const std::string& title) {
  const auto lines = d.marks.lines();
  const bool has_val = d.n_val > 0, has_saved = !d.saved.str().empty(), has_durable = !d.durable.str().empty();
  gp << "$train << EOD\n" << d.train.str() << "EOD\n";
  if (has_val) gp << "$val << EOD\n" << d.val.str() << "EOD\n";
  if (has_saved) gp << "$saved << EOD\n" << d.saved.str() << "EOD\n";
  if (has_durable) gp << "$durable << EOD\n" << d.durable.str() << "EOD\n";
  gp << "set terminal pngcairo size 900,540 font ',10'\n"
     << "set output '" << png_path << "'\n"
     << "set title \"" << gnuplot_text(title) << "\"\n"
     << "set xlabel 'optimizer step'\nset ylabel 'cross-entropy (nats per token)'\n"
     << "set grid\nset key top right\n";
  if (d.last_step > d.first_step) gp << "set xrange [" << d.first_step << ":" << d.last_step << "]\n";
  const auto group_lines = d.marks.group_lines();
  int tag = 1;
  // A dashed line, its label along it (dark, to the line's left): interruptions and restarts in
  // purple, changes of the replica groups in brown.
  for (const auto* set : {&lines, &group_lines}) {
    const char* colour = set == &lines ? "#9467bd" : "#8c564b";
    for (const auto& [step, label] : *set) {
      gp << "set arrow " << tag << " from " << step << ", graph 0 to " << step << ", graph 1 nohead dt 2 lw 2 lc rgb '"
         << colour << "' front\n"
         << "set label " << tag << " \"" << gnuplot_text(label) << "\" at " << step
         << ", graph 0.97 rotate by 90 right offset -0.9, 0 tc rgb '#333333' font ',9' front\n";
      ++tag;
    }
  }
  gp << "plot $train using 1:2 with lines lw 1.5 lc rgb '#1f77b4' title 'train loss'";
  if (has_val) gp << ", $val using 1:2 with linespoints lw 2 pt 7 ps 0.8 lc rgb '#d62728' title 'validation loss'";
  if (has_saved) gp << ", $saved using 1:2 with points pt 9 ps 1.6 lc rgb '#2ca02c' title 'checkpoint saved'";
  if (has_durable) {
    gp << ", $durable using 1:2 with points pt 6 ps 2.4 lw 2 lc rgb '#ff7f0e' title 'checkpoint durable (object store)'";
  }
  if (!lines.empty()) gp << ", NaN with lines dt 2 lw 2 lc rgb '#9467bd' title 'interruption / restart'";
  if (!group_lines.empty()) gp << ", NaN with lines dt 2 lw 2 lc rgb '#8c564b' title 'replica groups changed'";
  gp << "\n";
}

// Runs gnuplot on the script; "" when it drew the plot, else why not.
std::string run_gnuplot(const std::string& script_path) {
  const std::string command = "gnuplot '" + script_path + "' 2>&1";
  std::FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return std::string("cannot run gnuplot: ") + std::strerror(errno);
  std::string output;
  char buf[512];
  while (std::fgets(buf, sizeof(buf), pipe) != nullptr) output += buf;
  const int status = ::pclose(pipe);
  if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
    if (WIFEXITED(status) && WEXITSTATUS(status) == 127) return "gnuplot is not installed (Debian: apt-get install gnuplot-nox)";
    return "gnuplot failed: " + output.substr(0, 300);
  }
  return "";
}

}  // namespace

std::string plot_metrics(const std::string& metrics_path, const std::string& png_path, const std::string& title) {
  std::ifstream in(metrics_path);
  if (!in) return "cannot read '" + metrics_path + "'";
  PlotData d;
  read_plot_data(in, d);
  if (d.marks.loss.empty()) return "no step with a loss in '" + metrics_path + "'";
  const std::string script_path = png_path + ".gp";
  {
    std::ofstream gp(script_path, std::ios::trunc);
    write_gnuplot_script(gp, d, png_path, title);
    if (!gp) return "cannot write '" + script_path + "'";
  }
  if (auto why = run_gnuplot(script_path); !why.empty()) return why;
  std::error_code ec;
  fs::remove(script_path, ec);
  return "";
}

}  // namespace zeroshard
