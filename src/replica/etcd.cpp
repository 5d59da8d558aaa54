// etcd.cpp — etcd's v3 API over its HTTP/JSON gateway (grpc-gateway): requests
// are the gRPC messages as JSON, bytes fields in base64, 64-bit integers as
// decimal strings; a server-streaming call (watch) answers one JSON message
// per line.
#include "replica/etcd.h"

#include "http.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>
#include <openssl/evp.h>

#include <algorithm>
#include <thread>

namespace zeroshard::replica {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

std::string base64(const std::string& bytes) {
  std::string out(4 * ((bytes.size() + 2) / 3) + 1, '\0');
  const int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                reinterpret_cast<const unsigned char*>(bytes.data()), static_cast<int>(bytes.size()));
  out.resize(static_cast<size_t>(n));
  return out;
}

std::string unbase64(const std::string& text) {
  if (text.empty()) return {};
  std::string out(3 * (text.size() / 4) + 3, '\0');
  const int n = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                reinterpret_cast<const unsigned char*>(text.data()), static_cast<int>(text.size()));
  TORCH_CHECK(n >= 0, "etcd: an answer holds bytes that are not base64: '", text.substr(0, 40), "'");
  // EVP_DecodeBlock counts the padding's zero bytes in: take them off.
  size_t pad = 0;
  for (size_t k = text.size(); k > 0 && text[k - 1] == '='; --k) ++pad;
  out.resize(static_cast<size_t>(n) - pad);
  return out;
}

// A 64-bit field: the gateway writes them as strings; absent means 0.
int64_t number(const json& j, const char* key) {
  if (!j.contains(key)) return 0;
  const auto& v = j.at(key);
  return v.is_string() ? std::stoll(v.get<std::string>()) : v.get<int64_t>();
}

KeyValue key_value(const json& j) {
  KeyValue kv;
  kv.key = unbase64(j.value("key", std::string()));
  kv.value = unbase64(j.value("value", std::string()));
  kv.create_revision = number(j, "create_revision");
  kv.mod_revision = number(j, "mod_revision");
  kv.version = number(j, "version");
  kv.lease = number(j, "lease");
  return kv;
}

// The first key past every key that starts with `prefix` (etcd's range_end for a prefix).
std::string prefix_end(std::string prefix) {
  while (!prefix.empty() && static_cast<unsigned char>(prefix.back()) == 0xff) prefix.pop_back();
  if (prefix.empty()) return std::string(1, '\0');  // every key
  prefix.back() = static_cast<char>(static_cast<unsigned char>(prefix.back()) + 1);
  return prefix;
}

// gRPC codes a member answers when another may serve the call (or it may, in a moment):
// DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED, UNAVAILABLE.
bool try_elsewhere(const json& error) {
  const int64_t code = error.value("code", int64_t{0});
  return code == 4 || code == 8 || code == 10 || code == 14;
}

std::string error_text(const json& answer) {
  const auto message = answer.value("message", answer.value("error", std::string("?")));
  return message + " (gRPC code " + std::to_string(answer.value("code", int64_t{0})) + ")";
}

}  // namespace

std::vector<std::string> parse_etcd_endpoints(const std::string& uri) {
  std::string rest = uri;
  const std::string scheme = "etcd://";
  const bool etcd_form = rest.compare(0, scheme.size(), scheme) == 0;
  if (etcd_form) rest = rest.substr(scheme.size());
  std::vector<std::string> out;
  size_t at = 0;
  while (at <= rest.size()) {
    size_t end = rest.find(',', at);
    if (end == std::string::npos) end = rest.size();
    std::string member = rest.substr(at, end - at);
    while (!member.empty() && member.back() == '/') member.pop_back();
    const bool url = member.compare(0, 7, "http://") == 0 || member.compare(0, 8, "https://") == 0;
    const auto host_port = url ? member.substr(member.find("//") + 2) : member;
    const auto colon = host_port.rfind(':');
    TORCH_CHECK_VALUE(!host_port.empty() && colon != std::string::npos && colon > 0 && colon + 1 < host_port.size() &&
                          host_port.find('/') == std::string::npos && (etcd_form != url),
                      "coordinator '", uri, "': '", member, "' is not a member's address; give "
                      "etcd://HOST:PORT[,HOST:PORT...] (etcd's client URLs, e.g. etcd://10.0.0.5:2379)");
    out.push_back(url ? member : "http://" + member);
    at = end + 1;
  }
  return out;
}

Etcd::Etcd(EtcdOptions options) : options_(std::move(options)) {
  TORCH_CHECK_VALUE(!options_.endpoints.empty(), "etcd: no member's address given");
  TORCH_CHECK_VALUE(options_.request_timeout.count() > 0, "etcd: request_timeout must be positive");
}

std::string Etcd::describe() const {
  std::string out = "etcd at ";
  for (size_t k = 0; k < options_.endpoints.size(); ++k) out += (k ? "," : "") + options_.endpoints[k];
  return out;
}

