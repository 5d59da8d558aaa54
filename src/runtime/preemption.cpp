// preemption.cpp — PreemptionGuard: signals caught on a Boost.Asio thread,
// agreed across ranks at step boundaries.
#include "zeroshard/preemption.h"

#include "zeroshard/log.h"

#include <ATen/ATen.h>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <thread>

namespace zeroshard {

namespace {

struct Url {
  std::string host, port = "80", target = "/";
};

Url parse_url(const std::string& url) {
  const std::string scheme = "http://";
  TORCH_CHECK_VALUE(url.rfind(scheme, 0) == 0, "PreemptionGuard: notice_url '", url,
                    "' must start with http:// (metadata endpoints are plain HTTP)");
  Url u;
  const std::string rest = url.substr(scheme.size());
  const size_t slash = rest.find('/');
  std::string hostport = slash == std::string::npos ? rest : rest.substr(0, slash);
  if (slash != std::string::npos) u.target = rest.substr(slash);
  const size_t colon = hostport.find(':');
  u.host = hostport.substr(0, colon);
  if (colon != std::string::npos) u.port = hostport.substr(colon + 1);
  TORCH_CHECK_VALUE(!u.host.empty(), "PreemptionGuard: notice_url '", url, "' has no host");
  return u;
}

// One GET with a 1 s budget; true when it says a preemption is coming.
bool poll_once(const Url& u, const std::vector<std::pair<std::string, std::string>>& headers, std::string* error) {
  namespace beast = boost::beast;
  namespace http = beast::http;
  try {
    boost::asio::io_context io;
    boost::asio::ip::tcp::resolver resolver(io);
    beast::tcp_stream stream(io);
    stream.expires_after(std::chrono::seconds(1));
    stream.connect(resolver.resolve(u.host, u.port));
    http::request<http::string_body> req{http::verb::get, u.target, 11};
    req.set(http::field::host, u.host);
    for (const auto& [k, v] : headers) req.set(k, v);
    http::write(stream, req);
    beast::flat_buffer buffer;
    http::response<http::string_body> res;
    http::read(stream, buffer, res);
    beast::error_code ec;
    stream.socket().shutdown(boost::asio::ip::tcp::socket::shutdown_both, ec);
    if (res.result() != http::status::ok) return false;
    std::string body = res.body();
    body.erase(0, body.find_first_not_of(" \r\n\t"));
    body.erase(body.find_last_not_of(" \r\n\t") + 1);
    return !body.empty() && body != "FALSE" && body != "false";
  } catch (const std::exception& e) {
    *error = error_message(e);
    return false;
  }
}

// Now on the system clock, in nanoseconds since the Unix epoch.
int64_t unix_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

struct PreemptionGuard::Impl {
  boost::asio::io_context io;
  boost::asio::signal_set signals{io};
  boost::asio::steady_timer timer{io};
  std::thread thread;
  bool logged_unreachable = false;

  void poll(const Url& url, const PreemptionOptions& o, std::atomic<bool>* seen, std::atomic<int64_t>* seen_ns) {
    std::string error;
    if (poll_once(url, o.notice_url_headers, &error)) {
      int64_t none = 0;
      seen_ns->compare_exchange_strong(none, unix_ns());
      seen->store(true);
      return;  // a notice stays a notice
    }
    if (!error.empty() && !logged_unreachable) {
      log_debug("preemption: notice_url '" + o.notice_url + "' unreachable (" + error + "); polling on");
      logged_unreachable = true;
    }
    timer.expires_after(std::chrono::milliseconds(static_cast<int64_t>(o.notice_poll_interval_s * 1000)));
    timer.async_wait([this, url, &o, seen, seen_ns](const boost::system::error_code& ec) {
      if (!ec) poll(url, o, seen, seen_ns);
    });
  }

