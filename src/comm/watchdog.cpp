#include "comm/watchdog.h"

#include "comm/tcp_communicator.h"
#include "zeroshard/log.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>

namespace zeroshard::comm {

std::string describe_missing(uint64_t seq, const std::vector<std::optional<uint64_t>>& issued,
                             const std::vector<int>& world_ranks) {
  std::string ranks, details;
  for (size_t r = 0; r < issued.size(); ++r) {
    if (issued[r] && *issued[r] > seq) continue;  // issued #seq (counts run from 1: #0 is the first)
    const std::string name = std::to_string(r < world_ranks.size() ? world_ranks[r] : static_cast<int>(r));
    ranks += (ranks.empty() ? "" : ", ") + name;
    details += (details.empty() ? "" : "; ") + std::string("rank ") + name +
               (!issued[r]       ? " never reported"
                : *issued[r] == 0 ? " issued nothing"
                                  : " issued up to #" + std::to_string(*issued[r] - 1));
  }
  if (ranks.empty()) return "";
  return "rank(s) [" + ranks + "] never issued it (" + details + ")";
}

Watchdog::Watchdog(std::chrono::milliseconds timeout, Clock clock)
    : timeout_(timeout), clock_(clock ? std::move(clock) : Clock([] { return std::chrono::steady_clock::now(); })) {}

void Watchdog::add(std::shared_ptr<WatchedComm> comm) {
  std::lock_guard<std::mutex> lock(mu_);
  comms_.push_back(std::move(comm));
}

std::vector<std::shared_ptr<WatchedOp>> Watchdog::forget(const WatchedComm* comm) {
  std::lock_guard<std::mutex> lock(mu_);
  comms_.erase(std::remove_if(comms_.begin(), comms_.end(), [&](const auto& c) { return c.get() == comm; }),
               comms_.end());
  std::vector<std::shared_ptr<WatchedOp>> forgotten;
  for (const auto& f : in_flight_) {
    if (f.comm == comm) forgotten.push_back(f.op);
  }
  in_flight_.erase(std::remove_if(in_flight_.begin(), in_flight_.end(), [&](const auto& f) { return f.comm == comm; }),
                   in_flight_.end());
  return forgotten;
}

void Watchdog::watch(WatchedComm* comm, std::shared_ptr<WatchedOp> op) {
  std::string failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_.empty()) {
      in_flight_.push_back({comm, std::move(op), clock_()});
      return;
    }
    failed = failure_;
  }
  op->fail(failed);
}

std::string Watchdog::failure() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

size_t Watchdog::poll() {
  std::vector<InFlight> finished, in_flight;
  std::vector<std::shared_ptr<WatchedComm>> comms;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_.empty()) return 0;
    in_flight = in_flight_;
    comms = comms_;
  }
  // Device queries without the lock: an event query or an error query may take a while.
  for (const auto& comm : comms) {
    comm->heartbeat();
    const std::string error = comm->async_error();
    if (!error.empty()) {
      std::string why = "the communicator reported an asynchronous error: " + error;
      if (!in_flight.empty()) why = in_flight.front().op->name() + " failed: " + why;
      fail_all(why, in_flight);
      return 0;
    }
  }
  const auto now = clock_();
  std::vector<std::shared_ptr<WatchedOp>> done;
  for (const auto& f : in_flight) {
    if (f.op->finished_on_device()) {
      done.push_back(f.op);
    } else if (now - f.issued >= timeout_) {
      const std::string missing = f.op->missing_ranks();
      fail_all(f.op->name() + " did not complete within " + std::to_string(timeout_.count()) + " ms" +
                   (missing.empty() ? "" : ": " + missing) +
                   ". Every communicator was aborted; check that every rank issues the same operations in the "
                   "same order, and the missing ranks' logs",
               in_flight);
      return 0;
    }
  }
  for (const auto& op : done) op->complete();
  std::lock_guard<std::mutex> lock(mu_);
  in_flight_.erase(std::remove_if(in_flight_.begin(), in_flight_.end(),
                                  [&](const InFlight& f) {
                                    return std::find(done.begin(), done.end(), f.op) != done.end();
                                  }),
                   in_flight_.end());
  return in_flight_.size();
}

