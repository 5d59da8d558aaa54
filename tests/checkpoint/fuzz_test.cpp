// Checkpoints and safetensors files as untrusted input: 1,000 random mutations
// of each (bytes, lengths, header and manifest fields, offsets, shapes), each
// loaded or imported. Every attempt either succeeds with the data it should hold
// or fails with a c10::Error that names the file; anything else (another
// exception type, a crash, a read out of bounds) fails the test. ctest runs it
// in every build (checkpoint_fuzz), and CI once more under AddressSanitizer
// (scripts/asan-check.sh), where an out-of-bounds read or write aborts it.
#include "checkpoint_models.h"

#include "checksum.h"
#include "reader.h"
#include "tools/zeroshard_ckpt.h"

#include <nlohmann/json.hpp>

#include <cstring>
#include <functional>
#include <random>
#include <typeinfo>

namespace zeroshard {
namespace checkpoint_fuzz_test {

using namespace checkpoint_test;
using nlohmann::json;

constexpr int kMutations = 1000;

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void spit(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// What one attempt did: "" when it succeeded, else the c10::Error's message. Any other
// exception is a test failure, with the mutation that caused it.
std::string attempt(const std::function<void()>& f, const std::string& mutation) {
  try {
    f();
    return "";
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "after " << mutation << ": " << typeid(e).name() << " instead of a c10::Error: " << e.what();
  }
  return "(not a c10::Error)";
}

// Random edits of a JSON value, somewhere inside it: a number made negative, huge, off by
// one or zero; a string emptied or renamed; a key removed; an element dropped or doubled;
// a value of another type.
void collect_nodes(json& j, std::vector<json*>& out) {
  out.push_back(&j);
  if (j.is_structured()) {
    for (auto& child : j) collect_nodes(child, out);
  }
}

void mutate_json(json& j, std::mt19937& rng) {
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };
  std::vector<json*> nodes;  // every value in the document, any depth: each as likely to be edited
  collect_nodes(j, nodes);
  json* at = nodes[pick(nodes.size())];
  const std::vector<json> others = {nullptr, "x", -1, 0, 1, int64_t{1} << 40, -(int64_t{1} << 62), 1.5,
                                    json::array(), json::object(), json::array({0, 0, 0}), true};
  switch (rng() % 4) {
    case 0:
      *at = others[pick(others.size())];
      return;
    case 1:
      if (at->is_number_integer()) {
        const int64_t v = at->get<int64_t>();
        const std::vector<int64_t> near = {v + 1, v - 1, -v, v * 2, 0, v + (int64_t{1} << 32)};
        *at = near[pick(near.size())];
        return;
      }
      if (at->is_string()) {
        const std::vector<std::string> names = {"", "Float", "BFloat16", "Long", "bogus", "../x", "a/b",
                                                at->get<std::string>() + "x", "rank-00000-of-00001.h5"};
        *at = names[pick(names.size())];
        return;
      }
      [[fallthrough]];
    case 2:
      if (at->is_object() && !at->empty()) {
        auto it = at->begin();
        std::advance(it, static_cast<long>(pick(at->size())));
        at->erase(it);
        return;
      }
      if (at->is_array() && !at->empty()) {
        const size_t i = pick(at->size());
        if (rng() % 2) {
          at->erase(i);
        } else {
          at->push_back((*at)[i]);
        }
        return;
      }
      [[fallthrough]];
    default:
      *at = others[pick(others.size())];
  }
}

// Bytes flipped, a file cut short or grown.
void mutate_bytes(std::string& b, std::mt19937& rng) {
  switch (rng() % 3) {
    case 0:
      for (int k = 1 + static_cast<int>(rng() % 8); k > 0 && !b.empty(); --k) b[rng() % b.size()] ^= static_cast<char>(1 + rng() % 255);
      return;
    case 1:
      b.resize(b.empty() ? 0 : rng() % b.size());
      return;
    default:
      for (int k = 1 + static_cast<int>(rng() % 64); k > 0; --k) b.push_back(static_cast<char>(rng()));
  }
}

// --- safetensors ---------------------------------------------------------------------------

struct Tensors {
  json header;
  std::string data;
};

std::string safetensors_bytes(const json& header, const std::string& data) {
  const std::string h = header.dump();
  const uint64_t len = h.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &len, 8);
  return out + h + data;
}

// The file's tensors, decoded by the test itself (the format's rules: a little-endian header
// length, a JSON header, [begin, end) offsets into the data): the oracle a successful import
// is compared with. nullopt when the file breaks a rule.
std::optional<std::map<std::string, at::Tensor>> decode(const std::string& file) {
  const std::map<std::string, at::ScalarType> types{{"F32", at::kFloat}, {"BF16", at::kBFloat16}, {"F16", at::kHalf},
                                                    {"F64", at::kDouble}, {"I64", at::kLong}, {"I32", at::kInt},
                                                    {"BOOL", at::kBool}, {"U8", at::kByte}};
  if (file.size() < 8) return std::nullopt;
  uint64_t len = 0;
  std::memcpy(&len, file.data(), 8);
  if (len > file.size() - 8) return std::nullopt;
  const json h = json::parse(file.substr(8, len), nullptr, /*allow_exceptions=*/false);
  if (!h.is_object()) return std::nullopt;
  const std::string data = file.substr(8 + len);
  std::map<std::string, at::Tensor> out;
  for (auto it = h.begin(); it != h.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const json& e = it.value();
    if (!e.is_object() || !e.contains("dtype") || !e["dtype"].is_string() || !types.count(e["dtype"].get<std::string>()) ||
        !e.contains("shape") || !e["shape"].is_array() || !e.contains("data_offsets") || !e["data_offsets"].is_array() ||
        e["data_offsets"].size() != 2) {
      return std::nullopt;
    }
    std::vector<int64_t> shape;
    double numel = 1;
    for (const auto& d : e["shape"]) {
      if (!d.is_number_unsigned()) return std::nullopt;
      shape.push_back(d.get<int64_t>());
      numel *= static_cast<double>(d.get<uint64_t>());
    }
    const auto dt = types.at(e["dtype"].get<std::string>());
    const auto& off = e["data_offsets"];
    if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned()) return std::nullopt;
    const uint64_t b = off[0].get<uint64_t>(), en = off[1].get<uint64_t>();
    if (b > en || en > data.size() || static_cast<double>(en - b) != numel * static_cast<double>(c10::elementSize(dt))) {
      return std::nullopt;
    }
    auto t = at::empty(shape, at::TensorOptions().dtype(dt));
    std::memcpy(t.data_ptr(), data.data() + b, en - b);
    out[it.key()] = t;
  }
  return out;
}

