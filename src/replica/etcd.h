// etcd.h — the replica groups' coordinator: etcd's v3 API through its HTTP/JSON
// gateway (every etcd since 3.3 serves it on its client URLs), over the same
// libcurl client as the durable checkpoint tier (checkpoint/http.h). No etcd
// library: the few calls the groups need are JSON over HTTP.
//
// What the groups use it for (DESIGN.md §15): a lease per group (its
// liveness: the group's keys go when it stops renewing), keys that exist once
// (create: a registration, a membership claimed by one writer), a revision
// per change (the membership's generation), and a watch to learn of a change.
//
// Every request is bounded by EtcdOptions::request_timeout; a member that
// does not answer, or answers that it cannot serve now (no leader, a leader
// change, too many requests), is passed over for the next, so a cluster of
// three goes on with one member lost. A request no member serves throws one
// line naming the members and the last answer. Thread-safe: calls may come
// from several threads (each uses its own connection).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace zeroshard::replica {

struct EtcdOptions {
  std::vector<std::string> endpoints;  // the members' client URLs: "http://127.0.0.1:2379"
  std::chrono::milliseconds request_timeout{5000};  // one call, every member tried within it
  // One member's try at a call (not a watch): a member cut off (silent, no reset) is passed over
  // after this long, well inside a lease's time to live, for the next.
  std::chrono::milliseconds attempt_timeout{1000};
};

// "etcd://HOST:PORT[,HOST:PORT...]" (or http:// URLs, comma-separated) into member URLs.
// Throws naming the text and the form when it is not one.
std::vector<std::string> parse_etcd_endpoints(const std::string& uri);

struct KeyValue {
  std::string key, value;
  int64_t create_revision = 0, mod_revision = 0, version = 0, lease = 0;
};

struct WatchEvent {
  bool deleted = false;  // else a put (created or changed)
  KeyValue kv;           // of a deletion: the key and the revision that deleted it
};

class Etcd {
 public:
  explicit Etcd(EtcdOptions options);

  const EtcdOptions& options() const { return options_; }
  std::string describe() const;  // "etcd at http://...,http://..."

  // A lease of `ttl`: keys put with it go when it is revoked or not renewed for `ttl`.
  int64_t grant(std::chrono::seconds ttl);
  // Renews `lease`: its TTL again, or 0 when it is gone (expired or revoked).
  std::chrono::seconds keep_alive(int64_t lease);
  void revoke(int64_t lease);

  // Sets `key` (with `lease`, or none when 0); returns the store's revision after it.
  int64_t put(const std::string& key, const std::string& value, int64_t lease = 0);
  // Sets `key` only if no such key exists (one writer wins): true when this call
  // created it; false when it exists, with what it holds in *held.
  bool create(const std::string& key, const std::string& value, int64_t lease = 0, KeyValue* held = nullptr);
  // Sets `key` only if it was last changed at revision `mod_revision` (0: only if it does
  // not exist): true when this call set it; false with what is there now in *now (an empty
  // KeyValue when the key does not exist). A read-modify-write without a lost update.
  bool put_if(const std::string& key, const std::string& value, int64_t mod_revision, KeyValue* now = nullptr);
  // Deletes `key`; whether it existed.
  bool remove(const std::string& key);
  // The key, or nullopt; *revision (if given): the store's revision it was read at.
  std::optional<KeyValue> get(const std::string& key, int64_t* revision = nullptr);
  // Every key under `prefix`, in key order; *revision as get()'s.
  std::vector<KeyValue> list(const std::string& prefix, int64_t* revision = nullptr);
  // Deletes every key under `prefix`; returns how many there were.
  int64_t remove_prefix(const std::string& prefix);

  // The changes under `prefix` made after revision `after`, in order: those already
  // made at once, else the first that comes within `timeout` (with any made with it);
  // empty when none came. `cancelled` (optional, polled about once a second and as
  // data moves) ends the wait early, empty. Throws when the revisions after `after`
  // were compacted away (list() again and watch from its revision).
  std::vector<WatchEvent> watch(const std::string& prefix, int64_t after, std::chrono::milliseconds timeout,
                                const std::function<bool()>& cancelled = {});

 private:
  // POSTs `body` to `path` (e.g. "/v3/kv/put") on the members in turn until one
  // serves it; returns its JSON text. `what` names the call in errors.
  std::string call(const std::string& path, const std::string& body, const std::string& what);
  // A transaction: `put` (a PutRequest, JSON) when `compare` (a Compare, JSON) holds, else a read
  // of `key`: true when it put, else false with what is there in *now.
  bool put_when(const std::string& key, const std::string& compare, const std::string& put, const std::string& what,
                KeyValue* now);

  EtcdOptions options_;
  std::atomic<int> first_{0};  // the member that answered last: tried first
};

}  // namespace zeroshard::replica
