// s3_transfer.cpp — moving bytes: PUTs (conditional, multipart from a file,
// parts in parallel) and GETs (whole, ranged, into a file).
#include "s3_client.h"

#include "checksum.h"

#include "zeroshard/token_store.h"  // read_file_range

#include <boost/asio/post.hpp>
#include <c10/util/Exception.h>
#include <openssl/evp.h>
#include <pugixml.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

namespace zeroshard::ckpt::s3 {

namespace {

struct File {
  int fd = -1;
  ~File() {
    if (fd >= 0) ::close(fd);
  }
};

// "Content-MD5: ..." for a body (OpenSSL's MD5, base64): the store checks the bytes it receives
// against it and refuses damaged ones (400 BadDigest, which send() retries), so nothing damaged
// on the way is ever committed. `read` gives the body in order, calling `update` on each piece.
std::string content_md5(const std::function<void(const std::function<void(const char*, size_t)>&)>& read) {
  std::unique_ptr<EVP_MD_CTX, void (*)(EVP_MD_CTX*)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  TORCH_CHECK(ctx && EVP_DigestInit_ex(ctx.get(), EVP_md5(), nullptr) == 1, "S3 upload: OpenSSL cannot start an MD5");
  read([&](const char* data, size_t n) { EVP_DigestUpdate(ctx.get(), data, n); });
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  TORCH_CHECK(EVP_DigestFinal_ex(ctx.get(), digest, &size) == 1, "S3 upload: OpenSSL cannot finish an MD5");
  unsigned char base64[4 * ((EVP_MAX_MD_SIZE + 2) / 3) + 1];
  const int length = EVP_EncodeBlock(base64, digest, static_cast<int>(size));
  return "Content-MD5: " + std::string(reinterpret_cast<const char*>(base64), static_cast<size_t>(length));
}

std::string content_md5(const std::string& bytes) {
  return content_md5([&](const auto& update) { update(bytes.data(), bytes.size()); });
}

// Of the `size` bytes at `offset` of the open file `fd` (`path`, for messages).
std::string content_md5(int fd, int64_t offset, int64_t size, const std::string& path) {
  return content_md5([&](const auto& update) {
    std::vector<char> buffer(static_cast<size_t>(std::min<int64_t>(size, 1 << 20)));
    for (int64_t at = 0; at < size;) {
      const int64_t n = std::min<int64_t>(static_cast<int64_t>(buffer.size()), size - at);
      read_file_range(fd, buffer.data(), n, offset + at, path);
      update(buffer.data(), static_cast<size_t>(n));
      at += n;
    }
  });
}

}  // namespace

void Client::put(const std::string& name, const std::string& bytes) {
  std::string key = location_.key(name);
  const std::string md5 = content_md5(bytes);
  auto r = send("PUT " + location_.uri() + "/" + name, [&] {
    http::Request q;
    q.method = "PUT";
    q.url = url(key);
    q.body = bytes;
    q.headers = {md5};
    return q;
  });
  expect_ok(r, "PUT " + location_.bucket + "/" + key);
}

bool Client::put_if_absent(const std::string& name, const std::string& bytes) {
  std::string key = location_.key(name);
  const std::string md5 = content_md5(bytes);
  auto r = send("conditional PUT " + location_.bucket + "/" + key, [&] {
    http::Request q;
    q.method = "PUT";
    q.url = url(key);
    q.body = bytes;
    q.headers = {"If-None-Match: *", md5};
    return q;
  });
  if (r.status == 412) return false;  // (a 409 ConditionalRequestConflict was retried by send())
  expect_ok(r, "conditional PUT " + location_.bucket + "/" + key);
  return true;
}

bool Client::upload_file(const std::string& name, const std::string& path, bool if_absent,
                         const std::function<void(int64_t)>& progress) {
  File f;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(f.fd >= 0, "S3 upload: cannot open '", path, "': ", std::strerror(errno));
  off_t end = ::lseek(f.fd, 0, SEEK_END);
  TORCH_CHECK(end >= 0, "S3 upload: cannot size '", path, "': ", std::strerror(errno));
  int64_t size = end;
  std::string key = location_.key(name);
  if (size > options_.part_bytes) return multipart_upload(key, path, size, if_absent, progress);
  std::string what = "PUT " + location_.bucket + "/" + key + " from " + path;
  const std::string md5 = content_md5(f.fd, 0, size, path);
  auto r = send(what, [&] {
    http::Request q;
    q.method = "PUT";
    q.url = url(key);
    q.body_size = size;
    int fd = f.fd;
    q.read_body = [fd, path](int64_t offset, char* buffer, size_t n) {
      read_file_range(fd, buffer, static_cast<int64_t>(n), offset, path);
      return n;
    };
    q.headers = {md5};
    if (if_absent) q.headers.push_back("If-None-Match: *");
    return q;
  });
  if (if_absent && r.status == 412) return false;
  expect_ok(r, what);
  if (progress) progress(size);
  return true;
}

bool Client::multipart_upload(const std::string& key, const std::string& path, int64_t size, bool if_absent,
                              const std::function<void(int64_t)>& progress) {
  const std::string object = location_.bucket + "/" + key;
  const std::string id_query = "uploadId=" + http::uri_encode(start_multipart(key, object), false);
  auto abort = [&] {
    try {
      send("abort the multipart upload of " + object, [&] {
        http::Request q;
        q.method = "DELETE";
        q.url = url(key, id_query);
        return q;
      });
    } catch (...) {  // best effort: remove_all and the store's lifecycle rules clean up what is left
    }
  };
  try {
    const auto etags = upload_parts(key, id_query, object, path, size, progress);
    if (!complete_multipart(key, id_query, object, etags, if_absent)) {
      abort();
      return false;
    }
  } catch (...) {
    abort();
    throw;
  }
  return true;
}

std::string Client::start_multipart(const std::string& key, const std::string& object) {
  auto init = send("start the multipart upload of " + object, [&] {
    http::Request q;
    q.method = "POST";
    q.url = url(key, "uploads=");
    return q;
  });
  expect_ok(init, "start the multipart upload of " + object);
  pugi::xml_document doc;
  doc.load_string(init.body.c_str());
  std::string id = doc.child("InitiateMultipartUploadResult").child("UploadId").text().as_string();
  TORCH_CHECK(!id.empty(), "S3: the store's answer to starting the multipart upload of ", object, " has no UploadId");
  return id;
}

std::vector<std::string> Client::upload_parts(const std::string& key, const std::string& id_query,
                                              const std::string& object, const std::string& path, int64_t size,
                                              const std::function<void(int64_t)>& progress) {
  // At most 10,000 parts (S3's limit), each at least part_bytes.
  const int64_t part = std::max(options_.part_bytes, (size + 9999) / 10000);
  const int64_t parts = (size + part - 1) / part;
  std::vector<std::string> etags(static_cast<size_t>(parts));
  File f;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(f.fd >= 0, "S3 upload: cannot open '", path, "': ", std::strerror(errno));
  parallel_for(parts, [&](int64_t i) {
    int64_t begin = i * part, n = std::min(part, size - begin);
    std::string what = "PUT part " + std::to_string(i + 1) + " of " + std::to_string(parts) + " of " + object;
    const std::string md5 = content_md5(f.fd, begin, n, path);
    auto r = send(what, [&] {
      http::Request q;
      q.method = "PUT";
      q.url = url(key, "partNumber=" + std::to_string(i + 1) + "&" + id_query);
      q.headers = {md5};
      q.body_size = n;
      int fd = f.fd;
      q.read_body = [fd, begin, path](int64_t offset, char* buffer, size_t len) {
        read_file_range(fd, buffer, static_cast<int64_t>(len), begin + offset, path);
        return len;
      };
      return q;
    });
    expect_ok(r, what);
    auto etag = r.headers.find("etag");
    TORCH_CHECK(etag != r.headers.end() && !etag->second.empty(), "S3: the store's answer to ", what, " has no ETag");
    etags[static_cast<size_t>(i)] = etag->second;
    if (progress) progress(n);
  });
  return etags;
}

bool Client::complete_multipart(const std::string& key, const std::string& id_query, const std::string& object,
                                const std::vector<std::string>& etags, bool if_absent) {
  std::string body = "<CompleteMultipartUpload>";
  for (size_t i = 0; i < etags.size(); ++i) {
    body += "<Part><PartNumber>" + std::to_string(i + 1) + "</PartNumber><ETag>" + etags[i] + "</ETag></Part>";
  }
  body += "</CompleteMultipartUpload>";
  const std::string what = "complete the multipart upload of " + object;
  // S3 may answer 200 and fail later, in the body: InternalError or SlowDown are retried as a 5xx is.
  for (int attempt = 1;; ++attempt) {
    auto r = send(what, [&] {
      http::Request q;
      q.method = "POST";
      q.url = url(key, id_query);
      q.body = body;
      q.headers = {"Content-Type: application/xml"};
      if (if_absent) q.headers.push_back("If-None-Match: *");
      return q;
    }, /*slow_answer=*/true);
    if (if_absent && r.status == 412) return false;
    // NoSuchUpload after an attempt whose answer was lost (send() retried it): the upload may be
    // complete. The object with this many parts is the evidence (its ETag ends in "-PARTS"; the
    // durable tier's keys are each save's own).
    if (r.status == 404 && error_code(r.body) == "NoSuchUpload") {
      auto info = head(key.substr(location_.key("").size()));
      const std::string parts = "-" + std::to_string(etags.size()) + "\"";
      TORCH_CHECK(info && info->etag.size() > parts.size() &&
                      info->etag.compare(info->etag.size() - parts.size(), parts.size(), parts) == 0,
                  "S3: ", what, ": the upload is gone (NoSuchUpload) and the object is not its result");
      return true;
    }
    expect_ok(r, what);
    const std::string code = error_code(r.body);
    if (code.empty()) return true;
    TORCH_CHECK((code == "InternalError" || code == "SlowDown" || code == "ServiceUnavailable") &&
                    attempt < options_.max_attempts,
                "S3: ", what, ": the store answered 200 with an error: ", error_text(r));
    ++retries_;
    std::this_thread::sleep_for(std::min(options_.backoff_cap, options_.backoff_base * (1 << std::min(attempt, 10))));
  }
}

void Client::parallel_for(int64_t n, const std::function<void(int64_t)>& f) {
  if (n <= 1 || options_.parallel <= 1) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mu;  // guards error
  std::exception_ptr error;
  int workers = static_cast<int>(std::min<int64_t>(n, options_.parallel));
  std::vector<std::future<void>> done;
  for (int w = 0; w < workers; ++w) {
    auto task = std::make_shared<std::packaged_task<void()>>([&] {
      for (int64_t i = next++; i < n && !failed; i = next++) {
        try {
          f(i);
        } catch (...) {
          std::lock_guard<std::mutex> lock(mu);
          if (!error) error = std::current_exception();
          failed = true;
        }
      }
    });
    done.push_back(task->get_future());
    boost::asio::post(*pool_, [task] { (*task)(); });
  }
  for (auto& d : done) d.wait();
  if (error) std::rethrow_exception(error);
}

std::optional<std::string> Client::get(const std::string& name) {
  std::string key = location_.key(name);
  std::string what = "GET " + location_.bucket + "/" + key;
  auto r = send(what, [&] {
    http::Request q;
    q.url = url(key);
    return q;
  });
  if (r.status == 404) return std::nullopt;
  expect_ok(r, what);
  return r.body;
}

void Client::get_range(const std::string& name, int64_t offset, int64_t size, char* out) {
  if (size == 0) return;
  std::string key = location_.key(name);
  std::string what = "GET bytes " + std::to_string(offset) + "-" + std::to_string(offset + size - 1) + " of " +
                     location_.bucket + "/" + key;
  auto r = send(what, [&] {
    http::Request q;
    q.url = url(key);
    q.headers = {"Range: bytes=" + std::to_string(offset) + "-" + std::to_string(offset + size - 1)};
    q.write_body = [out, size](int64_t at, const char* data, size_t n) {
      if (at + static_cast<int64_t>(n) > size) return false;  // more than asked for: not the range
      std::memcpy(out + at, data, n);
      return true;
    };
    return q;
  });
  expect_ok(r, what);
  TORCH_CHECK(r.body_bytes == size, "S3: ", what, ": got ", r.body_bytes, " bytes (the object is shorter)");
}

int64_t Client::get_ranges(const std::string& name, const std::vector<Range>& ranges) {
  std::vector<Range> parts;
  for (const auto& r : ranges) {
    for (int64_t at = 0; at < r.size; at += options_.part_bytes) {
      parts.push_back({r.offset + at, std::min(options_.part_bytes, r.size - at), r.out + at});
    }
  }
  parallel_for(static_cast<int64_t>(parts.size()), [&](int64_t i) {
    const auto& p = parts[static_cast<size_t>(i)];
    get_range(name, p.offset, p.size, p.out);
  });
  return static_cast<int64_t>(parts.size());
}

namespace {

// The xxh3 of a file whose parts land in any order: each part, once it and every part before it
// have landed, is read back and hashed, by whichever download thread completed the run (one at a
// time), while the others go on downloading.
class InOrderDigest {
 public:
  InOrderDigest(int fd, int64_t part, int64_t size, std::string path)
      : fd_(fd), part_(part), size_(size), path_(std::move(path)), landed_((size + part - 1) / part, 0) {}
  void landed(int64_t i) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      landed_[static_cast<size_t>(i)] = 1;
      if (hashing_) return;  // the thread hashing takes this one too
      hashing_ = true;
    }
    std::vector<char> buf(1 << 20);
    for (;;) {
      int64_t from = 0, to = 0;
      {
        std::lock_guard<std::mutex> lock(mu_);
        from = to = next_;
        while (to < static_cast<int64_t>(landed_.size()) && landed_[static_cast<size_t>(to)]) ++to;
        if (to == from) {
          hashing_ = false;
          return;
        }
      }
      for (int64_t at = from * part_, end = std::min(to * part_, size_); at < end;) {
        const ssize_t n = ::pread(fd_, buf.data(), static_cast<size_t>(std::min<int64_t>(end - at, buf.size())), at);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
          std::lock_guard<std::mutex> lock(mu_);
          hashing_ = false;
          TORCH_CHECK(false, "S3 download: reading '", path_, "' back to checksum it failed: ",
                      n == 0 ? "it is shorter than written" : std::strerror(errno));
        }
        digest_.update(buf.data(), static_cast<size_t>(n));
        at += n;
      }
      std::lock_guard<std::mutex> lock(mu_);
      next_ = to;
    }
  }
  uint64_t value() {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(next_ == static_cast<int64_t>(landed_.size()) && !hashing_, "S3 download: '", path_,
                "' was not hashed to its end (a bug)");
    return digest_.value();
  }

 private:
  int fd_;
  int64_t part_, size_;
  std::string path_;
  std::mutex mu_;
  std::vector<char> landed_;
  int64_t next_ = 0;
  bool hashing_ = false;
  checkpoint::Digest digest_;
};

}  // namespace

