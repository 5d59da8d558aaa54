#include "comm/nccl/issue_thread.h"

#include "comm/nccl/nccl_api.h"
#include "zeroshard/log.h"
#include "zeroshard/trace.h"

#include <c10/util/Exception.h>

#include <exception>
#include <future>
#include <map>
#include <memory>

namespace zeroshard::comm::nccl {

IssueThread& IssueThread::of(NcclApi& api, int device) {
  static std::mutex mu;
  static std::map<std::pair<NcclApi*, int>, std::unique_ptr<IssueThread>> threads;  // joined at exit
  std::lock_guard<std::mutex> lock(mu);
  auto& t = threads[{&api, device}];
  if (!t) t = std::make_unique<IssueThread>(api, device);
  return *t;
}

IssueThread::IssueThread(NcclApi& api, int device) : api_(api), device_(device) {
  thread_ = std::thread([this] { loop(); });
}

IssueThread::~IssueThread() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void IssueThread::post(Task task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void IssueThread::run(const std::function<void()>& fn) {
  auto done = std::make_shared<std::promise<void>>();
  auto result = done->get_future();
  post([&fn, done] {
    try {
      fn();
      done->set_value();
    } catch (...) {
      done->set_exception(std::current_exception());
    }
    return true;
  });
  result.get();
}

namespace {
// Runs a task; one that throws is dropped (its works are failed by the task
// itself, or by the watchdog's timeout), never the thread.
bool run_task(IssueThread::Task& task) {
  try {
    return task();
  } catch (const c10::Error& e) {
    log_error(std::string("NCCL issue thread: a task failed: ") + e.what_without_backtrace());
  } catch (const std::exception& e) {
    log_error(std::string("NCCL issue thread: a task failed: ") + error_message(e));
  }
  return true;
}
}  // namespace

void IssueThread::loop() {
  trace::set_thread_name("nccl issue cuda:" + std::to_string(device_));
  try {
    api_.set_device(device_);
  } catch (const std::exception& e) {
    log_error("NCCL issue thread: cannot make device " + std::to_string(device_) + " current: " + error_message(e));
  }
  while (true) {
    std::deque<Task> batch;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (retries_.empty()) {
        cv_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
      } else {  // something waits for a peer: look again soon
        cv_.wait_for(lock, std::chrono::microseconds(200), [&] { return stopping_ || !tasks_.empty(); });
      }
      if (stopping_ && tasks_.empty()) return;
      batch.swap(tasks_);
    }
    for (auto& task : batch) {
      if (!run_task(task)) retries_.push_back(std::move(task));
    }
    for (size_t n = retries_.size(); n > 0; --n) {
      Task task = std::move(retries_.front());
      retries_.pop_front();
      if (!run_task(task)) retries_.push_back(std::move(task));
    }
  }
}

}  // namespace zeroshard::comm::nccl