std::string Etcd::call(const std::string& path, const std::string& body, const std::string& what) {
  const auto deadline = Clock::now() + options_.request_timeout;
  const int n = static_cast<int>(options_.endpoints.size());
  std::string last;
  for (int attempt = 0;; ++attempt) {
    const int k = (first_.load() + attempt) % n;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) break;
    ckpt::http::Request q;
    q.method = "POST";
    q.url = options_.endpoints[static_cast<size_t>(k)] + path;
    q.headers = {"Content-Type: application/json"};
    q.body = body;
    q.no_proxy = true;  // the coordinator is the cluster's own
    ckpt::http::Limits limits;
    limits.connect = std::min(left, options_.attempt_timeout);
    limits.total = std::min(left, options_.attempt_timeout);
    const auto r = ckpt::http::perform(q, limits);
    const std::string member = options_.endpoints[static_cast<size_t>(k)];
    if (r.status == 0) {
      last = member + ": " + (r.transport_error.empty() ? "no answer" : r.transport_error);
    } else {
      json answer = json::parse(r.body, nullptr, /*allow_exceptions=*/false);
      TORCH_CHECK(!answer.is_discarded(), "etcd: ", what, ": ", member, " answered HTTP ", r.status,
                  " with what is not JSON: '", r.body.substr(0, 200), "' (is this etcd's client URL?)");
      if (r.status == 200 && !answer.contains("error")) {
        first_ = k;
        return r.body;
      }
      last = member + ": " + error_text(answer);
      TORCH_CHECK(try_elsewhere(answer), "etcd: ", what, ": ", last);
    }
    if (attempt % n == n - 1) std::this_thread::sleep_for(std::chrono::milliseconds(100));  // every member refused: a pause
  }
  TORCH_CHECK(false, "etcd: ", what, ": no member of ", describe(), " served it within ",
              options_.request_timeout.count(), " ms (last: ", last, "); fix: start etcd there, or give the "
              "members' client URLs (--coordinator etcd://HOST:PORT,...)");
  return {};
}

int64_t Etcd::grant(std::chrono::seconds ttl) {
  TORCH_CHECK_VALUE(ttl.count() > 0, "etcd: a lease's TTL must be positive (", ttl.count(), " s)");
  const auto a = json::parse(call("/v3/lease/grant", json{{"TTL", std::to_string(ttl.count())}}.dump(), "grant a lease"));
  return number(a, "ID");
}

std::chrono::seconds Etcd::keep_alive(int64_t lease) {
  const auto a = json::parse(call("/v3/lease/keepalive", json{{"ID", std::to_string(lease)}}.dump(),
                                  "renew lease " + std::to_string(lease)));
  return std::chrono::seconds(a.contains("result") ? number(a.at("result"), "TTL") : 0);
}

void Etcd::revoke(int64_t lease) {
  call("/v3/lease/revoke", json{{"ID", std::to_string(lease)}}.dump(), "revoke lease " + std::to_string(lease));
}

int64_t Etcd::put(const std::string& key, const std::string& value, int64_t lease) {
  json q{{"key", base64(key)}, {"value", base64(value)}};
  if (lease != 0) q["lease"] = std::to_string(lease);
  const auto a = json::parse(call("/v3/kv/put", q.dump(), "put '" + key + "'"));
  return number(a.at("header"), "revision");
}

// A transaction: put `put` when `compare` holds, else read the key; true when it put, else *now.
bool Etcd::put_when(const std::string& key, const std::string& compare, const std::string& put,
                    const std::string& what, KeyValue* now) {
  const json q{{"compare", {json::parse(compare)}}, {"success", {{{"request_put", json::parse(put)}}}},
               {"failure", {{{"request_range", {{"key", base64(key)}}}}}}};
  const auto a = json::parse(call("/v3/kv/txn", q.dump(), what));
  if (a.value("succeeded", false)) return true;
  if (now != nullptr) {
    *now = KeyValue();
    const auto& responses = a.value("responses", json::array());
    if (!responses.empty()) {
      const auto& kvs = responses.at(0).at("response_range").value("kvs", json::array());
      if (!kvs.empty()) *now = key_value(kvs.at(0));
    }
  }
  return false;
}

bool Etcd::create(const std::string& key, const std::string& value, int64_t lease, KeyValue* held) {
  json put{{"key", base64(key)}, {"value", base64(value)}};
  if (lease != 0) put["lease"] = std::to_string(lease);
  const json compare{{"key", base64(key)}, {"result", "EQUAL"}, {"target", "CREATE"}, {"create_revision", "0"}};
  return put_when(key, compare.dump(), put.dump(), "create '" + key + "'", held);
}

