// http.h — one HTTP(S) request through libcurl, bounded in time: the transport of
// the object-store client (s3_client.h) and of its credential sources (the
// instance metadata service, STS).
//
// Every request has a connect timeout, a stall limit (a transfer that moves
// fewer than `low_speed_bytes` per second for `stall` is abandoned) and an
// optional overall limit, so no request can hang; and it can be cancelled from
// another thread while in flight (Request::cancelled). HTTPS verifies the server
// against the system's CA certificates. Signing (SigV4) is libcurl's own.
// Thread-safe: each thread reuses its own curl handle (and so its connections).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace zeroshard::ckpt::http {

struct Limits {
  std::chrono::milliseconds connect{10000};
  // Abandon a transfer slower than this many bytes per second for `stall` (0: never). Default: 1 KiB/s for 30 s.
  int64_t low_speed_bytes = 1024;
  std::chrono::milliseconds stall{30000};
  // The whole request; 0: none beyond the stall limit. Default: none.
  std::chrono::milliseconds total{0};
};

struct Request {
  std::string method = "GET";
  std::string url;
  std::vector<std::string> headers;  // "Name: value"
  // The body of a PUT or POST: `body`, or with `read_body` bytes read on demand
  // (called with an offset into the body, a buffer and its size; returns the bytes
  // it wrote). A retried request reads its body again from the start.
  std::string body;
  int64_t body_size = -1;  // with read_body
  std::function<size_t(int64_t offset, char* buffer, size_t size)> read_body;
  // The response body: kept in Response::body, or, for a 2xx response, passed to
  // `write_body` (offset into the body, the bytes), which returns false to abandon
  // the transfer. Another status's body (the store's error) is kept in Response::body.
  std::function<bool(int64_t offset, const char* data, size_t size)> write_body;
  // SigV4: "aws:amz:REGION:SERVICE" and "KEY:SECRET". Empty: unsigned.
  std::string sigv4;
  std::string user_password;
  // CA certificates for HTTPS: a PEM file; empty: the system's.
  std::string ca_bundle;
  // Never through a proxy (http_proxy, all_proxy, ...): for the instance metadata service,
  // whose answers carry secrets and which only this host can reach. Default: false (libcurl
  // follows the proxy variables and no_proxy).
  bool no_proxy = false;
  // Polled while the request is in flight (whenever data moves, and about once a second when
  // nothing does): true ends it (Response::cancelled). Called on the performing thread. Optional.
  std::function<bool()> cancelled;
};

struct Response {
  long status = 0;           // HTTP status; 0 when no response arrived
  std::string transport_error;  // why no (complete) response arrived: curl's words ("" when one did)
  bool timed_out = false;    // the connect timeout, the stall limit or the overall limit ended it
  bool connected = false;    // a connection to the server was made (it may still not have answered)
  bool cancelled = false;    // Request::cancelled ended it
  std::string body;          // unless Request::write_body took it
  std::map<std::string, std::string> headers;  // response headers, names in lower case
  int64_t body_bytes = 0;    // body bytes received
};

// Performs one request. Never throws for what the network or the server does:
// those land in Response; throws only for a request it cannot make at all.
Response perform(const Request& request, const Limits& limits);

// RFC 3986 percent-encoding of everything but the unreserved characters (and '/'
// when keep_slash), as SigV4 wants URL paths and query values.
std::string uri_encode(const std::string& s, bool keep_slash);

}  // namespace zeroshard::ckpt::http
