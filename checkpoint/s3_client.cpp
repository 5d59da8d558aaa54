// s3_client.cpp — the S3 client: requests sent, retried and checked, and the
// small ones (HEAD, LIST, DELETE); s3_transfer.cpp moves the bytes.
#include "s3_client.h"

#include <c10/util/Exception.h>
#include <pugixml.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <thread>

namespace zeroshard::ckpt::s3 {

namespace {

using Steady = std::chrono::steady_clock;

}  // namespace

std::string error_code(const std::string& body) {
  pugi::xml_document doc;
  if (!doc.load_string(body.c_str())) return "";
  return doc.child("Error").child("Code").text().as_string();
}

std::string error_text(const http::Response& r) {
  if (r.status == 0) return (r.timed_out ? "timed out: " : "no response: ") + r.transport_error;
  pugi::xml_document doc;
  std::string code, message;
  if (doc.load_string(r.body.c_str())) {
    code = doc.child("Error").child("Code").text().as_string();
    message = doc.child("Error").child("Message").text().as_string();
  }
  if (code.empty()) {  // no body (an answer to HEAD, or a proxy's): the status's meaning
    static const std::map<long, std::string> meaning{
        {400, "bad request"}, {403, "forbidden: AccessDenied or a wrong signature"}, {404, "not found"},
        {412, "precondition failed: the object exists"}, {429, "too many requests"}, {500, "internal error"},
        {502, "bad gateway"}, {503, "service unavailable: SlowDown"}, {504, "gateway timeout"}};
    auto it = meaning.find(r.status);
    if (it != meaning.end()) code = "(" + it->second + ")";
  }
  return "HTTP " + std::to_string(r.status) + (code.empty() ? "" : " " + code) + (message.empty() ? "" : ": " + message);
}

namespace {

// Why `r` is worth another attempt ("" when it is final).
std::string retry_reason(const http::Response& r) {
  if (r.status == 0) return error_text(r);
  if (r.status >= 500 || r.status == 429 || r.status == 408) return error_text(r);
  if (r.status == 400 && error_code(r.body) == "RequestTimeout") return error_text(r);
  // The bytes the store received do not match the body's Content-MD5: damaged on the way, sent again.
  if (r.status == 400 && error_code(r.body) == "BadDigest") return error_text(r);
  // A conditional write racing another operation on the key (S3: "retry the request").
  if (r.status == 409 && error_code(r.body) == "ConditionalRequestConflict") return error_text(r);
  return "";
}

bool credentials_expired(const http::Response& r) {
  if (r.status != 400 && r.status != 403) return false;
  std::string code = error_code(r.body);
  return code == "ExpiredToken" || code == "TokenRefreshRequired" || code == "InvalidToken" ||
         code == "RequestExpired";
}

double seconds_since(Steady::time_point start) {
  return std::chrono::duration<double>(Steady::now() - start).count();
}

}  // namespace

std::string Location::uri() const { return "s3://" + bucket + (prefix.empty() ? "" : "/" + prefix); }

std::string Location::key(const std::string& name) const { return prefix.empty() ? name : prefix + "/" + name; }

bool is_uri(const std::string& text) { return text.rfind("s3://", 0) == 0; }

Location parse_uri(const std::string& uri) {
  TORCH_CHECK(is_uri(uri), "checkpoint location '", uri, "' is not an S3 URI; expected s3://BUCKET[/PREFIX]");
  std::string rest = uri.substr(5);
  auto slash = rest.find('/');
  Location l;
  l.bucket = rest.substr(0, slash);
  l.prefix = slash == std::string::npos ? "" : rest.substr(slash + 1);
  while (!l.prefix.empty() && l.prefix.back() == '/') l.prefix.pop_back();
  auto inner = [](char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '-'; };
  bool valid = l.bucket.size() >= 3 && l.bucket.size() <= 63 && std::all_of(l.bucket.begin(), l.bucket.end(), inner) &&
               std::isalnum(static_cast<unsigned char>(l.bucket.front())) &&
               std::isalnum(static_cast<unsigned char>(l.bucket.back()));
  TORCH_CHECK(valid, "checkpoint location '", uri, "': '", l.bucket,
              "' is not an S3 bucket name (3 to 63 lowercase letters, digits, '.' and '-'); expected s3://BUCKET[/PREFIX]");
  TORCH_CHECK(l.prefix.find("//") == std::string::npos && (l.prefix.empty() || l.prefix[0] != '/'),
              "checkpoint location '", uri, "': the prefix '", l.prefix, "' has an empty path segment");
  // libcurl resolves '.' and '..' in a request's path but not in a listing's prefix= value: the
  // objects would land under one key and be listed under another.
  for (size_t at = 0; at <= l.prefix.size() && !l.prefix.empty();) {
    const size_t end = std::min(l.prefix.find('/', at), l.prefix.size());
    const std::string segment = l.prefix.substr(at, end - at);
    TORCH_CHECK(segment != "." && segment != "..", "checkpoint location '", uri, "': the prefix '", l.prefix,
                "' has a '", segment, "' segment; fix: write the prefix without it");
    at = end + 1;
  }
  return l;
}

Client::Client(Location location, Environment env, ClientOptions options)
    : location_(std::move(location)),
      options_(options),
      credentials_(std::move(env), options.credentials),
      pool_(std::make_unique<boost::asio::thread_pool>(static_cast<size_t>(std::max(1, options.parallel)))) {
  const auto& s = credentials_.settings();
  endpoint_ = s.s3_endpoint;
  path_style_ = !endpoint_.empty() || location_.bucket.find('.') != std::string::npos;
  if (endpoint_.empty()) endpoint_ = "https://s3." + s.region + ".amazonaws.com";
  TORCH_CHECK(endpoint_.rfind("http://", 0) == 0 || endpoint_.rfind("https://", 0) == 0, "S3 endpoint '", endpoint_,
              "' (AWS_ENDPOINT_URL or the profile's endpoint_url) is not an http:// or https:// URL");
}

Client::~Client() {
  pool_->join();
}

std::string Client::describe() {
  const std::string source = credentials_.source();
  return location_.uri() + " at " + endpoint_ + " (region " + credentials_.settings().region +
         (source.empty() ? "" : ", credentials from " + source) + ")";
}

std::string Client::bucket_url(const std::string& query) const {
  std::string base = path_style_ ? endpoint_ + "/" + location_.bucket
                                 : "https://" + location_.bucket + ".s3." + credentials_.settings().region + ".amazonaws.com";
  return base + "/" + (query.empty() ? "" : "?" + query);
}

std::string Client::url(const std::string& key, const std::string& query) const {
  std::string base = bucket_url("");
  return base + http::uri_encode(key, true) + (query.empty() ? "" : "?" + query);
}

namespace {

// The bytes one attempt moves: its body, or the range it asks for (0: not known, a whole GET's).
int64_t payload_bytes(const http::Request& r) {
  int64_t bytes = r.read_body ? r.body_size : static_cast<int64_t>(r.body.size());
  for (const auto& h : r.headers) {
    long long first = 0, last = -1;
    if (std::sscanf(h.c_str(), "Range: bytes=%lld-%lld", &first, &last) == 2 && last >= first) {
      bytes = std::max<int64_t>(bytes, last - first + 1);
    }
  }
  return bytes;
}

}  // namespace

void Client::cancel(std::chrono::milliseconds linger) {
  if (cancelled_) return;
  last_words_until_ = (Steady::now() + linger).time_since_epoch().count();
  cancelled_ = true;
}

http::Response Client::send(const std::string& what, const std::function<http::Request()>& build, bool slow_answer) {
  thread_local std::mt19937_64 random(std::random_device{}());
  auto start = Steady::now();
  bool refreshed = false;
  for (int attempt = 1;; ++attempt) {
    // After cancel(): one attempt, ending by the linger's end (not cancelled itself: a job's last words).
    const bool last_words = cancelled_;
    const auto linger_left = std::chrono::duration_cast<std::chrono::milliseconds>(
        Steady::duration(last_words_until_.load()) - Steady::now().time_since_epoch());
    TORCH_CHECK(!last_words || (attempt == 1 && linger_left.count() > 0), "S3: ", what, " cancelled: the job is ending");
    Credentials c = credentials_.get();
    http::Request r = build();
    r.ca_bundle = credentials_.settings().ca_bundle;
    r.sigv4 = "aws:amz:" + credentials_.settings().region + ":s3";
    r.user_password = c.access_key_id + ":" + c.secret_access_key;
    r.headers.push_back("x-amz-content-sha256: UNSIGNED-PAYLOAD");  // libcurl signs it; AWS requires it
    if (!c.session_token.empty()) r.headers.push_back("x-amz-security-token: " + c.session_token);
    if (!last_words) r.cancelled = [this] { return cancelled_.load(); };
    http::Limits limits = options_.limits;
    limits.total = last_words ? linger_left
                              : options_.request_time + std::chrono::milliseconds(
                                    payload_bytes(r) * 1000 / std::max<int64_t>(1, options_.slowest_bytes_per_second));
    if (slow_answer && !last_words) {
      limits.low_speed_bytes = 0;  // libcurl: no stall limit
      limits.total = std::max<std::chrono::milliseconds>(limits.total, std::chrono::minutes(15));
    }
    ++requests_;
    http::Response resp = http::perform(r, limits);
    TORCH_CHECK(!resp.cancelled, "S3: ", what, " cancelled: the job is ending");
    std::string why = retry_reason(resp);
    if (why.empty() && credentials_expired(resp) && !refreshed) {
      credentials_.expire(c.access_key_id);  // fetched again from their source by the next attempt
      refreshed = true;
      why = error_text(resp) + " (credentials fetched again)";
    }
    if (why.empty()) return resp;
    double elapsed = seconds_since(start);
    auto budget = std::chrono::duration<double>(options_.max_retry_time).count();
    TORCH_CHECK(attempt < options_.max_attempts && elapsed < budget && !last_words, "S3: ", what, " failed after ",
                attempt, " attempt(s) in ", static_cast<int>(elapsed + 0.5), " s: ", why);
    double cap = std::min(std::chrono::duration<double>(options_.backoff_cap).count(),
                          std::chrono::duration<double>(options_.backoff_base).count() * std::pow(2.0, attempt - 1));
    double wait = std::uniform_real_distribution<double>(0, cap)(random);
    wait = std::min(wait, std::max(0.0, budget - elapsed));
    const auto until = Steady::now() + std::chrono::duration_cast<Steady::duration>(std::chrono::duration<double>(wait));
    while (!cancelled_ && Steady::now() < until) {  // the backoff, cut short by cancel()
      std::this_thread::sleep_for(std::min<Steady::duration>(until - Steady::now(), std::chrono::milliseconds(50)));
    }
    TORCH_CHECK(!cancelled_, "S3: ", what, " cancelled: the job is ending (after ", attempt, " attempt(s): ", why, ")");
    ++retries_;
  }
}

void Client::expect_ok(const http::Response& r, const std::string& what, bool allow_404) const {
  if ((r.status >= 200 && r.status < 300) || (allow_404 && r.status == 404)) return;
  TORCH_CHECK(false, "S3: ", what, ": ", error_text(r));
}

void Client::check_access() {
  const std::string source = credentials_.get().source;  // a source that fails says why itself
  const std::string where = describe();
  http::Response r;
  try {
    r = send("list " + location_.uri(), [&] {
      http::Request q;
      q.url = bucket_url("list-type=2&max-keys=1&prefix=" + http::uri_encode(location_.key(""), false));
      return q;
    });
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "S3: cannot reach ", where, ": ", e.what_without_backtrace(),
                "; fix: check AWS_ENDPOINT_URL (or the network, or the region)");
  }
  std::string code = error_code(r.body);
  TORCH_CHECK(r.status != 403 || code != "InvalidAccessKeyId", "S3: ", where, " does not know the access key ID from ",
              source, "; fix: use a key of this store (AWS_ACCESS_KEY_ID or the profile)");
  TORCH_CHECK(r.status != 403 || code != "SignatureDoesNotMatch", "S3: ", where,
              " rejects the signature: the secret key from ", source,
              " does not belong to its access key ID; fix: correct AWS_SECRET_ACCESS_KEY (or the profile)");
  TORCH_CHECK(r.status != 403, "S3: the credentials from ", source, " may not list ", where, " (HTTP 403 ", code,
              "); fix: grant s3:ListBucket, s3:GetObject, s3:PutObject, s3:DeleteObject and "
              "s3:AbortMultipartUpload on the bucket and prefix");
  TORCH_CHECK(r.status != 404, "S3: bucket '", location_.bucket, "' does not exist at ", where, " (", error_text(r),
              "); fix: create it, or correct the URI");
  TORCH_CHECK(r.status != 301 && r.status != 307 && !(r.status == 400 && code == "AuthorizationHeaderMalformed"), "S3: ",
              where, ": the bucket is in another region",
              r.headers.count("x-amz-bucket-region") ? " (" + r.headers.at("x-amz-bucket-region") + ")" : std::string(),
              "; fix: set AWS_REGION to it");
  expect_ok(r, "list " + where);
  // Writing and deleting: a probe of this process's own name, put twice with If-None-Match: * (the
  // commit's one-writer guard): the second must be refused, or the store ignores the condition.
  std::string probe = ".zeroshard-probe-" + std::to_string(::getpid()) + "-" +
                      std::to_string(Steady::now().time_since_epoch().count());
  bool honoured = false;
  try {
    put(probe, "probe");
    honoured = !put_if_absent(probe, "probe again");
    remove(probe);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "S3: the credentials from ", source, " may list but not write and delete under ", where, ": ",
                e.what_without_backtrace(), "; fix: grant s3:PutObject and s3:DeleteObject there");
  }
  TORCH_CHECK(honoured, "S3: ", where, " ignores If-None-Match: a conditional put of an object that exists ",
              "succeeded, so two writers of one checkpoint step could both commit it and the step would mix their ",
              "files; fix: use a store that honours conditional writes (AWS S3 since August 2024, a MinIO release ",
              "of 2024 or later, SeaweedFS)");
}

