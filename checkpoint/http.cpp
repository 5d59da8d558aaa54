// http.cpp — one request through libcurl's easy interface (http.h).
#include "http.h"

#include "zeroshard/log.h"

#include <c10/util/Exception.h>
#include <curl/curl.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <memory>
#include <mutex>

namespace zeroshard::ckpt::http {

namespace {

struct CurlDeleter {
  void operator()(CURL* c) const { curl_easy_cleanup(c); }
};

// This thread's handle: reset for each request, it keeps its connection cache.
CURL* thread_handle() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  thread_local std::unique_ptr<CURL, CurlDeleter> handle(curl_easy_init());
  TORCH_CHECK(handle, "http: curl_easy_init failed (out of memory?)");
  curl_easy_reset(handle.get());
  return handle.get();
}

struct Transfer {
  CURL* handle;
  const Request* request;
  Response* response;
  int64_t sent = 0;
  bool abandoned = false;  // write_body refused the data
  std::string read_error{};  // read_body threw: why
};

size_t on_read(char* buffer, size_t size, size_t count, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const auto& r = *t->request;
  size_t want = size * count;
  size_t n = 0;
  if (r.read_body) {
    want = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(want), r.body_size - t->sent));
    try {
      n = want == 0 ? 0 : r.read_body(t->sent, buffer, want);
    } catch (const std::exception& e) {  // not through libcurl's C frames: the transfer ends, saying why
      t->read_error = error_message(e);
      return CURL_READFUNC_ABORT;
    }
    if (n == 0 && want > 0) return CURL_READFUNC_ABORT;  // the source ended early
  } else {
    n = std::min(want, r.body.size() - static_cast<size_t>(t->sent));
    std::memcpy(buffer, r.body.data() + t->sent, n);
  }
  t->sent += static_cast<int64_t>(n);
  return n;
}

int on_progress(void* user, curl_off_t, curl_off_t, curl_off_t, curl_off_t) {
  auto* t = static_cast<Transfer*>(user);
  if (!t->request->cancelled()) return 0;
  t->response->cancelled = true;
  return 1;  // curl ends the transfer (CURLE_ABORTED_BY_CALLBACK)
}

int on_seek(void* user, curl_off_t offset, int origin) {
  auto* t = static_cast<Transfer*>(user);
  if (origin != SEEK_SET) return CURL_SEEKFUNC_CANTSEEK;
  t->sent = offset;
  return CURL_SEEKFUNC_OK;
}

size_t on_write(char* data, size_t size, size_t count, void* user) {
  auto* t = static_cast<Transfer*>(user);
  size_t n = size * count;
  long status = 0;  // an error's body (its XML) is kept for the caller, not written where the data goes
  curl_easy_getinfo(t->handle, CURLINFO_RESPONSE_CODE, &status);
  if (t->request->write_body && status >= 200 && status < 300) {
    if (!t->request->write_body(t->response->body_bytes, data, n)) {
      t->abandoned = true;
      return 0;  // curl ends the transfer (CURLE_WRITE_ERROR)
    }
  } else {
    t->response->body.append(data, n);
  }
  t->response->body_bytes += static_cast<int64_t>(n);
  return n;
}

size_t on_header(char* data, size_t size, size_t count, void* user) {
  auto* t = static_cast<Transfer*>(user);
  size_t n = size * count;
  std::string line(data, n);
  if (line.rfind("HTTP/", 0) == 0) {  // a new response (after 100 Continue): its headers only
    t->response->headers.clear();
    return n;
  }
  auto colon = line.find(':');
  if (colon == std::string::npos) return n;
  std::string name = line.substr(0, colon);
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
  auto begin = line.find_first_not_of(" \t", colon + 1);
  auto end = line.find_last_not_of(" \t\r\n");
  t->response->headers[name] = begin == std::string::npos || end < begin ? "" : line.substr(begin, end - begin + 1);
  return n;
}

template <typename T>
void set(CURL* c, CURLoption option, T value) {
  CURLcode rc = curl_easy_setopt(c, option, value);
  TORCH_CHECK(rc == CURLE_OK, "http: curl_easy_setopt(", static_cast<int>(option), ") failed: ", curl_easy_strerror(rc),
              " (libcurl ", curl_version_info(CURLVERSION_NOW)->version, " lacks a feature the client needs?)");
}

}  // namespace

