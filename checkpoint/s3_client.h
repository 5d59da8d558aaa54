// s3_client.h — an S3 client for checkpoints: objects under one bucket and
// prefix (s3://bucket/prefix) on AWS S3 or any S3-compatible store (GCS's S3
// interface, MinIO, Ceph, SeaweedFS, R2).
//
// Requests are libcurl's, signed with its SigV4 (http.h); settings and
// credentials come from the AWS conventions (s3_credentials.h). Every request
// is bounded in time (connect, stall, and overall by its size) and retried, with exponential
// backoff and full jitter, on what is worth retrying: no response, a timeout,
// 5xx, 503 SlowDown, 429, S3's RequestTimeout; credentials the store calls
// expired are fetched again once. Retries of one request are bounded in count
// and in time; what remains is an error naming the request, the object and the
// store's own code, never a credential. Large files go up as multipart uploads
// and come down as ranged GETs, `parallel` parts at a time. cancel() ends every
// request in flight at once (a job that is ending must not wait on a stalled store).
//
// Thread-safe: any number of threads may use one Client.
#pragma once

#include "http.h"
#include "s3_credentials.h"

#include <boost/asio/thread_pool.hpp>
#include <pugixml.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace zeroshard::ckpt::s3 {

// s3://bucket/prefix: the prefix without leading or trailing '/', possibly empty.
struct Location {
  std::string bucket, prefix;
  std::string uri() const;                         // s3://bucket/prefix
  std::string key(const std::string& name) const;  // prefix/name
};
bool is_uri(const std::string& text);
// Throws, naming the text and the expected form, unless it is s3://BUCKET[/PREFIX]
// with a valid bucket name.
Location parse_uri(const std::string& uri);

struct ClientOptions {
  // Attempts per request, and the time all attempts of one request may take. Default: 10, 3 minutes.
  int max_attempts = 10;
  std::chrono::milliseconds max_retry_time{180000};
  // Backoff before attempt k (k >= 1): uniform in [0, min(cap, base * 2^(k-1))]. Default: 200 ms, 20 s.
  std::chrono::milliseconds backoff_base{200};
  std::chrono::milliseconds backoff_cap{20000};
  // Files larger than this go up in parts of this size (more when 10,000 parts would not hold
  // them). Default: 32 MiB.
  int64_t part_bytes = int64_t{32} << 20;
  // Parts in flight per upload or download. Default: 8.
  int parallel = 8;
  http::Limits limits;  // each request (http.h's defaults; `total` is set per attempt, below)
  // Each attempt's overall limit: `request_time` plus its bytes (the body sent, or the range asked
  // for) at `slowest_bytes_per_second`, so that a store trickling data just above the stall limit
  // cannot hold one request for hours. Default: 60 s plus 1 MiB/s (a 32 MiB part: 92 s).
  std::chrono::milliseconds request_time{60000};
  int64_t slowest_bytes_per_second = int64_t{1} << 20;
  CredentialOptions credentials;
};

struct ObjectInfo {
  std::string name;  // relative to the location's prefix
  int64_t size = 0;
  std::string etag;
};

class Client {
 public:
  // Reads the settings and prepares the credential chain; contacts nothing (check_access does).
  Client(Location location, Environment env, ClientOptions options = {});
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  const Location& location() const { return location_; }
  // "s3://bucket/prefix at ENDPOINT (region R, credentials from SOURCE)", for messages.
  std::string describe();

  // Lists under the prefix, puts and deletes a probe object. Throws one line naming
  // what is wrong and the fix: an unreachable endpoint, a wrong key or secret, a
  // missing bucket, a bucket in another region, missing permissions, a store that
  // ignores If-None-Match (a second conditional put of the probe must be refused).
  void check_access();