TEST(CheckpointFuzz, ImportOfMutatedSafetensorsSucceedsWithItsDataOrIsNamed) {
  const fs::path dir = testing::make_temp_dir("ckpt_fuzz_import");
  // Every dtype the format and the import know, a scalar, an empty tensor.
  torch::manual_seed(5);
  std::vector<std::pair<std::string, at::Tensor>> tensors = {
      {"w", torch::randn({3, 4})}, {"b", torch::randn({5}).to(torch::kBFloat16)}, {"h", torch::randn({2, 2}).to(torch::kHalf)},
      {"d", torch::randn({3}, torch::kDouble)}, {"ids", torch::arange(4, torch::kLong)}, {"n", torch::tensor(7, torch::kInt)},
      {"mask", torch::tensor({true, false, true})}, {"bytes", torch::arange(6, torch::kByte)}, {"empty", torch::zeros({0, 3})}};
  const std::map<at::ScalarType, std::string> names{{at::kFloat, "F32"}, {at::kBFloat16, "BF16"}, {at::kHalf, "F16"},
                                                    {at::kDouble, "F64"}, {at::kLong, "I64"}, {at::kInt, "I32"},
                                                    {at::kBool, "BOOL"}, {at::kByte, "U8"}};
  json header;
  std::string data;
  for (const auto& [name, t] : tensors) {
    const auto begin = data.size();
    data.append(static_cast<const char*>(t.data_ptr()), t.nbytes());
    header[name] = {{"dtype", names.at(t.scalar_type())}, {"shape", t.sizes().vec()}, {"data_offsets", {begin, data.size()}}};
  }
  header["__metadata__"] = {{"format", "pt"}};
  std::mt19937 rng(2024);
  int ok = 0, refused = 0;
  for (int i = 0; i < kMutations; ++i) {
    std::string file;
    std::string what;
    if (i % 2 == 0) {  // the header's fields
      json h = header;
      mutate_json(h, rng);
      file = safetensors_bytes(h, data);
      what = "mutation " + std::to_string(i) + " (header " + h.dump().substr(0, 300) + ")";
    } else {  // the bytes, the header's length among them
      file = safetensors_bytes(header, data);
      mutate_bytes(file, rng);
      what = "mutation " + std::to_string(i) + " (bytes)";
    }
    const fs::path in = dir / ("in" + std::to_string(i) + ".safetensors");
    const fs::path run = dir / ("run" + std::to_string(i));
    spit(in, file);
    const std::string err = attempt([&] { zeroshard_ckpt::import_safetensors(in.string(), run.string(), "", 0); }, what);
    const auto want = decode(file);
    if (!err.empty()) {
      ++refused;
      EXPECT_NE(err.find("import: "), std::string::npos) << what << ": the error does not say what failed: " << err;
      EXPECT_NE(err.find(in.string()), std::string::npos) << what << ": the error does not name the file: " << err;
      // What the format allows must import: a refusal of a valid file is a failure too (names
      // with a '/' excepted: they would be dataset paths, and the import refuses them).
      bool slash = false;
      if (want) {
        for (const auto& [name, t] : *want) slash = slash || name.find('/') != std::string::npos || name.empty();
      }
      EXPECT_TRUE(!want || slash) << what << ": a valid file was refused: " << err;
    } else {
      ++ok;
      ASSERT_TRUE(want.has_value()) << what << ": imported a file that breaks the format";
      checkpoint::CheckpointReader r(checkpoint::resolve_step_dir(run));
      size_t seen = 0;
      for (const auto& p : r.params()) {
        ASSERT_TRUE(want->count(p.name)) << what << ": imported a parameter the file does not hold: " << p.name;
        EXPECT_TRUE(r.read_param(p).equal(want->at(p.name).to(at::kFloat))) << what << ": " << p.name;
        EXPECT_TRUE(r.read_param(p, "exp_avg").eq(0).all().item<bool>()) << what << ": " << p.name;
        ++seen;
      }
      for (const auto& e : r.replicated()) {
        ASSERT_TRUE(want->count(e.name)) << what << ": imported a buffer the file does not hold: " << e.name;
        EXPECT_TRUE(r.read_replicated(e).equal(want->at(e.name))) << what << ": " << e.name;
        ++seen;
      }
      EXPECT_EQ(seen, want->size()) << what << ": tensors lost on import";
      EXPECT_TRUE(r.verify().empty()) << what;
    }
    fs::remove(in);
    fs::remove_all(run);
  }
  std::cout << "import: " << ok << " of " << kMutations << " mutated files imported with the data they hold, " << refused
            << " refused with a named error\n";
  // Both outcomes happen, or the mutations do not test what they claim to.
  EXPECT_GT(ok, kMutations / 20);
  EXPECT_GT(refused, kMutations / 2);
  fs::remove_all(dir);
}