std::optional<ObjectInfo> Client::head(const std::string& name) {
  std::string key = location_.key(name);
  std::string what = "HEAD " + location_.bucket + "/" + key;
  auto r = send(what, [&] {
    http::Request q;
    q.method = "HEAD";
    q.url = url(key);
    return q;
  });
  if (r.status == 404) return std::nullopt;
  expect_ok(r, what);
  ObjectInfo info{name, 0, r.headers.count("etag") ? r.headers.at("etag") : ""};
  TORCH_CHECK(r.headers.count("content-length"), "S3: ", what, ": the answer has no Content-Length");
  info.size = std::stoll(r.headers.at("content-length"));
  return info;
}

void Client::list_pages(const std::string& name_prefix, bool directories,
                        const std::function<void(const pugi::xml_node& result)>& page) {
  std::string token;
  do {
    // Query parameters in SigV4's canonical (sorted) order.
    std::string query = (token.empty() ? "" : "continuation-token=" + http::uri_encode(token, false) + "&") +
                        (directories ? "delimiter=%2F&" : "") + "list-type=2&prefix=" +
                        http::uri_encode(location_.key(name_prefix), false);
    std::string what = "list " + location_.uri() + "/" + name_prefix;
    auto r = send(what, [&] {
      http::Request q;
      q.url = bucket_url(query);
      return q;
    });
    expect_ok(r, what);
    pugi::xml_document doc;
    TORCH_CHECK(doc.load_string(r.body.c_str()), "S3: ", what, ": the answer is not XML");
    auto result = doc.child("ListBucketResult");
    page(result);
    token = result.child("IsTruncated").text().as_bool() ? result.child("NextContinuationToken").text().as_string() : "";
  } while (!token.empty());
}

