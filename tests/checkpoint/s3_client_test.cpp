// The durable tier's S3 client against a real store: SeaweedFS, started by
// tests/checkpoint/s3_store.py around this program (ctest's s3_client), with its
// fault proxy and fake credential services. Oracles: the bytes put are the bytes
// got; the store's own answers (403 for a wrong signature, 412 for a second
// conditional put); the fake services' log of what they were asked.
#include "checksum.h"
#include "http.h"
#include "s3_client.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>

namespace zeroshard::ckpt::s3 {
namespace {

using namespace std::chrono_literals;
using testing::error_of;

std::string env_or_fail(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) {
    ADD_FAILURE() << name << " is not set: run this suite under tests/checkpoint/s3_store.py (ctest's s3_client does)";
    return "";
  }
  return v;
}

// A prefix no other test (or earlier run) uses.
Location fresh(const std::string& tag) {
  static std::atomic<int> n{0};
  return {env_or_fail("ZS_TEST_S3_BUCKET"), "s3-client-test/" + tag + "-" + std::to_string(::getpid()) + "-" +
                                                std::to_string(n++)};
}

std::string random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(g());
  return s;
}

std::string write_file(const std::string& dir, const std::string& name, const std::string& bytes) {
  std::string path = dir + "/" + name;
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return path;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// The fake services' control endpoints (s3_store.py).
std::string control(const std::string& path, const std::string& body = "") {
  http::Request r;
  r.method = body.empty() ? "GET" : "POST";
  r.url = env_or_fail("ZS_TEST_FAKE_AWS") + path;
  r.body = body;
  auto resp = http::perform(r, {});
  EXPECT_EQ(resp.status, 200) << path << ": " << resp.transport_error << resp.body;
  return resp.body;
}

int count_of(const std::string& log, const std::string& needle) {
  int n = 0;
  for (size_t at = log.find(needle); at != std::string::npos; at = log.find(needle, at + 1)) ++n;
  return n;
}

Environment store_env() { return process_environment(); }

// The store's environment with the fault proxy as its endpoint (s3_store.py's /control/faults).
Environment proxy_env() {
  auto env = store_env();
  env["AWS_ENDPOINT_URL"] = env_or_fail("ZS_TEST_S3_PROXY");
  return env;
}

// The store's environment without credentials of its own, HOME at `home`.
Environment no_credentials(const std::string& home) {
  auto env = store_env();
  for (const char* v : {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                        "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"}) {
    env.erase(v);
  }
  env["HOME"] = home;
  return env;
}

// The chain of `env` finds credentials from `source` (a part of its description), and the store
// takes them: an object put with them reads back.
Credentials works_with(const Environment& env, const std::string& source, CredentialOptions options = {}) {
  CredentialChain chain(env, options);
  Credentials got = chain.get();
  EXPECT_NE(got.source.find(source), std::string::npos) << got.source;
  ClientOptions o;
  o.credentials = options;
  Client c(fresh("chain"), env, o);
  c.put("x", source);
  EXPECT_EQ(c.get("x").value(), source);
  EXPECT_NE(c.describe().find("credentials from " + got.source), std::string::npos) << c.describe();
  c.remove_all("");
  return got;
}

TEST(S3Client, PutGetHeadRangeListAndRemove) {
  Client c(fresh("basic"), store_env());
  c.check_access();
  std::string a = random_bytes(1000, 1), b = random_bytes(3, 2);
  c.put("step-1/a.bin", a);
  c.put("step-1/sub/b.bin", b);
  c.put("step-2/a.bin", a);
  EXPECT_EQ(c.get("step-1/a.bin").value(), a);
  EXPECT_FALSE(c.get("step-1/missing").has_value());
  EXPECT_EQ(c.head("step-1/a.bin")->size, 1000);
  EXPECT_FALSE(c.head("nothing").has_value());
  std::string range(100, '\0');
  c.get_range("step-1/a.bin", 900, 100, range.data());
  EXPECT_EQ(range, a.substr(900));
  EXPECT_NE(error_of([&] { c.get_range("step-1/a.bin", 950, 100, range.data()); }), "(no error)");
  auto listed = c.list("step-1/");
  ASSERT_EQ(listed.size(), 2u);
  EXPECT_EQ(listed[0].name, "step-1/a.bin");
  EXPECT_EQ(listed[1].name, "step-1/sub/b.bin");
  EXPECT_EQ(listed[1].size, 3);
  EXPECT_EQ(c.list_directories(""), (std::vector<std::string>{"step-1/", "step-2/"}));
  c.remove("step-2/a.bin");
  c.remove("step-2/a.bin");  // absent: not an error
  EXPECT_TRUE(c.list("step-2/").empty());  // (SeaweedFS may still list the empty "directory")
  c.remove_all("");
  EXPECT_TRUE(c.list("").empty());
}

// A body read that fails (read_file_range's error: a file that shrank, a disk
// gone) ends the request with that error as its transport error: it does not
// pass through libcurl's C frames, and it does not read as a short body.
TEST(S3Client, AFailingBodyReadEndsTheRequestSayingWhy) {
  http::Request r;
  r.method = "PUT";
  r.url = env_or_fail("ZS_TEST_FAKE_AWS") + "/a-body-that-fails";
  r.body_size = 1 << 20;
  r.read_body = [](int64_t offset, char*, size_t) -> size_t {
    throw std::runtime_error("reading 'rank-0.h5' at byte " + std::to_string(offset) + " failed: Input/output error");
  };
  const auto resp = http::perform(r, {});
  EXPECT_EQ(resp.status, 0);
  EXPECT_NE(resp.transport_error.find("reading the body: reading 'rank-0.h5' at byte 0 failed: Input/output error"),
            std::string::npos)
      << resp.transport_error;
}

TEST(S3Client, LargeFilesGoUpInParallelPartsAndComeDownInRanges) {
  ClientOptions o;
  o.part_bytes = 5 << 20;  // S3's smallest part
  o.parallel = 4;
  Client c(fresh("multipart"), store_env(), o);
  std::string dir = testing::make_temp_dir("s3-multipart");
  std::string bytes = random_bytes((21 << 20) + 12345, 3);
  std::string path = write_file(dir, "rank.h5", bytes);
  int64_t reported = 0;
  int64_t before = c.requests();
  ASSERT_TRUE(c.upload_file("rank.h5", path, false, [&](int64_t n) { reported += n; }));
  // One request to start, five parts, one to complete (no retries on a quiet store).
  EXPECT_EQ(c.requests() - before - c.retries(), 7);
  EXPECT_EQ(reported, static_cast<int64_t>(bytes.size()));
  EXPECT_EQ(c.head("rank.h5")->size, static_cast<int64_t>(bytes.size()));
  EXPECT_EQ(c.download_file("rank.h5", dir + "/back.h5"), static_cast<int64_t>(bytes.size()));
  EXPECT_TRUE(read_file(dir + "/back.h5") == bytes);
  // Hashed as its five parts land (in any order, on parallel connections): xxh3 of the bytes.
  uint64_t xxh3 = 0;
  EXPECT_EQ(c.download_file("rank.h5", dir + "/hashed.h5", &xxh3), static_cast<int64_t>(bytes.size()));
  EXPECT_EQ(xxh3, checkpoint::digest_bytes(bytes.data(), bytes.size()));
  EXPECT_TRUE(read_file(dir + "/hashed.h5") == bytes);
  std::string middle(7 << 20, '\0');  // a range across parts
  c.get_range("rank.h5", (3 << 20) + 7, static_cast<int64_t>(middle.size()), middle.data());
  EXPECT_TRUE(middle == bytes.substr((3 << 20) + 7, middle.size()));
  c.remove_all("");
  std::filesystem::remove_all(dir);
}

// The commit's primitive: a conditional put (If-None-Match: *) writes only where nothing is,
// plain and multipart. Writers one after another: which of several concurrent ones wins is
// the store's own atomicity (SeaweedFS once let 2 of 8 concurrent conditional multipart
// completes through on a loaded machine); the commit has one writer per step.
TEST(S3Client, AConditionalPutWritesOnlyWhereNothingIs) {
  ClientOptions o;
  o.part_bytes = 5 << 20;
  o.parallel = 2;
  Client c(fresh("commit"), store_env(), o);
  std::string dir = testing::make_temp_dir("s3-commit");
  for (bool multipart : {false, true}) {
    std::string name = multipart ? "manifest-multipart" : "manifest.json";
    std::vector<std::string> paths;
    for (int w = 0; w < 3; ++w) {
      paths.push_back(write_file(dir, "w" + std::to_string(w), random_bytes(multipart ? (6 << 20) : 100, 10 + w)));
    }
    auto attempt = [&](int w) {
      return multipart ? c.upload_file(name, paths[w], /*if_absent=*/true) : c.put_if_absent(name, read_file(paths[w]));
    };
    EXPECT_TRUE(attempt(0)) << name << ": nothing there yet";
    EXPECT_FALSE(attempt(1)) << name << ": the second writer must not replace the first's";
    EXPECT_FALSE(attempt(2)) << name;
    EXPECT_FALSE(c.put_if_absent(name, "late")) << name;
    EXPECT_TRUE(c.get(name).value() == read_file(paths[0])) << name << ": the first writer's bytes";
  }
  // A 409 ConditionalRequestConflict (a conditional write that raced another operation on the key)
  // is retried, not taken for "the object exists".
  auto proxied = store_env();
  proxied["AWS_ENDPOINT_URL"] = env_or_fail("ZS_TEST_S3_PROXY");
  ClientOptions quick;
  quick.backoff_base = 10ms;
  Client p(c.location(), proxied, quick);
  control("/control/faults", "409 2");
  EXPECT_TRUE(p.put_if_absent("after-conflicts", "written")) << "two 409s, then the store's own answer";
  EXPECT_EQ(p.retries(), 2);
  EXPECT_EQ(c.get("after-conflicts").value_or(""), "written");
  c.remove_all("");
  std::filesystem::remove_all(dir);
}

TEST(S3Client, AWrongKeySecretBucketOrEndpointFailsAtStartInOneLine) {
  auto one_line = [](const std::string& m) { return m.find('\n') == std::string::npos; };
  ClientOptions quick;
  quick.max_retry_time = 3s;
  quick.backoff_base = 50ms;
  quick.limits.connect = 1000ms;
  {
    auto env = store_env();
    env["AWS_SECRET_ACCESS_KEY"] = "not-the-secret-1234";
    Client c(fresh("wrong-secret"), env, quick);
    std::string m = error_of([&] { c.check_access(); });
    EXPECT_NE(m.find("secret key"), std::string::npos) << m;
    EXPECT_EQ(m.find("not-the-secret-1234"), std::string::npos) << "a secret in a message: " << m;
    EXPECT_TRUE(one_line(m)) << m;
  }
  {
    auto env = store_env();
    env["AWS_ACCESS_KEY_ID"] = "NOSUCHKEY";
    Client c(fresh("wrong-key"), env, quick);
    std::string m = error_of([&] { c.check_access(); });
    EXPECT_NE(m.find("does not know the access key ID"), std::string::npos) << m;
    EXPECT_TRUE(one_line(m)) << m;
  }
  {
    Client c({"no-such-bucket-zs", "p"}, store_env(), quick);
    std::string m = error_of([&] { c.check_access(); });
    EXPECT_NE(m.find("bucket 'no-such-bucket-zs' does not exist"), std::string::npos) << m;
    EXPECT_TRUE(one_line(m)) << m;
  }
  {
    auto env = store_env();
    env["AWS_ENDPOINT_URL"] = "http://127.0.0.1:" + std::to_string(testing::free_port());  // nothing listens
    Client c(fresh("no-endpoint"), env, quick);
    auto start = std::chrono::steady_clock::now();
    std::string m = error_of([&] { c.check_access(); });
    EXPECT_NE(m.find("cannot reach"), std::string::npos) << m;
    EXPECT_NE(m.find("AWS_ENDPOINT_URL"), std::string::npos) << m;
    EXPECT_TRUE(one_line(m)) << m;
    EXPECT_LT(std::chrono::steady_clock::now() - start, 10s) << "bounded by max_retry_time";
  }
  {
    auto env = store_env();
    env["AWS_ACCESS_KEY_ID"] = "readkey";
    env["AWS_SECRET_ACCESS_KEY"] = "readsecret";
    Client c(fresh("read-only"), env, quick);
    std::string m = error_of([&] { c.check_access(); });
    EXPECT_NE(m.find("may list but not write"), std::string::npos) << m;
    EXPECT_TRUE(one_line(m)) << m;
  }
  {  // a store that ignores If-None-Match (the proxy answers a conditional put 200 itself, writing nothing)
    auto env = proxy_env();
    Client c(fresh("no-conditions"), env, quick);
    c.check_access();  // the proxy forwards everything: the store refuses the second put
    control("/control/faults", "ignore-conditions-all");
    std::string m = error_of([&] { c.check_access(); });
    control("/control/faults", "pass");
    EXPECT_NE(m.find("ignores If-None-Match"), std::string::npos) << m;
    EXPECT_TRUE(one_line(m)) << m;
  }
  EXPECT_NE(error_of([] { parse_uri("s3://Bad_Bucket/x"); }).find("is not an S3 bucket name"), std::string::npos);
  for (const char* dots : {"s3://ckpt/d/./x", "s3://ckpt/d/../x", "s3://ckpt/..", "s3://ckpt/a/."}) {
    const std::string m = error_of([&] { parse_uri(dots); });
    EXPECT_NE(m.find("segment; fix: write the prefix without it"), std::string::npos) << dots << ": " << m;
  }
  EXPECT_EQ(parse_uri("s3://ckpt/a.b/..c/x").prefix, "a.b/..c/x");
  EXPECT_NE(error_of([] { parse_uri("/local/dir"); }).find("expected s3://BUCKET[/PREFIX]"), std::string::npos);
  auto l = parse_uri("s3://ckpt/runs/bart/");
  EXPECT_EQ(l.bucket, "ckpt");
  EXPECT_EQ(l.prefix, "runs/bart");
  EXPECT_EQ(l.uri(), "s3://ckpt/runs/bart");
}

// Through the fault proxy: 503 SlowDown and a stalled connection are retried; too many fail naming the cause.
TEST(S3Client, SlowDownAndStalledRequestsAreRetriedWithinBounds) {
  auto env = proxy_env();
  ClientOptions o;
  o.backoff_base = 20ms;
  o.limits.stall = 1000ms;  // a request that moves nothing for a second is abandoned
  o.limits.low_speed_bytes = 1;
  Client c(fresh("faults"), env, o);
  control("/control/faults", "503 3");
  c.put("a", "after three SlowDowns");
  EXPECT_EQ(c.retries(), 3);
  EXPECT_EQ(c.get("a").value(), "after three SlowDowns");
  control("/control/faults", "stall 1");
  auto start = std::chrono::steady_clock::now();
  c.put("b", "after a stall");
  EXPECT_EQ(c.retries(), 4);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
  EXPECT_EQ(c.get("b").value(), "after a stall");

  ClientOptions few = o;
  few.max_attempts = 4;
  Client d(fresh("faults-exhausted"), env, few);
  control("/control/faults", "503 10");
  std::string m = error_of([&] { d.put("c", "never"); });
  EXPECT_NE(m.find("failed after 4 attempt(s)"), std::string::npos) << m;
  EXPECT_NE(m.find("SlowDown"), std::string::npos) << m;
  control("/control/faults", "pass");
  std::string log = control("/control/log");
  EXPECT_GE(count_of(log, "\"503\""), 3 + 4) << log;
  EXPECT_GE(count_of(log, "\"stall\""), 1) << log;
  c.remove_all("");
}

// cancel() ends a request the store never answers at once (the stall limit is 30 s here), and
// one it trickles through (the proxy at 4 KiB/s, above the stall limit); later requests get one
// attempt each, all ending by the linger's end, and none is sent after it. Without cancel(),
// each attempt's overall limit ends a trickle.
TEST(S3Client, CancelEndsStalledAndTricklingRequestsAndEachAttemptHasADeadline) {
  auto env = proxy_env();
  auto cancelled_after = [&](const std::string& fault, const std::function<void(Client&)>& request) {
    Client c(fresh("cancel"), env, {});
    control("/control/faults", fault);
    std::string m;
    std::atomic<bool> done{false};
    std::thread t([&] {
      m = error_of([&] { request(c); });
      done = true;
    });
    std::this_thread::sleep_for(1500ms);
    EXPECT_FALSE(done) << fault << ": " << m;
    const auto t0 = std::chrono::steady_clock::now();
    c.cancel(4000ms);
    t.join();
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_NE(m.find("cancelled: the job is ending"), std::string::npos) << fault << ": " << m;
    control("/control/faults", "pass");
    // Last words: one attempt, and it goes through when the store answers.
    c.put("last-words", "said");
    EXPECT_EQ(c.get("last-words").value(), "said");
    control("/control/faults", "stall 1");
    std::string last = error_of([&] { c.put("unsaid", "never"); });
    const double lingered = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_NE(last.find("failed after 1 attempt(s)"), std::string::npos) << last;
    EXPECT_NE(last.find("timed out"), std::string::npos) << last;
    EXPECT_LT(lingered, 4.5) << last;  // the stalled attempt ended with the linger
    // It may end a few milliseconds before the linger does (its limit is whole milliseconds): a
    // request then still has those to run in. Past the linger's end, none is sent.
    std::this_thread::sleep_until(t0 + 4000ms + 50ms);
    const int64_t sent = c.requests();
    std::string after = error_of([&] { c.put("unsent", "never"); });
    EXPECT_NE(after.find("cancelled: the job is ending"), std::string::npos) << after;
    EXPECT_EQ(c.requests(), sent);
    control("/control/faults", "pass");
    Client(c.location(), env, {}).remove_all("");
    return took;
  };
  EXPECT_LT(cancelled_after("stall 1", [](Client& c) { c.put("stalled", "never answered"); }), 2.0);
  const std::string big = random_bytes(256 << 10, 9);  // 64 s at the trickle
  EXPECT_LT(cancelled_after("trickle 1", [&](Client& c) { c.put("trickled", big); }), 2.0);

  ClientOptions o;
  o.request_time = 2000ms;  // each attempt: 2 s plus its bytes at 1 MiB/s
  o.max_attempts = 2;
  o.backoff_base = 10ms;
  Client d(fresh("deadline"), env, o);
  control("/control/faults", "trickle-all");
  const auto t0 = std::chrono::steady_clock::now();
  std::string m = error_of([&] { d.put("trickled", big); });
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  control("/control/faults", "pass");
  EXPECT_NE(m.find("failed after 2 attempt(s)"), std::string::npos) << m;
  EXPECT_NE(m.find("timed out"), std::string::npos) << m;
  EXPECT_LT(took, 8.0) << m;
  d.put("after", "the store is well again");
  EXPECT_EQ(d.get("after").value(), "the store is well again");
  d.remove_all("");
}

TEST(S3Client, AnUploadSurvivesTheStoreKilledAndRestartedMidway) {
  ClientOptions o;
  o.part_bytes = 5 << 20;
  o.parallel = 2;
  o.backoff_base = 100ms;
  o.backoff_cap = 1000ms;
  Client c(fresh("restart"), store_env(), o);
  std::string dir = testing::make_temp_dir("s3-restart");
  std::string bytes = random_bytes(60 << 20, 4);
  std::string path = write_file(dir, "rank.h5", bytes);
  std::atomic<int64_t> sent{0};
  std::atomic<bool> killed{false};
  pid_t store = std::stoi(env_or_fail("ZS_TEST_S3_STORE_PID"));
  std::thread killer([&] {
    while (sent < (10 << 20)) std::this_thread::sleep_for(5ms);
    ::kill(store, SIGUSR1);  // kill -9 and start again, same data
    killed = true;
  });
  bool ok = false;
  std::string m = error_of([&] { ok = c.upload_file("rank.h5", path, false, [&](int64_t n) { sent += n; }); });
  killer.join();
  EXPECT_EQ(m, "(no error)");
  EXPECT_TRUE(ok);
  EXPECT_TRUE(killed);
  EXPECT_GT(c.retries(), 0) << "the restart fell between two parts";
  EXPECT_EQ(c.download_file("rank.h5", dir + "/back.h5"), static_cast<int64_t>(bytes.size()));
  EXPECT_TRUE(read_file(dir + "/back.h5") == bytes);
  c.remove_all("");
  std::filesystem::remove_all(dir);
}

// CompleteMultipartUpload as S3 may answer it: 200 with an InternalError body (retried, not
// fatal), and an answer lost after the store completed the upload (the retry's NoSuchUpload is
// checked against the object, which has the upload's parts). Through the fault proxy: the
// start and 3 parts pass, then the complete meets the fault.
TEST(S3Client, ACompleteThatFailsLateOrLosesItsAnswerIsNotAFailedUpload) {
  auto env = proxy_env();
  ClientOptions o;
  o.part_bytes = 5 << 20;
  o.parallel = 1;
  o.backoff_base = 10ms;
  Client c(fresh("complete"), env, o);
  const std::string dir = testing::make_temp_dir("s3-complete");
  const std::string bytes = random_bytes(12 << 20, 21);  // 3 parts
  const std::string path = write_file(dir, "rank.h5", bytes);
  for (const char* fault : {"200-error", "lose-answer"}) {
    control("/control/faults", std::string("pass 4; ") + fault + " 1");
    const int64_t before = c.retries();
    bool ok = false;
    const std::string m = error_of([&] { ok = c.upload_file(std::string("rank-") + fault, path); });
    EXPECT_EQ(m, "(no error)") << fault;
    EXPECT_TRUE(ok) << fault;
    EXPECT_GE(c.retries(), before + 1) << fault;
    EXPECT_EQ(c.download_file(std::string("rank-") + fault, dir + "/back"), static_cast<int64_t>(bytes.size()));
    EXPECT_TRUE(read_file(dir + "/back") == bytes) << fault;
  }
  control("/control/faults", "pass");
  const std::string log = control("/control/log");
  EXPECT_EQ(count_of(log, "\"200-error\""), 1) << log;
  EXPECT_EQ(count_of(log, "\"lose-answer\""), 1) << log;
  c.remove_all("");
  std::filesystem::remove_all(dir);
}

// Each source of the chain, with the fake services handing out identity "other".
TEST(S3Client, CredentialsComeFromEachSourceOfTheChain) {
  std::string home = testing::make_temp_dir("s3-home");
  const auto base = no_credentials(home);
  auto works = [](const Environment& env, const std::string& source) { return works_with(env, source); };
  // Nothing anywhere: every source named.
  {
    std::string m = error_of([&] { CredentialChain(base).get(); });
    for (const char* s : {"environment", "web identity", "profile 'default'", "container", "instance metadata"}) {
      EXPECT_NE(m.find(s), std::string::npos) << s << " in: " << m;
    }
  }
  // Environment.
  {
    auto env = base;
    env["AWS_ACCESS_KEY_ID"] = "otherkey";
    env["AWS_SECRET_ACCESS_KEY"] = "othersecret";
    works(env, "environment");
    env.erase("AWS_SECRET_ACCESS_KEY");
    EXPECT_NE(error_of([&] { CredentialChain(env).get(); }).find("AWS_SECRET_ACCESS_KEY is not"), std::string::npos);
  }
  // A session token is sent, signed, and never shown (the store refuses it: it is not one of its own STS's).
  {
    auto env = proxy_env();
    env["AWS_SESSION_TOKEN"] = "session-token-1234";
    ClientOptions once;
    once.max_attempts = 1;
    Client c(fresh("token"), env, once);
    std::string m = error_of([&] { c.put("x", "y"); });
    EXPECT_NE(m.find("HTTP 403"), std::string::npos) << m;
    EXPECT_EQ(m.find("session-token-1234"), std::string::npos) << "a token in a message: " << m;
    EXPECT_NE(control("/control/log").find("x-amz-security-token"), std::string::npos) << "not among the signed headers";
  }
  // Profiles: the credentials file, the config file, a profile that does not exist.
  std::filesystem::create_directories(home + "/.aws");
  std::ofstream(home + "/.aws/credentials") << "# comment\n[default]\naws_access_key_id = testkey\n"
                                               "aws_secret_access_key = testsecret\n\n[ci]\n"
                                               "aws_access_key_id=otherkey\naws_secret_access_key=othersecret\n";
  std::ofstream(home + "/.aws/config") << "[profile cfg]\nregion = us-east-1\naws_access_key_id = otherkey\n"
                                          "aws_secret_access_key = othersecret\ns3 =\n  max_concurrent_requests = 20\n";
  works(base, "profile 'default'");
  {
    auto env = base;
    env["AWS_PROFILE"] = "ci";
    EXPECT_EQ(works(env, "profile 'ci'").access_key_id, "otherkey");
    env["AWS_PROFILE"] = "cfg";
    works(env, "profile 'cfg'");
    env["AWS_PROFILE"] = "nope";
    EXPECT_NE(error_of([&] { CredentialChain c(env); }).find("AWS_PROFILE=nope names a profile"), std::string::npos);
  }
  std::filesystem::remove(home + "/.aws/credentials");
  std::filesystem::remove(home + "/.aws/config");
  // A web identity exchanged with STS.
  {
    auto env = base;
    std::string token_file = home + "/token";
    std::ofstream(token_file) << env_or_fail("ZS_TEST_WEB_IDENTITY_TOKEN") << "\n";
    env["AWS_WEB_IDENTITY_TOKEN_FILE"] = token_file;
    env["AWS_ROLE_ARN"] = "arn:aws:iam::123456789012:role/ckpt";
    env["AWS_ENDPOINT_URL_STS"] = env_or_fail("ZS_TEST_FAKE_AWS");
    auto got = works(env, "web identity");
    EXPECT_TRUE(got.expiration.has_value());
    EXPECT_NE(control("/control/log").find("sts arn:aws:iam::123456789012:role/ckpt zeroshard"), std::string::npos);
    std::ofstream(token_file) << "not-the-token";
    std::string m = error_of([&] { CredentialChain(env).get(); });
    EXPECT_NE(m.find("InvalidIdentityToken"), std::string::npos) << m;
    EXPECT_EQ(m.find("not-the-token"), std::string::npos) << "a token in a message: " << m;
  }
  // The instance metadata service (IMDSv2), with temporary credentials refreshed before they expire.
  {
    auto env = base;
    env.erase("AWS_EC2_METADATA_DISABLED");
    env["AWS_EC2_METADATA_SERVICE_ENDPOINT"] = env_or_fail("ZS_TEST_FAKE_AWS");
    works(env, "instance metadata");
    {  // never through a proxy: its answers are secrets (the proxy here leads nowhere)
      setenv("http_proxy", "http://127.0.0.1:1", 1);
      const std::string m = error_of([&] { CredentialChain(env).get(); });
      unsetenv("http_proxy");
      EXPECT_EQ(m, "(no error)");
    }
    {  // a refused request's credentials are fetched again, not ones another thread fetched since
      CredentialChain chain(env);
      const auto first = chain.get();
      const int before = count_of(control("/control/log"), "imds credentials");
      chain.expire("not-" + first.access_key_id);
      chain.get();
      EXPECT_EQ(count_of(control("/control/log"), "imds credentials"), before) << "others' expiry expired these";
      chain.expire(first.access_key_id);
      chain.get();
      EXPECT_EQ(count_of(control("/control/log"), "imds credentials"), before + 1);
    }
    CredentialOptions o;
    o.refresh_before = 2s;
    // Expire 5 s after they are handed out, written in whole seconds: 4 to 5 s left at first (kept), 0.5 to 1.5 s
    // left 3.5 s later (refreshed). With 3 s, an expiry rounded down left barely 2 s, and a loaded host refreshed
    // at the second get already.
    control("/control/expiry", "5");
    CredentialChain chain(env, o);
    int before = count_of(control("/control/log"), "imds credentials");
    chain.get();
    chain.get();
    EXPECT_EQ(count_of(control("/control/log"), "imds credentials"), before + 1) << "fresh credentials are kept";
    std::this_thread::sleep_for(3500ms);
    auto again = chain.get();
    EXPECT_EQ(count_of(control("/control/log"), "imds credentials"), before + 2) << "refreshed before expiring";
    EXPECT_GT(*again.expiration, std::chrono::system_clock::now() + 1s);
    control("/control/expiry", "3600");
  }
  std::filesystem::remove_all(home);
}

// The container's credentials (ECS task roles, EKS Pod Identity) come before the instance's role,
// which a pod or task would otherwise act as; the fake endpoint checks the Authorization token.
TEST(S3Client, CredentialsComeFromTheContainerBeforeTheInstance) {
  const std::string home = testing::make_temp_dir("s3-home");
  const std::string fake = env_or_fail("ZS_TEST_FAKE_AWS"), token = env_or_fail("ZS_TEST_CONTAINER_TOKEN");
  auto env = no_credentials(home);
  env.erase("AWS_EC2_METADATA_DISABLED");
  env["AWS_EC2_METADATA_SERVICE_ENDPOINT"] = fake;  // an instance role is there too
  const int imds = count_of(control("/control/log"), "imds credentials");
  // EKS Pod Identity: a full URI and a token file.
  env["AWS_CONTAINER_CREDENTIALS_FULL_URI"] = fake + "/container/credentials";
  std::ofstream(home + "/pod-token") << token << "\n";
  env["AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"] = home + "/pod-token";
  const int container = count_of(control("/control/log"), "container credentials");
  auto got = works_with(env, "container credentials (AWS_CONTAINER_CREDENTIALS_FULL_URI");
  EXPECT_TRUE(got.expiration.has_value());
  EXPECT_NE(got.source.find("role/zeroshard-checkpoints"), std::string::npos) << got.source;
  EXPECT_GE(count_of(control("/control/log"), "container credentials"), container + 1);
  // The token in the environment instead of a file.
  env.erase("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE");
  env["AWS_CONTAINER_AUTHORIZATION_TOKEN"] = token;
  works_with(env, "container credentials");
  // A wrong token: an error naming the endpoint, never the instance's role instead, never the token.
  env["AWS_CONTAINER_AUTHORIZATION_TOKEN"] = "wrong-token-7f3a";
  std::string m = error_of([&] { CredentialChain(env).get(); });
  EXPECT_NE(m.find("container credentials endpoint"), std::string::npos) << m;
  EXPECT_NE(m.find("HTTP 401"), std::string::npos) << m;
  EXPECT_EQ(m.find("7f3a"), std::string::npos) << "a token in a message: " << m;
  env["AWS_CONTAINER_AUTHORIZATION_TOKEN"] = "a\nb";
  m = error_of([&] { CredentialChain(env).get(); });
  EXPECT_NE(m.find("line break"), std::string::npos) << m;
  // ECS: a path on the agent's address (here the fake's).
  env["AWS_CONTAINER_AUTHORIZATION_TOKEN"] = token;
  env.erase("AWS_CONTAINER_CREDENTIALS_FULL_URI");
  env["AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"] = "/container/credentials";
  CredentialOptions agent;
  agent.container_endpoint = fake;
  works_with(env, "container credentials (AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", agent);
  // Plain HTTP to another host would send the credentials in the clear: refused, nothing asked.
  env.erase("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI");
  env["AWS_CONTAINER_CREDENTIALS_FULL_URI"] = "http://192.0.2.1/credentials";
  m = error_of([&] { CredentialChain(env).get(); });
  EXPECT_NE(m.find("plain HTTP to another host"), std::string::npos) << m;
  EXPECT_EQ(count_of(control("/control/log"), "imds credentials"), imds) << "the instance's role was used";
  std::filesystem::remove_all(home);
}

// role_arn in a profile, assumed (STS AssumeRole, its SigV4 signature checked by the fake STS)
// with the credentials of source_profile or credential_source; what cannot work is refused by name.
TEST(S3Client, AProfileAssumesItsRoleWithItsSourceCredentials) {
  const std::string home = testing::make_temp_dir("s3-home");
  const std::string fake = env_or_fail("ZS_TEST_FAKE_AWS");
  std::filesystem::create_directories(home + "/.aws");
  std::ofstream(home + "/.aws/credentials") << "[base]\naws_access_key_id = testkey\naws_secret_access_key = testsecret\n"
                                               "[badsecret]\naws_access_key_id = testkey\n"
                                               "aws_secret_access_key = not-the-secret-9c1d\n";
  const std::string arn = "arn:aws:iam::123456789012:role/";
  std::ofstream(home + "/.aws/config")
      << "[profile ckpt]\nrole_arn = " << arn << "ckpt\nsource_profile = base\nrole_session_name = trainer\n"
      << "external_id = ext-7\n"
      << "[profile chained]\nrole_arn = " << arn << "next\nsource_profile = ckpt\n"
      << "[profile from-env]\nrole_arn = " << arn << "env\ncredential_source = Environment\n"
      << "[profile from-imds]\nrole_arn = " << arn << "imds\ncredential_source = Ec2InstanceMetadata\n"
      << "[profile from-container]\nrole_arn = " << arn << "task\ncredential_source = EcsContainer\n"
      << "[profile wrong-signature]\nrole_arn = " << arn << "ckpt\nsource_profile = badsecret\n"
      << "[profile both]\nrole_arn = " << arn << "x\nsource_profile = base\ncredential_source = Environment\n"
      << "[profile mfa]\nrole_arn = " << arn << "x\nsource_profile = base\nmfa_serial = arn:aws:iam::1:mfa/u\n"
      << "[profile alone]\nrole_arn = " << arn << "x\n"
      << "[profile lambda]\nrole_arn = " << arn << "x\ncredential_source = Lambda\n"
      << "[profile missing]\nrole_arn = " << arn << "x\nsource_profile = nope\n"
      << "[profile loop-a]\nrole_arn = " << arn << "a\nsource_profile = loop-b\n"
      << "[profile loop-b]\nrole_arn = " << arn << "b\nsource_profile = loop-a\n";
  auto env = no_credentials(home);
  env["AWS_ENDPOINT_URL_STS"] = fake;
  auto log = [] { return control("/control/log"); };
  env["AWS_PROFILE"] = "ckpt";
  int before = count_of(log(), "assume-role " + arn + "ckpt trainer by testkey external-id ext-7");
  works_with(env, "assumed role " + arn + "ckpt (profile 'ckpt', with profile 'base'");
  EXPECT_GT(count_of(log(), "assume-role " + arn + "ckpt trainer by testkey external-id ext-7"), before);
  // A role assumed with another role's credentials.
  env["AWS_PROFILE"] = "chained";
  before = count_of(log(), "assume-role " + arn + "next zeroshard by otherkey");
  works_with(env, "assumed role " + arn + "next");
  EXPECT_GT(count_of(log(), "assume-role " + arn + "next zeroshard by otherkey"), before);
  // credential_source: the environment's keys (the role, not the keys themselves), the instance's, the container's.
  env["AWS_PROFILE"] = "from-env";
  env["AWS_ACCESS_KEY_ID"] = "testkey";
  env["AWS_SECRET_ACCESS_KEY"] = "testsecret";
  works_with(env, "assumed role " + arn + "env");
  env.erase("AWS_ACCESS_KEY_ID");
  env.erase("AWS_SECRET_ACCESS_KEY");
  {
    auto imds = env;
    imds["AWS_PROFILE"] = "from-imds";
    imds.erase("AWS_EC2_METADATA_DISABLED");
    imds["AWS_EC2_METADATA_SERVICE_ENDPOINT"] = fake;
    before = count_of(log(), "assume-role " + arn + "imds zeroshard by otherkey");
    works_with(imds, "assumed role " + arn + "imds (profile 'from-imds', with instance metadata");
    EXPECT_GT(count_of(log(), "assume-role " + arn + "imds zeroshard by otherkey"), before);
    auto task = env;
    task["AWS_PROFILE"] = "from-container";
    task["AWS_CONTAINER_CREDENTIALS_FULL_URI"] = fake + "/container/credentials";
    task["AWS_CONTAINER_AUTHORIZATION_TOKEN"] = env_or_fail("ZS_TEST_CONTAINER_TOKEN");
    works_with(task, "assumed role " + arn + "task (profile 'from-container', with container credentials");
  }
  // A signature STS does not accept: its refusal, not the secret.
  env["AWS_PROFILE"] = "wrong-signature";
  std::string m = error_of([&] { CredentialChain(env).get(); });
  EXPECT_NE(m.find("SignatureDoesNotMatch"), std::string::npos) << m;
  EXPECT_EQ(m.find("9c1d"), std::string::npos) << "a secret in a message: " << m;
  // What cannot work, each by name.
  for (const auto& [profile, says] : std::vector<std::pair<std::string, std::string>>{
           {"both", "both source_profile and credential_source"},
           {"mfa", "mfa_serial"},
           {"alone", "role_arn but nothing to assume it with"},
           {"lambda", "credential_source 'Lambda' is not one of"},
           {"missing", "source_profile 'nope' is in neither"},
           {"loop-a", "in a circle"}}) {
    env["AWS_PROFILE"] = profile;
    m = error_of([&] { CredentialChain(env).get(); });
    EXPECT_NE(m.find(says), std::string::npos) << profile << ": " << m;
  }
  std::filesystem::remove_all(home);
}

// A thousand ranks starting at once throttle STS; a slow or failing agent answers 5xx: a fetch
// that may pass is tried again with backoff, and one that keeps failing says so, with the count.
TEST(S3Client, ACredentialFetchThatMayPassIsTriedAgain) {
  const std::string home = testing::make_temp_dir("s3-home");
  const std::string fake = env_or_fail("ZS_TEST_FAKE_AWS");
  auto log = [] { return control("/control/log"); };
  auto env = no_credentials(home);
  std::ofstream(home + "/token") << env_or_fail("ZS_TEST_WEB_IDENTITY_TOKEN") << "\n";
  env["AWS_WEB_IDENTITY_TOKEN_FILE"] = home + "/token";
  env["AWS_ROLE_ARN"] = "arn:aws:iam::123456789012:role/ckpt";
  env["AWS_ENDPOINT_URL_STS"] = fake;
  int throttled = count_of(log(), "sts throttled"), answered = count_of(log(), "sts arn:aws:iam::123456789012:role/ckpt");
  control("/control/service-faults", "throttle 2");
  EXPECT_EQ(error_of([&] { CredentialChain(env).get(); }), "(no error)");
  EXPECT_EQ(count_of(log(), "sts throttled"), throttled + 2);
  EXPECT_EQ(count_of(log(), "sts arn:aws:iam::123456789012:role/ckpt"), answered + 1);
  CredentialOptions three;
  three.service_attempts = 3;
  control("/control/service-faults", "throttle 5");
  std::string m = error_of([&] { CredentialChain(env, three).get(); });
  EXPECT_NE(m.find("Throttling"), std::string::npos) << m;
  EXPECT_NE(m.find("3 attempt(s)"), std::string::npos) << m;
  control("/control/service-faults", "throttle 0");
  // The container agent and the instance metadata service answering 503 once.
  env.erase("AWS_WEB_IDENTITY_TOKEN_FILE");
  env["AWS_CONTAINER_CREDENTIALS_FULL_URI"] = fake + "/container/credentials";
  env["AWS_CONTAINER_AUTHORIZATION_TOKEN"] = env_or_fail("ZS_TEST_CONTAINER_TOKEN");
  throttled = count_of(log(), "container throttled");
  control("/control/service-faults", "throttle 1");
  EXPECT_EQ(error_of([&] { CredentialChain(env).get(); }), "(no error)");
  EXPECT_EQ(count_of(log(), "container throttled"), throttled + 1);
  env.erase("AWS_CONTAINER_CREDENTIALS_FULL_URI");
  env.erase("AWS_EC2_METADATA_DISABLED");
  env["AWS_EC2_METADATA_SERVICE_ENDPOINT"] = fake;
  throttled = count_of(log(), "imds throttled");
  control("/control/service-faults", "throttle 1");
  EXPECT_EQ(error_of([&] { CredentialChain(env).get(); }), "(no error)");
  EXPECT_EQ(count_of(log(), "imds throttled"), throttled + 1);
  control("/control/service-faults", "throttle 0");
  std::filesystem::remove_all(home);
}

// Every upload carries its Content-MD5: bytes damaged on the way (the proxy changes one byte of
// the body) are refused by the store itself (400 BadDigest) and sent again, so what is stored is
// what was sent; without the header the store would keep the damaged bytes.
TEST(S3Client, BytesDamagedOnTheWayAreRefusedByTheStoreAndSentAgain) {
  auto env = proxy_env();
  ClientOptions o;
  o.part_bytes = 5 << 20;
  o.parallel = 2;
  o.backoff_base = 10ms;
  Client c(fresh("damaged"), env, o);
  const std::string dir = testing::make_temp_dir("s3-damaged");
  const std::string small = random_bytes(100000, 11), large = random_bytes((12 << 20) + 7, 12);
  const int refused = count_of(control("/control/log"), "\"corrupt\", 400]");
  control("/control/faults", "corrupt 1");
  c.put("small", small);
  control("/control/faults", "corrupt 1");
  EXPECT_TRUE(c.put_if_absent("conditional", small));
  control("/control/faults", "corrupt 1");
  ASSERT_TRUE(c.upload_file("single", write_file(dir, "single", small), false, nullptr));
  control("/control/faults", "pass 1; corrupt 2");  // two of the three parts, after the start
  ASSERT_TRUE(c.upload_file("parts", write_file(dir, "parts", large), true, nullptr));
  EXPECT_EQ(count_of(control("/control/log"), "\"corrupt\", 400]"), refused + 5) << control("/control/log");
  EXPECT_TRUE(c.get("small").value() == small);
  EXPECT_TRUE(c.get("conditional").value() == small);
  EXPECT_TRUE(c.get("single").value() == small);
  EXPECT_TRUE(c.get("parts").value() == large);
  c.remove_all("");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace zeroshard::ckpt::s3
