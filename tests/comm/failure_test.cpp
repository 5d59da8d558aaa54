// What happens when ranks are missing, die, disagree or pass bad arguments.
// Ranks are threads of this process (each with its own communicator), so the
// tests can control exactly who arrives.
#include "comm/wire.h"
#include "compat/torch_compat.h"
#include "test_util.h"
#include "zeroshard/step_agreement.h"

#include <gtest/gtest.h>

#include <c10/util/Exception.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <stdexcept>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <sstream>
#include <thread>

namespace zeroshard {
namespace failure_test {

using namespace std::chrono_literals;

using testing::run_ranks;
using testing::thread_env;

// Operations wait 30 s for their peers, so a test that ends sooner shows that
// something other than the timeout ended them; threads may start slowly.
CommOptions patient() {
  CommOptions opt;
  opt.timeout = 30s;
  opt.rendezvous_timeout = 60s;
  return opt;
}

// A hand-made client of rank 0's listening port, as a peer or a stranger sees it (rank 0 serves the store:
// its keys name no restart count).
struct RawPeer {
  std::shared_ptr<c10d::Store> store;
  explicit RawPeer(int store_port)
      : store(compat::make_tcp_store("127.0.0.1", static_cast<uint16_t>(store_port), false, 2, 60s)) {}
  std::string get(const std::string& key) {
    store->wait({key}, 60s);
    const auto value = store->get(key);
    return std::string(value.begin(), value.end());
  }
  uint64_t token() { return std::stoull(get("zs/world/token/0")); }
  // A connection to rank 0's listening port (published as "ip port").
  int connect_to_rank0() {
    std::istringstream in(get("zs/world/mesh/addr/0"));
    std::string ip;
    int port = 0;
    in >> ip >> port;
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) throw std::runtime_error("connect failed");
    return fd;
  }
};

// The bytes of `fields`, one after the other, as the transport's structs lay them out
// (each field at its natural alignment, none padded).
template <class... T>
std::string pack(const T&... fields) {
  std::string out;
  (out.append(reinterpret_cast<const char*>(&fields), sizeof(fields)), ...);
  return out;
}

// The 24 bytes a connecting rank says first (tcp_mesh.cpp's Hello).
std::string hello(uint32_t magic, uint32_t version, int32_t rank, int32_t size, uint64_t token) {
  return pack(magic, version, rank, size, token);
}
constexpr uint32_t kMagic = 0x5A535446, kVersion = 4;

// A transport frame header (tcp_mesh.cpp's FrameHeader: 40 bytes), offset 0.
std::string frame(uint32_t type, uint64_t slot, uint64_t bytes, uint64_t total) {
  return pack(kMagic, type, slot, uint64_t{0}, bytes, total);
}
constexpr uint32_t kDataFrame = 1, kReadyFrame = 2;

// Rank 1 of 2 played by hand: a correct hello, then `misbehave(fd)`; the connection stays
// open until `done`. Rank 0 (a real communicator) runs `body`; returns rank 0's error.
std::string against_a_hand_played_rank1(const std::function<void(int)>& misbehave,
                                        const std::function<void(Communicator&)>& body,
                                        const CommOptions& options = patient()) {
  const int port = testing::free_port();
  std::atomic<bool> done{false};
  auto errors = run_ranks(2, [&](int r) {
    if (r == 1) {
      RawPeer peer(port);
      const int fd = peer.connect_to_rank0();
      const std::string h = hello(kMagic, kVersion, 1, 2, peer.token());
      ASSERT_EQ(send(fd, h.data(), h.size(), MSG_NOSIGNAL), 24);
      misbehave(fd);
      while (!done) std::this_thread::sleep_for(10ms);
      close(fd);
      return;
    }
    try {
      auto c = init_communicator(thread_env(0, 2, port), options);
      body(*c);
    } catch (...) {
      done = true;
      throw;
    }
    done = true;
  });
  EXPECT_EQ(errors[1], "");
  return errors[0];
}

// Every error of `ranks` contains each of `needles`.
void expect_errors_contain(const std::vector<std::string>& errors, std::initializer_list<int> ranks,
                           std::initializer_list<const char*> needles) {
  for (int r : ranks)
    for (const char* needle : needles) EXPECT_NE(errors[r].find(needle), std::string::npos) << errors[r];
}

TEST(CommFailure, MissingRankTimesOutNamingIt) {
  const int port = testing::free_port();
  std::atomic<bool> release{false};
  const auto start = std::chrono::steady_clock::now();
  auto errors = run_ranks(3, [&](int r) {
    CommOptions opt;
    opt.timeout = 1500ms;
    opt.rendezvous_timeout = 60s;  // threads may start slowly on a loaded machine
    auto c = init_communicator(thread_env(r, 3, port), opt);
    auto t = at::ones({1000});
    c->all_reduce(t, ReduceOp::kSum)->wait();  // #0: everyone
    if (r == 2) {
      // Rank 2 never issues #1; it stays alive until the others gave up.
      while (!release) std::this_thread::sleep_for(10ms);
      return;
    }
    try {
      c->all_reduce(t, ReduceOp::kSum)->wait();
    } catch (...) {
      if (r == 0) release = true;
      throw;
    }
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int r : {0, 1}) {
    EXPECT_NE(errors[r].find("all_reduce #1"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("timed out after 1500 ms"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("rank(s) [2] never arrived"), std::string::npos) << errors[r];
  }
  EXPECT_EQ(errors[2], "");
  EXPECT_LT(seconds, 15.0) << "the timeout must bound the wait";
}

// A rank that fails its own rendezvous (here: an interface this host does not have) says so
// through the store: the others stop with its reason instead of waiting out the rendezvous
// timeout (60 s) for a rank that will never come.
// StepAgreement's slot check (step_agreement.h): slots that differ on every
// rank are named, each rank's version; a slot added on one rank only fails
// the agreement on every rank (its all-gather meets the others' all-reduce),
// well before the 30 s timeout, instead of summing mismatched values.
TEST(CommFailure, StepAgreementSlotsThatDifferFailTheAgreement) {
  auto fill = [](double* v) { v[0] = 1; };
  const int port = testing::free_port();
  auto named = run_ranks(3, [&](int r) {
    auto c = init_communicator(thread_env(r, 3, port), patient());
    StepAgreement a(c);
    a.add("norms", 2, fill, nullptr);
    a.add(r == 1 ? "loss" : "tokens", 1, fill, nullptr);
    a.agree();
  });
  expect_errors_contain(named, {0, 1, 2}, {"StepAgreement slots", "'tokens' (1 values)", "'loss' (1 values)"});

  const int port2 = testing::free_port();
  const auto start = std::chrono::steady_clock::now();
  auto one_rank = run_ranks(3, [&](int r) {
    auto c = init_communicator(thread_env(r, 3, port2), patient());
    StepAgreement a(c);
    a.add("norms", 2, fill, nullptr);
    a.agree();
    if (r == 0) a.add("loss", 1, fill, nullptr);
    a.agree();
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(one_rank[r], "") << "rank " << r << " agreed on mismatched slots";
    std::printf("a slot added on rank 0 only, rank %d: %s\n", r, one_rank[r].substr(0, 300).c_str());
  }
  expect_errors_contain(one_rank, {1, 2}, {"rank 0 issued all_gather #2", "where this rank issued all_reduce #2",
                                           "holding the slots ['norms' (2 values)]:"});
  expect_errors_contain(one_rank, {0}, {"holding the slots ['norms' (2 values), 'loss' (1 values)]:"});
  EXPECT_LT(seconds, 20.0) << "the mismatch must fail the agreement before the 30 s timeout";
}

TEST(CommFailure, ARankThatFailsItsRendezvousStopsTheOthersAtOnce) {
  const int port = testing::free_port();
  auto errors = run_ranks(3, [&](int r) {
    DistEnv e = thread_env(r, 3, port);
    if (r == 2) e.socket_ifname = "zs-no-such-if";
    auto c = init_communicator(e, patient());
    c->barrier();
  });
  EXPECT_NE(errors[2].find("zs-no-such-if"), std::string::npos) << errors[2];
  for (int r : {0, 1}) {
    EXPECT_NE(errors[r].find("rendezvous abandoned: rank 2 on host "), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("zs-no-such-if"), std::string::npos) << errors[r];
    EXPECT_EQ(errors[r].find("timed out"), std::string::npos) << errors[r];
  }
}

TEST(CommFailure, DeadRankIsNamedWithoutWaitingForTheTimeout) {
  const int port = testing::free_port();
  const auto start = std::chrono::steady_clock::now();
  auto errors = run_ranks(3, [&](int r) {
    CommOptions opt;
    opt.timeout = 30s;
    auto c = init_communicator(thread_env(r, 3, port), opt);
    auto t = at::ones({1000});
    c->all_reduce(t, ReduceOp::kSum)->wait();
    if (r == 1) {
      c.reset();  // rank 1 "dies": its connections close
      return;
    }
    c->all_reduce(t, ReduceOp::kSum)->wait();
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(errors[1], "");
  expect_errors_contain(errors, {0, 2}, {"all_reduce #1", "[1]"});
  EXPECT_LT(seconds, 20.0) << "a closed connection must fail the op before the 30 s timeout";
}

// A rank that fails on its own aborts: its queued and posted operations fail at once
// with its reason, its other communicators (the family) fail too, and its peers'
// operations with it fail naming it and the reason, long before their 30 s timeout.
TEST(CommFailure, AbortFailsTheFamilyAndPeersLearnWhyAtOnce) {
  const int port = testing::free_port();
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::string> split_errors(3);
  auto errors = run_ranks(3, [&](int r) {
    auto c = init_communicator(thread_env(r, 3, port), patient());
    auto pair = c->split({0, 1});  // ranks 0 and 1; rank 2 gets nullptr
    auto t = at::ones({1000});
    c->all_reduce(t, ReduceOp::kSum)->wait();
    if (r == 1) {
      auto never = at::zeros({10});
      auto posted = c->recv(never, 2);  // rank 2 sends nothing: posted, pending
      c->abort("a bad batch at step 17");
      EXPECT_THROW(posted->wait(), c10::Error);
      try {
        c->all_reduce(t, ReduceOp::kSum)->wait();
        ADD_FAILURE() << "an aborted communicator ran an operation";
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what_without_backtrace()).find("a bad batch at step 17"), std::string::npos)
            << e.what_without_backtrace();
      }
      try {
        pair->all_reduce(t, ReduceOp::kSum)->wait();
        ADD_FAILURE() << "the split of an aborted communicator ran an operation";
      } catch (const c10::Error& e) {
        split_errors[1] = e.what_without_backtrace();
      }
      return;
    }
    if (r == 0) {
      // Rank 0's split fails too once its world communicator heard of rank 1's abort.
      try {
        c->all_reduce(t, ReduceOp::kSum)->wait();
      } catch (const c10::Error& e) {
        // The split fails too, with the reason: at once if the family's watchdog (every 100 ms) already
        // failed it, else when it does or when rank 1's abort reaches it.
        try {
          pair->all_reduce(t, ReduceOp::kSum)->wait();
        } catch (const c10::Error& e2) {
          split_errors[0] = e2.what_without_backtrace();
        }
        throw;
      }
      return;
    }
    c->all_reduce(t, ReduceOp::kSum)->wait();
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(errors[1], "");
  expect_errors_contain(errors, {0, 2}, {"all_reduce #1", "[1]", "a bad batch at step 17"});
  for (int r : {0, 1}) EXPECT_NE(split_errors[r].find("a bad batch at step 17"), std::string::npos) << split_errors[r];
  EXPECT_LT(seconds, 15.0) << "the abort must end the peers' operations long before the 30 s timeout";
}

// A communicator destroyed while an exception propagates does not drain: what it
// had queued fails at once, and its peers hear why.
TEST(CommFailure, DestroyedWhileUnwindingAbortsInsteadOfDraining) {
  const int port = testing::free_port();
  const auto start = std::chrono::steady_clock::now();
  auto errors = run_ranks(2, [&](int r) {
    auto c = init_communicator(thread_env(r, 2, port), patient());
    auto t = at::ones({1000});
    c->all_reduce(t, ReduceOp::kSum)->wait();
    if (r == 1) {
      auto queued = c->broadcast(t, 0);  // rank 0 never broadcasts: draining it would wait 30 s
      (void)queued;
      throw std::runtime_error("the loss is NaN");  // `c` is destroyed while this propagates
    }
    auto never = at::zeros({1000});
    c->recv(never, 1)->wait();  // rank 1 never sends
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(errors[1].find("the loss is NaN"), std::string::npos) << errors[1];
  EXPECT_NE(errors[0].find("recv #0 from rank 1"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("unwinding from an exception"), std::string::npos) << errors[0];
  EXPECT_LT(seconds, 15.0) << "neither rank may wait for the 30 s timeout";
}

// A peer that connected and then went silent (a host that died without closing its
// connections, or a partition) is named within the liveness window, not the timeout.
// Rank 1 is played by hand here: it says a correct hello, then nothing, ever.
TEST(CommFailure, SilentPeerIsNamedWithinTheLivenessWindow) {
  CommOptions opt = patient();
  opt.timeout = 60s;
  opt.liveness = 2s;
  double seconds = 0;
  const std::string error = against_a_hand_played_rank1(
      [](int) {},  // silent, connection open
      [&](Communicator& c) {
        auto t = at::ones({1000});
        const auto start = std::chrono::steady_clock::now();
        try {
          c.all_reduce(t, ReduceOp::kSum)->wait();
        } catch (...) {
          seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          throw;
        }
      },
      opt);
  EXPECT_NE(error.find("all_reduce #0"), std::string::npos) << error;
  EXPECT_NE(error.find("[1]"), std::string::npos) << error;
  EXPECT_NE(error.find("no sign of life from rank 1 for 2000 ms"), std::string::npos) << error;
  EXPECT_GE(seconds, 1.2) << "silence shorter than two thirds of the window is no failure";
  EXPECT_LT(seconds, 20.0) << "the liveness window (2 s), not the 60 s timeout, must end the wait";
}

// A peer that sends more unasked-for small messages than the bound breaks its
// connection, naming it, instead of growing this rank's memory without end.
TEST(CommFailure, UnaskedForMessagesAreBounded) {
  const std::string error = against_a_hand_played_rank1(
      [](int fd) {
        std::string flood;
        for (uint64_t slot = 1; slot <= 4097; ++slot) flood += frame(kDataFrame, slot, 8, 8) + std::string(8, 'x');
        ASSERT_EQ(send(fd, flood.data(), flood.size(), MSG_NOSIGNAL), static_cast<ssize_t>(flood.size()));
      },
      [](Communicator& c) {
        auto t = at::ones({10});
        c.all_reduce(t, ReduceOp::kSum)->wait();
      });
  EXPECT_NE(error.find("[1]"), std::string::npos) << error;
  EXPECT_NE(error.find("sent more than 4096 small messages that no receive was posted for"), std::string::npos)
      << error;
}

// Reads exactly `n` bytes from `fd` (a hand-played rank's side of a connection).
std::string read_exactly(int fd, size_t n) {
  std::string out(n, '\0');
  for (size_t got = 0; got < n;) {
    const ssize_t k = ::recv(fd, &out[got], n - got, 0);
    if (k <= 0) throw std::runtime_error("the connection ended after " + std::to_string(got) + " bytes");
    got += static_cast<size_t>(k);
  }
  return out;
}

struct Frame {
  uint32_t magic, type;
  uint64_t slot, offset, bytes, total;
};
// The next frame's header, past heartbeats (which carry nothing).
Frame read_frame_header(int fd) {
  constexpr uint32_t kHeartbeatFrame = 4;
  Frame f;
  do {
    const std::string raw = read_exactly(fd, sizeof(Frame));
    std::memcpy(&f, raw.data(), sizeof(Frame));
  } while (f.type == kHeartbeatFrame);
  return f;
}

// A receive larger than kEagerBytes sends a ready notice; a sender may still
// write a small message at once, and the notice then reaches it after its send,
// matching nothing. The receiver withdraws it (a notice of 0 bytes), and the
// sender drops it: 4,200 such notices (more than the 4,096 a peer may leave
// unmatched) break nothing, and each receive answered eagerly is withdrawn.
TEST(CommFailure, ReadyNoticesCrossedByEagerSendsAreWithdrawn) {
  constexpr int kCrossed = 4200;
  std::atomic<int> withdrawn{0};
  const std::string error = against_a_hand_played_rank1(
      [&](int fd) {
        // Rank 0 sends kCrossed small messages (p2p headers with the data inline): each is answered as a
        // receiver of 9,000 bytes would whose notice crossed the message, then withdrew it.
        for (int i = 0; i < kCrossed + 1; ++i) {
          const Frame f = read_frame_header(fd);
          ASSERT_EQ(f.type, kDataFrame);
          read_exactly(fd, f.bytes);
          if (i == kCrossed) break;
          const std::string answer = frame(kReadyFrame, f.slot, 0, 9000) + frame(kReadyFrame, f.slot, 0, 0);
          ASSERT_EQ(send(fd, answer.data(), answer.size(), MSG_NOSIGNAL), 80);
        }
        // Then rank 1 sends rank 0 a p2p message of 400,000 bytes, but writes only 100 of them at once (a
        // sender may write fewer bytes than the receive, at most kEagerBytes): rank 0's data receive sent a
        // notice for 400,000 bytes, and withdraws it once the 100 bytes are in.
        comm::WireHeader h;
        h.magic = comm::kMagic;
        h.kind = static_cast<uint32_t>(OpKind::kRecv);
        h.numel = 100'000;
        h.dtype = static_cast<int32_t>(c10::ScalarType::Float);
        const std::string header(reinterpret_cast<const char*>(&h), sizeof(h));
        const uint64_t header_slot = comm::make_slot(comm::kP2PHeader, 0, 0);
        const uint64_t data_slot = comm::make_slot(comm::kP2PData, 0, 0);
        const std::string msg = frame(kDataFrame, header_slot, header.size(), header.size()) + header;
        ASSERT_EQ(send(fd, msg.data(), msg.size(), MSG_NOSIGNAL), static_cast<ssize_t>(msg.size()));
        const Frame notice = read_frame_header(fd);
        ASSERT_EQ(notice.type, kReadyFrame);
        ASSERT_EQ(notice.slot, data_slot);
        ASSERT_EQ(notice.total, 400'000u);
        const std::string data = frame(kDataFrame, data_slot, 100, 100) + std::string(100, 'x');
        ASSERT_EQ(send(fd, data.data(), data.size(), MSG_NOSIGNAL), static_cast<ssize_t>(data.size()));
        const Frame next = read_frame_header(fd);
        if (next.type == kReadyFrame && next.slot == data_slot && next.total == 0) ++withdrawn;
      },
      [&](Communicator& c) {
        auto small = at::ones({16});
        for (int i = 0; i < kCrossed + 1; ++i) c.send(small, 1)->wait();
        auto big = at::zeros({100'000});
        c.recv(big, 1)->wait();
        const auto deadline = std::chrono::steady_clock::now() + 20s;
        while (withdrawn == 0 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(10ms);
      });
  EXPECT_EQ(error, "");
  EXPECT_EQ(withdrawn, 1) << "rank 0 did not withdraw its notice for the receive answered eagerly";
}

// A receiver that posts less than a large send carries (only a broken or hostile peer
// can: a rank checks the sizes first) fails the send, naming both sizes; nothing hangs.
// The notice arrives before the send is posted, and after.
TEST(CommFailure, AReadyNoticeSmallerThanTheSendFailsIt) {
  for (const auto delay : {0ms, 300ms}) {
    const std::string error = against_a_hand_played_rank1(
        [&](int fd) {
          std::this_thread::sleep_for(delay);
          const uint64_t data_slot = (uint64_t(6) << 56);  // wire.h: kP2PData, send #0, segment 0
          const std::string ready = frame(kReadyFrame, data_slot, 0, 1000);
          ASSERT_EQ(send(fd, ready.data(), ready.size(), MSG_NOSIGNAL), 40);
        },
        [](Communicator& c) {
          auto t = at::ones({100'000});  // 400,000 bytes: receiver-driven, waits for the ready notice
          c.send(t, 1)->wait();
        });
    EXPECT_NE(error.find("send #0 to rank 1"), std::string::npos) << "delay " << delay.count() << " ms: " << error;
    EXPECT_NE(error.find("rank 1 posted a receive of 1000 bytes for a send of 400000"), std::string::npos)
        << "delay " << delay.count() << " ms: " << error;
  }
}

// Connections from strangers during the rendezvous (garbage, a truncated hello, a
// hello with another job's token or another protocol version, 200 damaged copies
// of the hello rank 1 sends) are refused and logged; the ranks still meet and
// compute the right sum.
TEST(CommFailure, StrangersAtTheRendezvousAreRefused) {
  const int port = testing::free_port();
  std::atomic<bool> strangers_done{false};
  std::vector<at::Tensor> sums(2);
  auto errors = run_ranks(3, [&](int r) {
    if (r == 2) {  // the strangers
      RawPeer peer(port);
      auto stranger = [&](const std::string& bytes) {
        const int fd = peer.connect_to_rank0();
        ASSERT_EQ(send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL), static_cast<ssize_t>(bytes.size()));
        std::this_thread::sleep_for(2ms);
        close(fd);
      };
      std::mt19937_64 random(7);
      std::string garbage(300, '\0');
      for (auto& ch : garbage) ch = static_cast<char>(random());
      stranger(garbage);
      stranger(hello(kMagic, kVersion, 1, 2, 0).substr(0, 10));       // truncated
      stranger(hello(kMagic, kVersion, 1, 2, random()));               // another job's token
      stranger(hello(kMagic, kVersion - 1, 1, 2, peer.token()));       // another protocol version
      stranger(hello(kMagic, kVersion, 5, 9, peer.token()) + garbage);  // this job's token, another world
      // 200 damaged copies of the hello rank 1 will send: bytes changed, or cut short.
      const std::string valid = hello(kMagic, kVersion, 1, 2, peer.token());
      for (int i = 0; i < 200; ++i) {
        std::string damaged = valid;
        if (i % 2 == 0) {
          for (int k = 0, n = 1 + static_cast<int>(random() % 4); k < n; ++k)
            damaged[random() % damaged.size()] ^= static_cast<char>(1 + random() % 255);
        } else {
          damaged.resize(random() % valid.size());
        }
        if (damaged != valid) stranger(damaged);
      }
      strangers_done = true;
      return;
    }
    if (r == 1) {
      while (!strangers_done) std::this_thread::sleep_for(10ms);
    }
    auto c = init_communicator(thread_env(r, 2, port), patient());
    sums[r] = at::full({1000}, static_cast<float>(r + 1));
    c->all_reduce(sums[r], ReduceOp::kSum)->wait();
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
  for (int r : {0, 1}) EXPECT_TRUE(sums[r].equal(at::full({1000}, 3.0f))) << sums[r];
}

TEST(CommFailure, ShortWaitTimesOutSayingWhatItWaitsFor) {
  const int port = testing::free_port();
  auto errors = run_ranks(2, [&](int r) {
    CommOptions opt;
    opt.timeout = 30s;
    auto c = init_communicator(thread_env(r, 2, port), opt);
    auto t = at::ones({100000});
    if (r == 1) std::this_thread::sleep_for(800ms);  // rank 1 is late
    auto w = c->all_reduce(t, ReduceOp::kSum);
    if (r == 0) {
      EXPECT_FALSE(w->is_completed());
      try {
        w->wait(100ms);
        ADD_FAILURE() << "wait(100ms) returned although rank 1 had not arrived";
      } catch (const c10::Error& e) {
        const std::string msg = e.what_without_backtrace();
        EXPECT_NE(msg.find("all_reduce #0 on rank 0 of 2 did not complete within 100 ms"), std::string::npos) << msg;
        EXPECT_NE(msg.find("waiting for header of rank(s) [1]"), std::string::npos) << msg;
      }
    }
    w->wait();  // the operation itself goes on and completes
    EXPECT_TRUE(w->is_completed());
    EXPECT_EQ(t[0].item<float>(), 2.0f);
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

TEST(CommFailure, RecvOfTheWrongSizeIsNamed) {
  const int port = testing::free_port();
  auto errors = run_ranks(2, [&](int r) {
    CommOptions opt;
    opt.timeout = 1500ms;
    opt.rendezvous_timeout = 60s;  // threads may start slowly on a loaded machine
    auto c = init_communicator(thread_env(r, 2, port), opt);
    if (r == 0) {
      c->send(at::ones({10000}), 1)->wait();  // larger than what rides inside the header
    } else {
      auto t = at::zeros({12000});
      c->recv(t, 0)->wait();
    }
  });
  EXPECT_NE(errors[1].find("recv #0 from rank 0 on rank 1 of 2: rank 0 sent 10000 elements of Float but "
                           "this rank's tensor has 12000 elements of Float"),
            std::string::npos)
      << errors[1];
  // The sender is not left hanging: its send fails within the timeout, naming the receiver.
  EXPECT_NE(errors[0].find("send #0 to rank 1"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("[1]"), std::string::npos) << errors[0];
}

TEST(CommFailure, RendezvousNamesRanksThatNeverJoined) {
  const int port = testing::free_port();
  auto errors = run_ranks(2, [&](int r) {
    CommOptions opt;
    opt.rendezvous_timeout = 4000ms;  // long enough for rank 0's store to start on a busy machine
    init_communicator(thread_env(r, 3, port), opt);  // rank 2 of 3 never starts
  });
  for (int r : {0, 1}) {
    EXPECT_NE(errors[r].find("rendezvous timed out after 4000 ms"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("[2]"), std::string::npos) << errors[r];
  }
}

// Rank 0 serves the store. When its rendezvous fails it keeps serving it (up to the rendezvous
// timeout, at most 10 s) until the other ranks have read why: a rank that arrives after the
// failure learns the cause instead of finding no store to connect to.
TEST(CommFailure, ARankThatArrivesAfterTheRendezvousFailedLearnsWhy) {
  const int port = testing::free_port();
  auto errors = run_ranks(2, [&](int r) {
    CommOptions opt;
    if (r == 0) {
      opt.rendezvous_timeout = 2000ms;  // rank 2 of 3 never starts: rank 0 gives up after 2 s, serves on until 4 s
    } else {
      // Rank 1 arrives once rank 0 has recorded the failure in its store (which serves on).
      RawPeer peer(port);
      const auto deadline = std::chrono::steady_clock::now() + 30s;
      while (!peer.store->check({"zs/failed"}) && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(10ms);
      }
      ASSERT_TRUE(peer.store->check({"zs/failed"})) << "rank 0's rendezvous did not fail in 30 s";
      opt.rendezvous_timeout = 60000ms;
    }
    init_communicator(thread_env(r, 3, port), opt);
  });
  EXPECT_NE(errors[0].find("rendezvous timed out after 2000 ms"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("rendezvous abandoned: rank 0 on host "), std::string::npos) << errors[1];
  EXPECT_NE(errors[1].find("rendezvous timed out after 2000 ms"), std::string::npos) << errors[1];
  EXPECT_NE(errors[1].find("[1, 2]"), std::string::npos) << errors[1];
}

TEST(CommFailure, PortInUseSaysWhatToSet) {
  // Hold a listening socket on the port rank 0 is told to serve.
  const int port = testing::free_port();
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  CommOptions opt;
  opt.rendezvous_timeout = 1000ms;
  try {
    init_communicator(thread_env(0, 2, port), opt);
    ADD_FAILURE() << "rank 0 served a store on a port in use";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("cannot serve the rendezvous store"), std::string::npos) << msg;
    EXPECT_NE(msg.find("MASTER_PORT"), std::string::npos) << msg;
  }
  close(fd);
}

// Arguments are checked when an op is issued, on one rank, before anything moves.
class CommValidation : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { comm_ = init_communicator(DistEnv{}, CommOptions{}); }
  static void TearDownTestSuite() { comm_.reset(); }
  static std::string error_of(const std::function<void()>& f) {
    try {
      f();
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    return "";
  }
  static std::shared_ptr<Communicator> comm_;
};
std::shared_ptr<Communicator> CommValidation::comm_;

TEST_F(CommValidation, WrongSizesNameTheRelation) {
  auto msg = error_of([] { comm_->all_gather(at::zeros({5}), at::zeros({4})); });
  EXPECT_NE(msg.find("all_gather: out.numel() is 5 but must be size() * in.numel() = 1 * 4 = 4"),
            std::string::npos)
      << msg;
  msg = error_of([] { comm_->reduce_scatter(at::zeros({2}), at::zeros({3}), ReduceOp::kSum); });
  EXPECT_NE(msg.find("reduce_scatter: in.numel() is 3 but must be size() * out.numel()"), std::string::npos)
      << msg;
}

TEST_F(CommValidation, DtypeDeviceLayoutProblemsAreNamed) {
  auto msg = error_of([] { comm_->all_gather(at::zeros({4}), at::zeros({4}, at::kHalf)); });
  EXPECT_NE(msg.find("`out` has dtype Float but `in` has Half"), std::string::npos) << msg;
  msg = error_of([] { comm_->all_reduce(at::zeros({4, 4}).t(), ReduceOp::kSum); });
  EXPECT_NE(msg.find("`t` (sizes [4, 4], strides [1, 4]) is not contiguous"), std::string::npos) << msg;
  msg = error_of([] { comm_->all_reduce(at::zeros({4}, at::kBool), ReduceOp::kSum); });
  EXPECT_NE(msg.find("has dtype Bool"), std::string::npos) << msg;
  msg = error_of([] { comm_->all_reduce(at::Tensor(), ReduceOp::kSum); });
  EXPECT_NE(msg.find("undefined tensor"), std::string::npos) << msg;
  msg = error_of([] {
    auto buf = at::zeros({8});
    comm_->reduce_scatter(buf, buf, ReduceOp::kSum);
  });
  EXPECT_NE(msg.find("`out` overlaps `in`"), std::string::npos) << msg;
}

TEST_F(CommValidation, PeersAndRootsMustBeRanks) {
  auto msg = error_of([] { comm_->broadcast(at::zeros({4}), 3); });
  EXPECT_NE(msg.find("broadcast: root 3 is not a rank of this communicator (size 1)"), std::string::npos) << msg;
  msg = error_of([] { comm_->send(at::zeros({4}), 0); });
  EXPECT_NE(msg.find("send: dst 0 must be another rank"), std::string::npos) << msg;
  msg = error_of([] { comm_->split({0, 0}); });
  EXPECT_NE(msg.find("strictly ascending"), std::string::npos) << msg;
}

TEST_F(CommValidation, SingleRankCollectivesAreLocal) {
  auto t = testing::pattern(0, 100, at::kFloat);
  auto want = t.clone();
  comm_->all_reduce(t, ReduceOp::kAvg)->wait();
  EXPECT_TRUE(t.equal(want));
  auto out = at::zeros({100});
  comm_->all_gather(out, t)->wait();
  EXPECT_TRUE(out.equal(want));
  comm_->barrier();
  EXPECT_EQ(comm_->stats().total().bytes_sent, 0);
}

// Environment protocol: torchrun first, then Slurm, then Open MPI.
class DistEnvTest : public ::testing::Test {
 protected:
  void SetUp() override { clear(); }
  void TearDown() override { clear(); }
  static void clear() {
    for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                          "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                          "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                          "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "ZS_RESTART_COUNT",
                          "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE"})
      unsetenv(v);
  }
  static std::string error_of() {
    const auto msg = testing::error_of([] { read_dist_env(); });
    return msg == "(no error)" ? "" : msg;
  }
};

TEST_F(DistEnvTest, TorchrunVariables) {
  setenv("RANK", "3", 1);
  setenv("WORLD_SIZE", "8", 1);
  setenv("LOCAL_RANK", "1", 1);
  setenv("LOCAL_WORLD_SIZE", "2", 1);
  setenv("MASTER_ADDR", "node0", 1);
  setenv("MASTER_PORT", "1234", 1);
  setenv("ZS_RESTART_COUNT", "2", 1);
  auto e = read_dist_env();
  EXPECT_EQ(e.source, "torchrun");
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_EQ(e.master_addr, "node0");
  EXPECT_EQ(e.master_port, 1234);
  EXPECT_EQ(e.restart_count, 2);
  EXPECT_FALSE(e.agent_store);
}

// torchrun's own variables: its restart count (when zeroshard-run's is absent) and
// its agent's store, of which rank 0 is a client too.
TEST_F(DistEnvTest, TorchrunAgentStoreAndRestarts) {
  setenv("RANK", "0", 1);
  setenv("WORLD_SIZE", "2", 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", "29400", 1);
  setenv("TORCHELASTIC_RESTART_COUNT", "1", 1);
  setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);
  auto e = read_dist_env();
  EXPECT_EQ(e.restart_count, 1);
  EXPECT_TRUE(e.agent_store);
  setenv("ZS_RESTART_COUNT", "3", 1);  // zeroshard-run's wins
  setenv("TORCHELASTIC_USE_AGENT_STORE", "False", 1);
  e = read_dist_env();
  EXPECT_EQ(e.restart_count, 3);
  EXPECT_FALSE(e.agent_store);
  setenv("TORCHELASTIC_RESTART_COUNT", "x", 1);
  unsetenv("ZS_RESTART_COUNT");
  EXPECT_NE(error_of().find("TORCHELASTIC_RESTART_COUNT='x'"), std::string::npos) << error_of();
}

TEST_F(DistEnvTest, SlurmAndOpenMpiFallbacks) {
  setenv("SLURM_PROCID", "5", 1);
  setenv("SLURM_NTASKS", "6", 1);
  setenv("SLURM_LOCALID", "1", 1);
  setenv("SLURM_NTASKS_PER_NODE", "2(x3)", 1);
  setenv("MASTER_ADDR", "h", 1);
  setenv("MASTER_PORT", "999", 1);
  auto e = read_dist_env();
  EXPECT_EQ(e.source, "slurm");
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 6);
  EXPECT_EQ(e.local_world_size, 2);
  clear();
  setenv("OMPI_COMM_WORLD_RANK", "2", 1);
  setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "1", 1);
  setenv("MASTER_ADDR", "h", 1);
  setenv("MASTER_PORT", "999", 1);
  e = read_dist_env();
  EXPECT_EQ(e.source, "openmpi");
  EXPECT_EQ(e.rank, 2);
  EXPECT_EQ(e.world_size, 4);
  clear();
  e = read_dist_env();
  EXPECT_EQ(e.source, "single");
  EXPECT_EQ(e.world_size, 1);
}

TEST_F(DistEnvTest, MalformedOrMissingVariablesSayWhatToSet) {
  setenv("RANK", "abc", 1);
  setenv("WORLD_SIZE", "2", 1);
  EXPECT_NE(error_of().find("RANK='abc' is not an integer"), std::string::npos) << error_of();
  setenv("RANK", "2", 1);
  EXPECT_NE(error_of().find("rank 2 (from torchrun variables) is not below the world size 2"),
            std::string::npos)
      << error_of();
  setenv("RANK", "1", 1);
  EXPECT_NE(error_of().find("needs MASTER_ADDR and MASTER_PORT"), std::string::npos) << error_of();
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", "99999", 1);
  EXPECT_NE(error_of().find("MASTER_PORT='99999' is not a TCP port"), std::string::npos) << error_of();
  unsetenv("WORLD_SIZE");
  EXPECT_NE(error_of().find("only one of RANK and WORLD_SIZE is set"), std::string::npos) << error_of();
}

// init_nccl is declared in every build; one without CUDA refuses it, saying why.
TEST(CommCuda, CudaEnabledSaysWhetherInitNcclWorks) {
#ifdef ZS_WITH_CUDA
  EXPECT_TRUE(cuda_enabled());
#else
  EXPECT_FALSE(cuda_enabled());
  const auto what = testing::error_of([] { init_nccl(nullptr, c10::Device(c10::kCUDA, 0)); });
  EXPECT_NE(what.find("init_nccl: this zeroshard was built without CUDA and NCCL"), std::string::npos) << what;
#endif
}

}  // namespace failure_test
}  // namespace zeroshard
