// export_hf.cpp — `bart_pretrain export-hf`: a run's checkpoint as a
// directory Hugging Face's from_pretrained loads as is (run.h).
#include "train/run.h"
#include "io/text_file.h"

#include <zeroshard/checkpoint.h>
#include <zeroshard/log.h>

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <system_error>
#include <vector>

namespace bart {

namespace fs = std::filesystem;
using json = nlohmann::json;

int export_hf_command(const RunOptions& o, const std::string& out_dir, int64_t step) {
  TORCH_CHECK_VALUE(!out_dir.empty(), "export-hf: --out is empty; give the directory to write");
  const std::string tokenizer_dir =
      o.tokenizer_dir.empty() ? (fs::path(o.run_dir) / "tokenizer").string() : o.tokenizer_dir;
  TORCH_CHECK_VALUE(fs::exists(tokenizer_files_in(tokenizer_dir)), "export-hf: the tokenizer directory '",
                    tokenizer_dir, "' has no vocab.json; give the run's --run-dir (or --tokenizer)");
  const auto tokenizer = load_tokenizer(tokenizer_dir);
  const auto config = run_config(o, tokenizer);
  const std::string ckpt_dir = o.ckpt_dir.empty() ? (fs::path(o.run_dir) / "checkpoints").string() : o.ckpt_dir;
  const fs::path out(out_dir), tmp(out_dir + ".tmp");
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  struct RemoveUnlessDone {  // a failed export leaves nothing behind
    fs::path path;
    bool done = false;
    ~RemoveUnlessDone() {
      std::error_code ec;
      if (!done) fs::remove_all(path, ec);
    }
  } partial{tmp};
  zeroshard::SafetensorsExport options;
  options.step = step;
  options.buffers = true;  // final_logits_bias
  const auto tensors = zeroshard::export_safetensors(ckpt_dir, (tmp / "model.safetensors").string(), options);
  // The checkpoint must be the model the config describes: every shape from it.
  std::map<std::string, std::vector<int64_t>> shape(tensors.begin(), tensors.end());
  auto expect = [&](const std::string& name, std::vector<int64_t> want) {
    TORCH_CHECK_VALUE(shape.count(name) && shape.at(name) == want, "export-hf: the checkpoint in '", ckpt_dir,
                      "' is not the model of --config ", o.config, " with this tokenizer: '", name, "' is ",
                      shape.count(name) ? c10::Join("x", shape.at(name)) : std::string("missing"), ", the config says ",
                      c10::Join("x", want), "; give the options the run was trained with (--config, --max-tokens, "
                      "--tokenizer)");
  };
  expect("model.shared.weight", {config.vocab_size, config.d_model});
  expect("model.encoder.embed_positions.weight", {config.max_position_embeddings + 2, config.d_model});
  expect("model.encoder.layers." + std::to_string(config.encoder_layers - 1) + ".fc1.weight",
         {config.ffn_dim, config.d_model});
  expect("model.decoder.layers." + std::to_string(config.decoder_layers - 1) + ".fc1.weight",
         {config.ffn_dim, config.d_model});
  expect("final_logits_bias", {1, config.vocab_size});
  TORCH_CHECK_VALUE(!shape.count("model.encoder.layers." + std::to_string(config.encoder_layers) + ".fc1.weight") &&
                        !shape.count("model.decoder.layers." + std::to_string(config.decoder_layers) + ".fc1.weight"),
                    "export-hf: the checkpoint in '", ckpt_dir, "' has more layers than --config ", o.config);
  write_text_file(tmp / "config.json", config.hf_config_json(), "export-hf");
  fs::copy_file(fs::path(tokenizer_dir) / "vocab.json", tmp / "vocab.json");
  fs::copy_file(fs::path(tokenizer_dir) / "merges.txt", tmp / "merges.txt");
  json specials = {{"bos_token", "<s>"},  {"eos_token", "</s>"}, {"sep_token", "</s>"},   {"cls_token", "<s>"},
                   {"unk_token", "<unk>"}, {"pad_token", "<pad>"}, {"mask_token", "<mask>"}};
  write_text_file(tmp / "special_tokens_map.json", specials.dump(2) + "\n", "export-hf");
  json tok = specials;
  tok["tokenizer_class"] = "BartTokenizer";
  tok["model_max_length"] = config.max_position_embeddings;
  tok["add_prefix_space"] = false;
  tok["errors"] = "replace";
  write_text_file(tmp / "tokenizer_config.json", tok.dump(2) + "\n", "export-hf");
  fs::remove_all(out);
  fs::rename(tmp, out);
  partial.done = true;
  zeroshard::log_info("export-hf: wrote " + out_dir + " (config.json, model.safetensors: " +
                      std::to_string(tensors.size()) + " tensors, vocab.json, merges.txt, tokenizer_config.json, "
                      "special_tokens_map.json)");
  return 0;
}

}  // namespace bart
