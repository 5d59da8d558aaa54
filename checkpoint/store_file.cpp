// store_file.cpp — a rank file in the durable tier, read where it is (store_file.h).
#include "store_file.h"

#include "zeroshard/log.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <unordered_map>

namespace zeroshard::ckpt {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

const char* const kTypeNames[] = {"f32", "f64", "i64", "i32", "u8", "u16"};  // h5::Type's order

// A rank file in the store, read dataset by dataset (DurableTier::open_ranged). Reads are
// gathered until complete(): each dataset asked for is fetched once, whole (its xxh3 in
// the index covers all of it), neighbours in the file share a ranged GET, and the GETs go
// out `parallel` at a time, at most kWindow bytes of them held at once.
class StoreFile : public checkpoint::h5::Readable {
 public:
  StoreFile(s3::Client& client, std::string key, const json& entry) : client_(client), key_(std::move(key)) {
    const auto& want = entry.at("index");
    const auto text = client_.get(key_ + ".index");
    TORCH_CHECK(text, "checkpoint: ", where(), ".index is missing from the store");
    TORCH_CHECK(static_cast<int64_t>(text->size()) == want.at("bytes").get<int64_t>() &&
                    checkpoint::to_hex(checkpoint::digest_bytes(text->data(), text->size())) ==
                        want.at("xxh3").get<std::string>(),
                "checkpoint: ", where(), ".index does not match its manifest entry (size and xxh3): the store's copy is "
                "damaged");
    const json index = json::parse(*text);
    TORCH_CHECK(index.at("file") == entry.at("name") && index.at("xxh3") == entry.at("xxh3"), "checkpoint: ", where(),
                ".index describes another file");
    for (const auto& [name, d] : index.at("datasets").items()) {
      Dataset ds;
      ds.name = name;
      const auto type = std::find(std::begin(kTypeNames), std::end(kTypeNames), d.at("type").get<std::string>());
      TORCH_CHECK(type != std::end(kTypeNames), "checkpoint: ", where(), ".index: dataset '", name, "' has type ",
                  d.at("type"));
      ds.type = static_cast<checkpoint::h5::Type>(type - std::begin(kTypeNames));
      ds.dims = d.at("dims").get<std::vector<uint64_t>>();
      ds.offset = d.at("offset").get<uint64_t>();
      ds.bytes = d.at("bytes").get<uint64_t>();
      ds.xxh3 = d.at("xxh3").get<std::string>();
      uint64_t n = 1;
      for (auto x : ds.dims) n *= x;
      TORCH_CHECK(n * checkpoint::h5::type_size(ds.type) == ds.bytes &&
                      ds.offset + ds.bytes <= entry.at("bytes").get<uint64_t>(),
                  "checkpoint: ", where(), ".index: dataset '", name, "' does not fit its file");
      datasets_.emplace(name, std::move(ds));
    }
    file_bytes_ = entry.at("bytes").get<int64_t>();
  }
  ~StoreFile() override {
    char msg[320];
    std::snprintf(msg, sizeof(msg),
                  "checkpoint: read %.1f MB of %s (%.1f MB) from the durable tier in %lld ranged GETs, %.1f MB of it "
                  "asked for",
                  fetched_ / 1e6, key_.c_str(), file_bytes_ / 1e6, static_cast<long long>(requests_), wanted_ / 1e6);
    log_info(msg);
  }
  bool has(const std::string& name) const override { return datasets_.count(name) > 0; }
  std::vector<uint64_t> dims(const std::string& name) const override { return dataset(name).dims; }
  void read(const std::string& name, checkpoint::h5::Type type, uint64_t offset, uint64_t count,
            void* out) const override {
    const Dataset& ds = dataset(name);
    TORCH_CHECK(ds.dims.size() == 1 && offset + count <= ds.dims[0], "checkpoint: ", where(), ": dataset '", name,
                "' has shape ", json(ds.dims).dump(), "; elements [", offset, ", ", offset + count, ") were asked for");
    ask(name, ds, type, offset, count, out);
  }
  void read_all(const std::string& name, checkpoint::h5::Type type, uint64_t count, void* out) const override {
    const Dataset& ds = dataset(name);
    TORCH_CHECK(ds.bytes == count * checkpoint::h5::type_size(ds.type), "checkpoint: ", where(), ": dataset '", name,
                "' has ", ds.bytes / checkpoint::h5::type_size(ds.type), " elements where its manifest entry describes ",
                count, ": refusing to read it");
    ask(name, ds, type, 0, count, out);
  }