// --- checkpoints ---------------------------------------------------------------------------

// The manifest after an edit, with manifest.xxh3 made to agree (an edited manifest whose
// checksum was fixed up: the xxh3 of the text, as `xxhsum -H3` gives it) or removed (a
// manifest from before the checksum existed).
void rewrite_manifest(const fs::path& step, const json& m, bool drop_checksum) {
  spit(step / "manifest.json", m.dump(1));
  if (drop_checksum) {
    fs::remove(step / "manifest.xxh3");
  } else {
    spit(step / "manifest.xxh3", checkpoint::to_hex(checkpoint::digest_file((step / "manifest.json").string()).xxh3) + "\n");
  }
}

TEST(CheckpointFuzz, LoadOfMutatedCheckpointSucceedsWithTheSavedValuesOrIsNamed) {
  if (world().size() != 1) GTEST_SKIP() << "one rank's test";
  const fs::path dir = testing::make_temp_dir("ckpt_fuzz_load");
  const auto single = world_ptr();
  const fs::path pristine = dir / "pristine";
  torch::Tensor saved_flat;
  {
    Trainer t(2, /*seed=*/3, ProcessGroup::of(single));
    t.train(0, 2);
    Checkpointer c(pristine.string(), single);
    t.save(c, 2);
    saved_flat = t.flat();
  }
  const fs::path step_name = latest_of(pristine.string());
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(pristine / step_name)) files.push_back(e.path().filename().string());
  std::sort(files.begin(), files.end());
  std::mt19937 rng(77);
  int ok = 0, refused = 0;
  for (int i = 0; i < kMutations; ++i) {
    const fs::path run = dir / "run";
    fs::remove_all(run);
    fs::copy(pristine, run, fs::copy_options::recursive);
    const fs::path step = run / step_name;
    std::string what = "mutation " + std::to_string(i);
    if (i % 2 == 0) {  // the manifest's fields, its checksum made to agree or removed
      json m = json::parse(slurp(step / "manifest.json"));
      mutate_json(m, rng);
      rewrite_manifest(step, m, rng() % 3 == 0);
      what += " (manifest " + m.dump().substr(0, 400) + ")";
    } else {  // the bytes of any file of the step
      const std::string name = files[rng() % files.size()];
      std::string b = slurp(step / name);
      mutate_bytes(b, rng);
      spit(step / name, b);
      what += " (bytes of " + name + ")";
    }
    // Two readers: the Checkpointer, into a model, and CheckpointReader (zeroshard-ckpt's).
    Trainer fresh(2, /*seed=*/9, ProcessGroup::of(single));
    const auto before = fresh.flat();
    Checkpointer c(run.string(), single);
    const std::string load_err = attempt([&] { fresh.load(c, 2); }, what + ", load");
    if (load_err.empty()) {
      ++ok;
      EXPECT_TRUE(fresh.flat().equal(saved_flat)) << what << ": loaded, but not the saved values";
    } else {
      ++refused;
      EXPECT_NE(load_err.find("checkpoint"), std::string::npos) << what << ": " << load_err;
      EXPECT_TRUE(fresh.flat().equal(before)) << what << ": a refused load changed the model";
    }
    const std::string read_err = attempt(
        [&] {
          checkpoint::CheckpointReader r(step);
          if (!r.verify().empty()) return;  // what zeroshard-ckpt verify reports
          for (const auto& p : r.params()) {
            for (const char* kind : {"master", "exp_avg", "exp_avg_sq"}) r.read_param(p, kind);
          }
          for (const auto& e : r.replicated()) r.read_replicated(e);
        },
        what + ", CheckpointReader");
    if (!read_err.empty()) {
      EXPECT_NE(read_err.find("checkpoint"), std::string::npos) << what << ": " << read_err;
    }
  }
  std::cout << "load: " << ok << " of " << kMutations << " mutated checkpoints loaded the saved values, " << refused
            << " refused with a named error\n";
  EXPECT_GT(ok, kMutations / 20);
  EXPECT_GT(refused, kMutations / 2);
  fs::remove_all(dir);
}

}  // namespace checkpoint_fuzz_test
}  // namespace zeroshard