  // `name`s are relative to the location's prefix.
  void put(const std::string& name, const std::string& bytes);
  // A conditional put (If-None-Match: *): false, writing nothing, when `name` exists.
  bool put_if_absent(const std::string& name, const std::string& bytes);
  // The file at `path` as `name` (multipart above part_bytes); with `if_absent` as
  // put_if_absent. `progress` (optional) is called with each part's bytes once sent.
  bool upload_file(const std::string& name, const std::string& path, bool if_absent = false,
                   const std::function<void(int64_t)>& progress = {});
  // The whole object; nullopt when it does not exist.
  std::optional<std::string> get(const std::string& name);
  // `size` bytes from `offset` into `out`. Throws when the object is shorter.
  void get_range(const std::string& name, int64_t offset, int64_t size, char* out);
  // Several ranges of one object, `parallel` GETs at a time (a range larger than
  // part_bytes in parts of it); throws the first failure once none is in flight.
  // Returns the GETs it took (retries not counted).
  struct Range {
    int64_t offset = 0, size = 0;
    char* out = nullptr;
  };
  int64_t get_ranges(const std::string& name, const std::vector<Range>& ranges);
  // The object into the file at `path` (created or truncated), `parallel` ranges at a time; returns its size.
  // `xxh3` (optional): the file's xxh3, hashed as its ranges land in order (read back while later
  // ranges still download), as checksum.h's digest_file() would give.
  int64_t download_file(const std::string& name, const std::string& path, uint64_t* xxh3 = nullptr);
  std::optional<ObjectInfo> head(const std::string& name);
  // Objects whose names start with `name_prefix`, in key order (every page).
  std::vector<ObjectInfo> list(const std::string& name_prefix);
  // "Directories" directly under `name_prefix` (ListObjectsV2 with delimiter '/'), as names ending in '/'.
  std::vector<std::string> list_directories(const std::string& name_prefix);
  // The objects directly under `name_prefix` (not in its "directories"), in key order.
  std::vector<ObjectInfo> list_here(const std::string& name_prefix);
  void remove(const std::string& name);  // absent objects included
  // Every object under `name_prefix`, and the unfinished multipart uploads there.
  void remove_all(const std::string& name_prefix);
  // An unfinished multipart upload: its object's name (relative to the prefix) and its id.
  struct Upload {
    std::string name, id;
  };
  // The unfinished multipart uploads whose names start with `name_prefix` (every page).
  std::vector<Upload> uploads(const std::string& name_prefix);
  void abort_upload(const Upload& u);  // an upload already gone included

  // Ends every request in flight now (each throws "... cancelled: the job is ending"; within
  // about a second: libcurl polls its progress callback that often when nothing moves), and
  // the retries of every later one: a later request gets one attempt, and all of them end
  // within `linger` of this call (the best-effort last words of a job that is ending: an
  // upload aborted, a failure reported); after it, a request throws without being sent.
  // Thread-safe; a second call changes nothing.
  void cancel(std::chrono::milliseconds linger);
  bool cancelled() const { return cancelled_; }

  // Requests sent (retries included) and retried, since construction.
  int64_t requests() const { return requests_; }
  int64_t retries() const { return retries_; }

 private:
  struct Target;
  // Sends the request `build` makes (for the current credentials) until it gets
  // an answer that is not worth retrying, or attempts or time run out (throws,
  // naming `what`). Returns the last response.
  // `slow_answer`: a request the store may hold open for minutes while it works, sending only
  // whitespace (CompleteMultipartUpload): no stall limit, 15 minutes at least overall.
  http::Response send(const std::string& what, const std::function<http::Request()>& build, bool slow_answer = false);
  std::string url(const std::string& key, const std::string& query = "") const;
  // list() (every object under `name_prefix`) or, with `here`, list_here().
  std::vector<ObjectInfo> objects(const std::string& name_prefix, bool here);
  std::string bucket_url(const std::string& query) const;
  // Throws for a response other than 2xx (or 404 when `allow_404`), naming `what` and the store's code.
  void expect_ok(const http::Response& r, const std::string& what, bool allow_404 = false) const;
  // ListObjectsV2 under `name_prefix` (with `directories`: delimiter '/'), every page
  // passed to `page` as its ListBucketResult node.
  void list_pages(const std::string& name_prefix, bool directories,
                  const std::function<void(const pugi::xml_node& result)>& page);
  bool multipart_upload(const std::string& key, const std::string& path, int64_t size, bool if_absent,
                        const std::function<void(int64_t)>& progress);
  // multipart_upload()'s steps: the upload's id; every part's ETag; the
  // completion (false: `if_absent` and the object exists).
  std::string start_multipart(const std::string& key, const std::string& object);
  std::vector<std::string> upload_parts(const std::string& key, const std::string& id_query, const std::string& object,
                                        const std::string& path, int64_t size,
                                        const std::function<void(int64_t)>& progress);
  bool complete_multipart(const std::string& key, const std::string& id_query, const std::string& object,
                          const std::vector<std::string>& etags, bool if_absent);
  // Runs f(i) for i in [0, n) on the pool, `parallel` at a time; rethrows the first error.
  void parallel_for(int64_t n, const std::function<void(int64_t)>& f);

  Location location_;
  ClientOptions options_;
  CredentialChain credentials_;
  std::string endpoint_;  // scheme://host[:port], no trailing '/'
  bool path_style_;
  std::atomic<int64_t> requests_{0}, retries_{0};
  std::atomic<bool> cancelled_{false};
  std::atomic<std::chrono::steady_clock::rep> last_words_until_{0};  // set before cancelled_
  std::unique_ptr<boost::asio::thread_pool> pool_;
};

// An answer as text for an error: "HTTP 503 SlowDown: <the store's message>",
// or why there was none; never a credential.
std::string error_text(const http::Response& r);
// The code of an S3 error body ("" when the body is not one).
std::string error_code(const std::string& body);

}  // namespace zeroshard::ckpt::s3