  void complete() const override {
    std::vector<Ask> asked;
    asked.swap(asked_);
    // The datasets asked for, in file order; neighbours closer than kGap share a span
    // (one GET) of at most kSpan bytes, unless one dataset alone is larger.
    std::map<uint64_t, const Dataset*> wanted;
    for (const auto& a : asked) {
      if (a.ds->bytes > 0 && wanted.emplace(a.ds->offset, a.ds).second) wanted_ += static_cast<int64_t>(a.ds->bytes);
    }
    struct Span {
      uint64_t begin, end;
      std::vector<const Dataset*> datasets;
    };
    std::vector<Span> spans;
    for (const auto& [offset, ds] : wanted) {
      if (!spans.empty() && offset <= spans.back().end + kGap && offset + ds->bytes - spans.back().begin <= kSpan) {
        spans.back().end = std::max(spans.back().end, offset + ds->bytes);
        spans.back().datasets.push_back(ds);
      } else {
        spans.push_back({offset, offset + ds->bytes, {ds}});
      }
    }
    for (size_t i = 0; i < spans.size();) {
      size_t j = i;
      uint64_t held = 0;
      do {
        held += spans[j].end - spans[j].begin;
        ++j;
      } while (j < spans.size() && held + spans[j].end - spans[j].begin <= kWindow);
      std::vector<std::vector<char>> buffers(j - i);
      std::vector<s3::Client::Range> ranges;
      for (size_t k = i; k < j; ++k) {
        auto& buffer = buffers[k - i];
        buffer.resize(spans[k].end - spans[k].begin);
        ranges.push_back({static_cast<int64_t>(spans[k].begin), static_cast<int64_t>(buffer.size()), buffer.data()});
      }
      requests_ += client_.get_ranges(key_, ranges);
      fetched_ += static_cast<int64_t>(held);
      std::unordered_map<const Dataset*, const char*> landed;
      for (size_t k = i; k < j; ++k) {
        for (const Dataset* ds : spans[k].datasets) {
          const char* bytes = buffers[k - i].data() + (ds->offset - spans[k].begin);
          verify(*ds, bytes);
          landed.emplace(ds, bytes);
        }
      }
      for (const auto& a : asked) {
        auto it = landed.find(a.ds);
        if (it != landed.end()) std::memcpy(a.out, it->second + a.offset, a.bytes);
      }
      i = j;
    }
  }

 private:
  struct Dataset {
    std::string name;
    checkpoint::h5::Type type;
    std::vector<uint64_t> dims;
    uint64_t offset = 0, bytes = 0;
    std::string xxh3;
  };
  // A read waiting for complete(): `bytes` bytes from `offset` into the dataset, to `out`.
  struct Ask {
    const Dataset* ds;
    uint64_t offset, bytes;
    void* out;
  };
  static constexpr uint64_t kGap = uint64_t{1} << 20, kSpan = uint64_t{16} << 20, kWindow = uint64_t{256} << 20;

  std::string where() const { return client_.location().uri() + "/" + key_; }
  const Dataset& dataset(const std::string& name) const {
    auto it = datasets_.find(name);
    TORCH_CHECK(it != datasets_.end(), "checkpoint: ", where(), " has no dataset '", name, "'");
    return it->second;
  }
  void ask(const std::string& name, const Dataset& ds, checkpoint::h5::Type type, uint64_t offset, uint64_t count,
           void* out) const {
    TORCH_CHECK(type == ds.type, "checkpoint: ", where(), ": dataset '", name, "' is stored as ",
                kTypeNames[static_cast<int>(ds.type)], " and was asked for as ", kTypeNames[static_cast<int>(type)]);
    const uint64_t size = checkpoint::h5::type_size(type);
    if (ds.bytes == 0) {
      verify(ds, nullptr);
      return;
    }
    asked_.push_back({&ds, offset * size, count * size, out});
  }
  void verify(const Dataset& ds, const char* bytes) const {
    const auto got = checkpoint::to_hex(checkpoint::digest_bytes(bytes, ds.bytes));
    TORCH_CHECK(got == ds.xxh3, "checkpoint: ", where(), ": dataset '", ds.name, "' has xxh3 ", got,
                " and its index says ", ds.xxh3, ": the store's copy is damaged");
  }

  s3::Client& client_;
  const std::string key_;
  std::unordered_map<std::string, Dataset> datasets_;
  int64_t file_bytes_ = 0;
  mutable std::vector<Ask> asked_;
  mutable int64_t fetched_ = 0, requests_ = 0, wanted_ = 0;
};

}  // namespace

json dataset_index(const std::string& file_name, const checkpoint::FileDigest& file,
                   const std::vector<checkpoint::h5::Extent>& extents) {
  json datasets = json::object();
  for (const auto& e : extents) {
    datasets[e.name] = {{"type", kTypeNames[static_cast<int>(e.type)]}, {"dims", e.dims}, {"offset", e.offset},
                        {"bytes", e.bytes}, {"xxh3", checkpoint::to_hex(e.xxh3)}};
  }
  return {{"file", file_name}, {"bytes", file.bytes}, {"xxh3", checkpoint::to_hex(file.xxh3)}, {"datasets", datasets}};
}

fs::path index_path(const fs::path& rank_file) { return rank_file.string() + ".index"; }

std::unique_ptr<checkpoint::h5::Readable> open_store_file(s3::Client& client, std::string key, const json& entry) {
  return std::make_unique<StoreFile>(client, std::move(key), entry);
}

}  // namespace zeroshard::ckpt