Response perform(const Request& request, const Limits& limits) {
  Response response;
  CURL* c = thread_handle();
  Transfer transfer{c, &request, &response};
  set(c, CURLOPT_URL, request.url.c_str());
  set(c, CURLOPT_NOSIGNAL, 1L);
  set(c, CURLOPT_TCP_KEEPALIVE, 1L);
  set(c, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(limits.connect.count()));
  set(c, CURLOPT_LOW_SPEED_LIMIT, static_cast<long>(limits.low_speed_bytes));  // 0: none
  set(c, CURLOPT_LOW_SPEED_TIME, std::max(1L, static_cast<long>((limits.stall.count() + 999) / 1000)));
  if (limits.total.count() > 0) set(c, CURLOPT_TIMEOUT_MS, static_cast<long>(limits.total.count()));
  char error[CURL_ERROR_SIZE] = {0};
  set(c, CURLOPT_ERRORBUFFER, error);
  set(c, CURLOPT_WRITEFUNCTION, on_write);
  set(c, CURLOPT_WRITEDATA, &transfer);
  set(c, CURLOPT_HEADERFUNCTION, on_header);
  set(c, CURLOPT_HEADERDATA, &transfer);
  if (request.cancelled) {
    set(c, CURLOPT_NOPROGRESS, 0L);
    set(c, CURLOPT_XFERINFOFUNCTION, on_progress);
    set(c, CURLOPT_XFERINFODATA, &transfer);
  }

  bool has_body = request.read_body || !request.body.empty();
  int64_t body_size = request.read_body ? request.body_size : static_cast<int64_t>(request.body.size());
  if (request.method == "HEAD") {
    set(c, CURLOPT_NOBODY, 1L);
  } else if (request.method == "PUT") {
    set(c, CURLOPT_UPLOAD, 1L);
    set(c, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(has_body ? body_size : 0));
  } else if (request.method == "POST") {
    set(c, CURLOPT_POST, 1L);
    set(c, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(has_body ? body_size : 0));
    // In memory: given whole, so that SigV4 signs its hash (libcurl cannot hash what a callback reads).
    if (!request.read_body) set(c, CURLOPT_POSTFIELDS, request.body.data());
  } else if (request.method != "GET") {
    set(c, CURLOPT_CUSTOMREQUEST, request.method.c_str());
  }
  if (request.method == "PUT" || (request.method == "POST" && request.read_body)) {
    set(c, CURLOPT_READFUNCTION, on_read);
    set(c, CURLOPT_READDATA, &transfer);
    set(c, CURLOPT_SEEKFUNCTION, on_seek);
    set(c, CURLOPT_SEEKDATA, &transfer);
  }
  struct curl_slist* headers = nullptr;
  auto free_headers = std::unique_ptr<curl_slist, void (*)(curl_slist*)>(nullptr, curl_slist_free_all);
  for (const auto& h : request.headers) headers = curl_slist_append(headers, h.c_str());
  free_headers.reset(headers);
  // No wait for "100 Continue" before a body (a round trip per part). Not by removing the header with
  // "Expect:": libcurl 7.88's SigV4 signs that empty header, which it does not send.
  set(c, CURLOPT_EXPECT_100_TIMEOUT_MS, 0L);
  set(c, CURLOPT_HTTPHEADER, headers);
  if (!request.ca_bundle.empty()) set(c, CURLOPT_CAINFO, request.ca_bundle.c_str());
  if (request.no_proxy) set(c, CURLOPT_NOPROXY, "*");
  if (!request.sigv4.empty()) {
    set(c, CURLOPT_AWS_SIGV4, request.sigv4.c_str());
    set(c, CURLOPT_USERPWD, request.user_password.c_str());
  }

  CURLcode rc = curl_easy_perform(c);
  if (rc == CURLE_OK) {
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &response.status);
  } else {
    response.timed_out = rc == CURLE_OPERATION_TIMEDOUT;
    response.transport_error = response.cancelled             ? "cancelled"
                               : transfer.abandoned            ? "the receiver refused the data"
                               : !transfer.read_error.empty() ? "reading the body: " + transfer.read_error
                                                              : std::string(curl_easy_strerror(rc)) + (error[0] ? std::string(": ") + error : "");
  }  // an incomplete response is no response: status stays 0
  curl_off_t connect_us = 0;
  response.connected = curl_easy_getinfo(c, CURLINFO_CONNECT_TIME_T, &connect_us) == CURLE_OK && connect_us > 0;
  if (!request.user_password.empty()) curl_easy_setopt(c, CURLOPT_USERPWD, "");  // no secret left in the handle
  return response;
}

std::string uri_encode(const std::string& s, bool keep_slash) {
  static const char* hex = "0123456789ABCDEF";
  std::string out;
  out.reserve(s.size());
  for (unsigned char ch : s) {
    if (std::isalnum(ch) || ch == '-' || ch == '_' || ch == '.' || ch == '~' || (keep_slash && ch == '/')) {
      out += static_cast<char>(ch);
    } else {
      out += '%';
      out += hex[ch >> 4];
      out += hex[ch & 15];
    }
  }
  return out;
}

}  // namespace zeroshard::ckpt::http