std::vector<ObjectInfo> Client::list(const std::string& name_prefix) { return objects(name_prefix, false); }

std::vector<ObjectInfo> Client::list_here(const std::string& name_prefix) { return objects(name_prefix, true); }

std::vector<ObjectInfo> Client::objects(const std::string& name_prefix, bool here) {
  std::vector<ObjectInfo> out;
  const std::string strip = location_.key("");
  list_pages(name_prefix, here, [&](const pugi::xml_node& result) {
    for (auto c : result.children("Contents")) {
      std::string key = c.child("Key").text().as_string();
      out.push_back({key.substr(std::min(strip.size(), key.size())), c.child("Size").text().as_llong(),
                     c.child("ETag").text().as_string()});
    }
  });
  return out;
}

std::vector<std::string> Client::list_directories(const std::string& name_prefix) {
  std::vector<std::string> out;
  const std::string strip = location_.key("");
  list_pages(name_prefix, true, [&](const pugi::xml_node& result) {
    for (auto c : result.children("CommonPrefixes")) {
      std::string key = c.child("Prefix").text().as_string();
      out.push_back(key.substr(std::min(strip.size(), key.size())));
    }
  });
  return out;
}

void Client::remove(const std::string& name) {
  std::string key = location_.key(name);
  std::string what = "DELETE " + location_.bucket + "/" + key;
  auto r = send(what, [&] {
    http::Request q;
    q.method = "DELETE";
    q.url = url(key);
    return q;
  });
  expect_ok(r, what, /*allow_404=*/true);
}