bool Etcd::put_if(const std::string& key, const std::string& value, int64_t mod_revision, KeyValue* now) {
  const json put{{"key", base64(key)}, {"value", base64(value)}};
  const json compare = mod_revision == 0
                           ? json{{"key", base64(key)}, {"result", "EQUAL"}, {"target", "CREATE"}, {"create_revision", "0"}}
                           : json{{"key", base64(key)}, {"result", "EQUAL"}, {"target", "MOD"},
                                  {"mod_revision", std::to_string(mod_revision)}};
  return put_when(key, compare.dump(), put.dump(), "put '" + key + "' if unchanged", now);
}

bool Etcd::remove(const std::string& key) {
  const auto a = json::parse(call("/v3/kv/deleterange", json{{"key", base64(key)}}.dump(), "delete '" + key + "'"));
  return number(a, "deleted") > 0;
}

std::optional<KeyValue> Etcd::get(const std::string& key, int64_t* revision) {
  const auto a = json::parse(call("/v3/kv/range", json{{"key", base64(key)}}.dump(), "get '" + key + "'"));
  if (revision != nullptr) *revision = number(a.at("header"), "revision");
  const auto& kvs = a.value("kvs", json::array());
  if (kvs.empty()) return std::nullopt;
  return key_value(kvs.at(0));
}

std::vector<KeyValue> Etcd::list(const std::string& prefix, int64_t* revision) {
  const json q{{"key", base64(prefix)}, {"range_end", base64(prefix_end(prefix))}};
  const auto a = json::parse(call("/v3/kv/range", q.dump(), "list '" + prefix + "'"));
  if (revision != nullptr) *revision = number(a.at("header"), "revision");
  std::vector<KeyValue> out;
  for (const auto& kv : a.value("kvs", json::array())) out.push_back(key_value(kv));
  return out;
}

int64_t Etcd::remove_prefix(const std::string& prefix) {
  const json q{{"key", base64(prefix)}, {"range_end", base64(prefix_end(prefix))}};
  const auto a = json::parse(call("/v3/kv/deleterange", q.dump(), "delete '" + prefix + "'"));
  return number(a, "deleted");
}

std::vector<WatchEvent> Etcd::watch(const std::string& prefix, int64_t after, std::chrono::milliseconds timeout,
                                    const std::function<bool()>& cancelled) {
  const json q{{"create_request",
                {{"key", base64(prefix)}, {"range_end", base64(prefix_end(prefix))}, {"start_revision", std::to_string(after + 1)}}}};
  const auto deadline = Clock::now() + timeout;
  const int n = static_cast<int>(options_.endpoints.size());
  std::string last;
  for (int attempt = 0; Clock::now() < deadline; ++attempt) {
    const int k = (first_.load() + attempt) % n;
    std::vector<WatchEvent> events;
    std::string pending, failure;
    ckpt::http::Request r;
    r.method = "POST";
    r.url = options_.endpoints[static_cast<size_t>(k)] + "/v3/watch";
    r.headers = {"Content-Type: application/json"};
    r.body = q.dump();
    r.no_proxy = true;
    // One JSON message per line: the watch's creation, then batches of events.
    r.write_body = [&](int64_t, const char* data, size_t size) {
      pending.append(data, size);
      for (size_t end; (end = pending.find('\n')) != std::string::npos; pending.erase(0, end + 1)) {
        const auto m = json::parse(pending.substr(0, end), nullptr, false);
        if (m.is_discarded()) continue;
        if (m.contains("error")) {
          failure = error_text(m);
          return false;
        }
        const auto& res = m.value("result", json::object());
        if (number(res, "compact_revision") > 0 || res.value("canceled", false)) {
          failure = "the revisions after " + std::to_string(after) + " were compacted away (compacted up to " +
                    std::to_string(number(res, "compact_revision")) + "); list again and watch from its revision";
          return false;
        }
        for (const auto& e : res.value("events", json::array())) {
          events.push_back({e.value("type", std::string()) == "DELETE", key_value(e.at("kv"))});
        }
      }
      return events.empty();  // the first batch ends the wait
    };
    r.cancelled = cancelled;
    ckpt::http::Limits limits;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    limits.connect = std::min(left, options_.attempt_timeout);
    limits.low_speed_bytes = 0;  // a quiet watch moves nothing
    limits.total = left;
    const auto resp = ckpt::http::perform(r, limits);
    TORCH_CHECK(failure.empty(), "etcd: watch '", prefix, "': ", failure);
    if (!events.empty() || resp.cancelled) {
      if (!events.empty()) first_ = k;
      return events;
    }
    if (resp.timed_out) return {};  // nothing came in time
    // The member went away (or would not watch): the next one, in the time left.
    last = options_.endpoints[static_cast<size_t>(k)] + ": " +
           (resp.status == 0 ? resp.transport_error : "HTTP " + std::to_string(resp.status) + " " + resp.body.substr(0, 200));
    if (attempt % n == n - 1) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  TORCH_CHECK(last.empty(), "etcd: watch '", prefix, "': no member of ", describe(), " could watch within ",
              timeout.count(), " ms (last: ", last, "); fix: start etcd there, or give the members' client URLs");
  return {};
}

}  // namespace zeroshard::replica