int64_t Client::download_file(const std::string& name, const std::string& path, uint64_t* xxh3) {
  auto info = head(name);
  TORCH_CHECK(info, "S3: ", location_.uri(), "/", name, " does not exist");
  File f;
  f.fd = ::open(path.c_str(), (xxh3 ? O_RDWR : O_WRONLY) | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(f.fd >= 0, "S3 download: cannot create '", path, "': ", std::strerror(errno));
  TORCH_CHECK(::ftruncate(f.fd, info->size) == 0, "S3 download: cannot size '", path, "': ", std::strerror(errno));
  int64_t part = options_.part_bytes;
  int64_t parts = (info->size + part - 1) / part;
  std::optional<InOrderDigest> digest;
  if (xxh3) digest.emplace(f.fd, part, info->size, path);
  std::string key = location_.key(name);
  parallel_for(parts, [&](int64_t i) {
    int64_t begin = i * part, n = std::min(part, info->size - begin);
    std::string what = "GET bytes " + std::to_string(begin) + "-" + std::to_string(begin + n - 1) + " of " +
                       location_.bucket + "/" + key;
    int fd = f.fd;
    std::atomic<bool> write_failed{false};
    auto r = send(what, [&] {
      http::Request q;
      q.url = url(key);
      q.headers = {"Range: bytes=" + std::to_string(begin) + "-" + std::to_string(begin + n - 1)};
      q.write_body = [fd, begin, n, &write_failed](int64_t at, const char* data, size_t len) {
        if (at + static_cast<int64_t>(len) > n) return false;
        for (size_t done = 0; done < len;) {
          ssize_t w = ::pwrite(fd, data + done, len - done, begin + at + static_cast<int64_t>(done));
          if (w < 0 && errno == EINTR) continue;
          if (w <= 0) {
            write_failed = true;
            return false;
          }
          done += static_cast<size_t>(w);
        }
        return true;
      };
      return q;
    });
    TORCH_CHECK(!write_failed, "S3 download: writing '", path, "' failed (disk full?)");
    expect_ok(r, what);
    TORCH_CHECK(r.body_bytes == n, "S3: ", what, ": got ", r.body_bytes, " bytes of ", n);
    if (digest) digest->landed(i);
  });
  TORCH_CHECK(::fsync(f.fd) == 0, "S3 download: fsync of '", path, "' failed: ", std::strerror(errno));
  if (xxh3) *xxh3 = digest->value();
  return info->size;
}

}  // namespace zeroshard::ckpt::s3