void Client::remove_all(const std::string& name_prefix) {
  auto objects = list(name_prefix);
  parallel_for(static_cast<int64_t>(objects.size()), [&](int64_t i) { remove(objects[static_cast<size_t>(i)].name); });
  // Unfinished multipart uploads hold storage (and cost) until aborted.
  for (const auto& u : uploads(name_prefix)) abort_upload(u);
}

std::vector<Client::Upload> Client::uploads(const std::string& name_prefix) {
  std::vector<Upload> out;
  const std::string strip = location_.key("");
  std::string key_marker, id_marker;
  bool more = true;
  while (more) {
    // Query parameters in SigV4's canonical (sorted) order.
    const std::string query =
        (key_marker.empty() ? "" : "key-marker=" + http::uri_encode(key_marker, false) + "&") + "prefix=" +
        http::uri_encode(location_.key(name_prefix), false) + "&" +
        (id_marker.empty() ? "" : "upload-id-marker=" + http::uri_encode(id_marker, false) + "&") + "uploads=";
    const std::string what = "list the multipart uploads under " + location_.uri() + "/" + name_prefix;
    auto r = send(what, [&] {
      http::Request q;
      q.url = bucket_url(query);
      return q;
    });
    expect_ok(r, what);
    pugi::xml_document doc;
    TORCH_CHECK(doc.load_string(r.body.c_str()), "S3: ", what, ": the answer is not XML");
    const auto result = doc.child("ListMultipartUploadsResult");
    for (auto u : result.children("Upload")) {
      const std::string key = u.child("Key").text().as_string();
      out.push_back({key.substr(std::min(strip.size(), key.size())), u.child("UploadId").text().as_string()});
    }
    key_marker = result.child("NextKeyMarker").text().as_string();
    id_marker = result.child("NextUploadIdMarker").text().as_string();
    more = result.child("IsTruncated").text().as_bool() && !key_marker.empty();
  }
  return out;
}

void Client::abort_upload(const Upload& u) {
  const std::string key = location_.key(u.name), what = "abort the multipart upload of " + location_.bucket + "/" + key;
  auto a = send(what, [&] {
    http::Request q;
    q.method = "DELETE";
    q.url = url(key, "uploadId=" + http::uri_encode(u.id, false));
    return q;
  });
  expect_ok(a, what, /*allow_404=*/true);
}

}  // namespace zeroshard::ckpt::s3