  void arm(std::atomic<int>* seen, std::atomic<int64_t>* seen_ns) {
    signals.async_wait([this, seen, seen_ns](const boost::system::error_code& ec, int sig) {
      if (ec) return;  // cancelled: the guard is going away
      int64_t none = 0;
      seen_ns->compare_exchange_strong(none, unix_ns());
      seen->store(sig);
      arm(seen, seen_ns);  // later signals are absorbed too
    });
  }
};

PreemptionGuard::PreemptionGuard(std::shared_ptr<Communicator> comm, PreemptionOptions options)
    : comm_(std::move(comm)), options_(std::move(options)), impl_(std::make_unique<Impl>()) {
  TORCH_CHECK_VALUE(comm_ != nullptr, "PreemptionGuard: the communicator is null");
  TORCH_CHECK_VALUE(options_.grace_period_s > 0, "PreemptionGuard: grace_period_s is ", options_.grace_period_s,
                    "; it must be positive");
  for (int sig : options_.signals) {
    boost::system::error_code ec;
    impl_->signals.add(sig, ec);
    TORCH_CHECK_VALUE(!ec, "PreemptionGuard: cannot handle signal ", sig, ": ", ec.message());
  }
  impl_->arm(&signal_, &seen_ns_);
  if (!options_.notice_url.empty()) {
    TORCH_CHECK_VALUE(options_.notice_poll_interval_s > 0, "PreemptionGuard: notice_poll_interval_s is ",
                      options_.notice_poll_interval_s, "; it must be positive");
    const Url url = parse_url(options_.notice_url);
    boost::asio::post(impl_->io, [this, url] { impl_->poll(url, options_, &url_notice_, &seen_ns_); });
  }
  impl_->thread = std::thread([this] { impl_->io.run(); });
}

PreemptionGuard::~PreemptionGuard() {
  if (agreement_ != nullptr) agreement_->remove(slot_);
  boost::system::error_code ec;
  impl_->signals.cancel(ec);
  impl_->signals.clear(ec);  // default dispositions again
  impl_->timer.cancel();
  impl_->io.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

void PreemptionGuard::join(std::shared_ptr<StepAgreement> agreement) {
  TORCH_CHECK_VALUE(agreement != nullptr, "PreemptionGuard::join: the agreement is null");
  TORCH_CHECK_VALUE(agreement->communicator().size() == comm_->size(), "PreemptionGuard::join: the agreement is over ",
                    agreement->communicator().size(), " ranks but the guard's communicator has ", comm_->size(),
                    "; every rank that must stop at the same step votes in the same agreement");
  if (agreement_ != nullptr) agreement_->remove(slot_);
  agreement_ = std::move(agreement);
  // A vote read from the agreement before (its own, made by should_stop()) says nothing of this one's.
  own_agreement_ = false;
  read_at_ = -1;
  vote_ = Vote{};
  // Per rank [notice, when this rank first saw it (s, 0: not yet)]: any notice stops every rank, and the earliest time is kept.
  slot_ = agreement_->add_per_rank(
      "preemption vote", 2,
      [this](double* v) {
        seen_ = Seen{signal_.load(), url_notice_.load(),
                     !options_.notice_file.empty() && std::filesystem::exists(options_.notice_file)};
        if (seen_.file_notice) {
          int64_t none = 0;
          seen_ns_.compare_exchange_strong(none, unix_ns());
        }
        v[0] = (seen_.signal != 0 || seen_.url_notice || seen_.file_notice) ? 1.0 : 0.0;
        v[1] = static_cast<double>(seen_ns_.load()) * 1e-9;
      },
      [this](const double* all) {
        vote_ = Vote{};
        vote_.at = agreement_->agreements() + 1;  // read before agree() counts itself
        for (int r = 0; r < comm_->size(); ++r) {
          vote_.any = vote_.any || all[2 * r] != 0;
          if (all[2 * r + 1] > 0) vote_.earliest = std::min(vote_.earliest, all[2 * r + 1]);
        }
      });
}

bool PreemptionGuard::should_stop() {
  if (stopped_) return true;
  if (agreement_ == nullptr) {  // its own agreement: one all-reduce here
    StepAgreementOptions ao;
    ao.check_slots = false;  // one slot, the same on every rank
    join(std::make_shared<StepAgreement>(comm_, ao));
    own_agreement_ = true;
  }
  if (own_agreement_) agreement_->agree();
  TORCH_CHECK(vote_.at > read_at_, "PreemptionGuard::should_stop: the step's agreement has not run since the last "
              "call (", agreement_->agreements(), " agreements); call should_stop() once per step, after the step's "
              "agree() (a joined optimizer's step() runs it)");
  read_at_ = vote_.at;
  // What this rank saw when it voted: the cause it names is its vote's.
  const int sig = seen_.signal;
  const bool url_notice = seen_.url_notice;
  const bool notice = url_notice || seen_.file_notice;
  if (!vote_.any) return false;
  stopped_ = true;
  notice_time_ = std::isfinite(vote_.earliest) ? vote_.earliest : unix_ns() * 1e-9;
  cause_ = sig != 0      ? "SIG" + std::string(sigabbrev_np(sig) != nullptr ? sigabbrev_np(sig) : std::to_string(sig))
           : url_notice ? "notice URL"
           : notice     ? "notice file"
                        : "another rank's notice";
  std::string why = sig != 0      ? "got " + cause_ + " (" + strsignal(sig) + ")"
                    : url_notice ? "got a notice from '" + options_.notice_url + "'"
                    : notice     ? "found the notice file '" + options_.notice_file + "'"
                                 : "";
  log_warn("preemption: " + (why.empty() ? std::string("another rank was told to stop") : "this rank " + why) +
           "; every rank stops after this step");
  return true;
}

bool PreemptionGuard::check_save_fits(double save_seconds) const {
  char msg[200];
  if (save_seconds <= options_.grace_period_s) {
    std::snprintf(msg, sizeof(msg), "preemption: a checkpoint save takes %.2f s of the %.1f s grace period",
                  save_seconds, options_.grace_period_s);
    log_info(msg);
    return true;
  }
  std::snprintf(msg, sizeof(msg),
                "preemption: the last checkpoint save took %.1f s, longer than the %.1f s grace period; a save "
                "after a notice may not finish (save more often, or give the job a longer grace period)",
                save_seconds, options_.grace_period_s);
  log_warn(msg);
  return false;
}

}  // namespace zeroshard
