// store_adapter.h — Gloo's rendezvous::Store interface over a c10d::Store.
//
// Every key is prefixed (one prefix per communicator, so split groups and
// restarts never collide). A wait that times out names the keys that never
// appeared; Gloo's full-mesh connect uses rank numbers as keys, so the error
// names the ranks that never joined. Thread-safety: as the wrapped store.
#pragma once

#include <gloo/rendezvous/store.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace zeroshard::comm {

class GlooStoreAdapter : public gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(std::shared_ptr<c10d::Store> store, std::string prefix,
                   std::chrono::milliseconds timeout);

  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;

 private:
  std::shared_ptr<c10d::Store> store_;
  std::string prefix_;
  std::chrono::milliseconds timeout_;
};

}  // namespace zeroshard::comm