void Watchdog::fail(const std::string& why) { fail_all(why, {}); }

void Watchdog::wait_aborted(std::chrono::steady_clock::time_point deadline) {
  std::vector<std::shared_ptr<WatchedComm>> comms;
  {
    std::lock_guard<std::mutex> lock(mu_);
    comms = comms_;
  }
  for (const auto& c : comms) c->wait_aborted(deadline);
}

void Watchdog::fail_all(const std::string& why, std::vector<InFlight> in_flight) {
  std::vector<std::shared_ptr<WatchedComm>> comms;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_.empty()) return;
    failure_ = why;
    comms = comms_;
    // Operations watched since the caller's snapshot fail too.
    for (const auto& f : in_flight_) {
      if (std::none_of(in_flight.begin(), in_flight.end(), [&](const InFlight& g) { return g.op == f.op; })) {
        in_flight.push_back(f);
      }
    }
    in_flight_.clear();
  }
  // Doomed first: an abort fires the operations' end events, and a waiter that saw one
  // before its operation failed would take it for success. Failed last: failing releases
  // the tensors, which the device may use until the abort ends its operations.
  for (const auto& f : in_flight) f.op->doom();
  for (const auto& comm : comms) comm->abort(why);
  for (const auto& f : in_flight) f.op->fail(why);
}

namespace {

// The families alive, for the terminate handler.
std::timed_mutex families_mu;
std::vector<Family*> families;  // guarded by families_mu
std::mutex error_file_mu;
std::string terminate_error_file;  // guarded by error_file_mu
std::terminate_handler previous_handler = nullptr;

std::string what_ended_it() {
  const auto e = std::current_exception();
  if (!e) return "std::terminate was called with no exception in flight";
  try {
    std::rethrow_exception(e);
  } catch (const c10::Error& x) {
    return std::string("an uncaught exception: ") + x.what_without_backtrace();
  } catch (const std::exception& x) {
    return std::string("an uncaught exception: ") + x.what();
  } catch (...) {
    return "an uncaught exception of a type not derived from std::exception";
  }
}

[[noreturn]] void on_terminate() {
  static std::atomic<bool> entered{false};
  if (!entered.exchange(true)) {
    const std::string why = "this rank ended with " + what_ended_it();
    log_error(why);
    std::string error_file;
    {
      std::lock_guard<std::mutex> lock(error_file_mu);
      error_file = terminate_error_file;
    }
    note_failure(error_file, why);  // first: its moment precedes every peer's error, which it causes
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    if (families_mu.try_lock_until(deadline)) {
      for (auto* f : families) f->dog.fail(why);  // no-op for a family that failed before: it told its peers then
      for (auto* f : families) f->dog.wait_aborted(deadline);
      families_mu.unlock();
    }
  }
  if (previous_handler != nullptr) previous_handler();
  std::abort();
}

}  // namespace

void install_terminate_handler(const std::string& error_file) {
  {
    std::lock_guard<std::mutex> lock(error_file_mu);
    terminate_error_file = error_file;
  }
  static std::once_flag once;
  std::call_once(once, [] { previous_handler = std::set_terminate(&on_terminate); });
}

Family::Family(std::chrono::milliseconds timeout) : dog(timeout) {
  {
    std::lock_guard<std::timed_mutex> lock(families_mu);
    families.push_back(this);
  }
  poller_ = std::thread([this] {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stopping_) {
      lock.unlock();
      dog.poll();
      lock.lock();
      cv_.wait_for(lock, std::chrono::milliseconds(100), [&] { return stopping_; });
    }
  });
}

Family::~Family() {
  {
    std::lock_guard<std::timed_mutex> lock(families_mu);
    families.erase(std::remove(families.begin(), families.end(), this), families.end());
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  poller_.join();
}

}  // namespace zeroshard::comm
