#!/usr/bin/env python3
"""examples/bart against Hugging Face (transformers, tokenizers) as the independent oracle.

Usage: check_hf.py BUILD_DIR WORK_DIR CHECK
  export     tiny BART trained 20 steps (2 ranks, ZeRO-3), exported with bart_pretrain export-hf (config.json,
             model.safetensors, tokenizer files): BartForConditionalGeneration.from_pretrained() and
             BartTokenizer.from_pretrained() load it as is
             with no missing, unexpected or mismatched key, and its logits on the batch bart_pretrain --save-logits
             evaluates equal ours within FP32_BOUND
  import     a seeded random Hugging Face BART of the tiny shape (every tensor random, final_logits_bias too),
             save_pretrained() (safetensors), zeroshard-ckpt import --safetensors, then bart_pretrain --config
             its config.json --tokenizer its vocabulary --save-logits: our logits equal Hugging Face's within FP32_BOUND
  tokenizer  a tokenizers.ByteLevelBPETokenizer trained on the demo corpus (plus a multilingual page, so that its
             merges cover non-ASCII text), saved as vocab.json + merges.txt and loaded by ours
             (bart_pretrain encode): the same ids as tokenizers' and transformers' BartTokenizer on every line and
             every file of the corpus and on non-ASCII text; examples/bart/tokenizer/unicode_classes.h equals the classes
             of tokenizers' pre-tokenizer

No network: nothing is downloaded (HF_HUB_OFFLINE); every model and vocabulary is made here. Without
torch/transformers/tokenizers/safetensors (Debian's python3) it prints SKIP and exits 77.
"""
import glob
import gzip
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from pycheck import check, skip  # noqa: E402  (check: an assert that python -O keeps)
from corpus_oracle import split_sentences  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:
    import numpy as np
    import safetensors  # noqa: F401
    import tokenizers  # noqa: F401
    import torch
    import transformers  # noqa: F401
except ImportError as e:  # Debian's python3 (a system build without the project's environment) has none of these
    skip(f"{e}: the Hugging Face oracles need the project's Python environment (scripts/install-deps.sh; ZS_PYTHON)")

torch.set_num_threads(1)  # small models; the machine is shared with the build and the other tests

DATA = "/usr/share/common-licenses"
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
# bart_model.cpp's "tiny": the shapes are read back from the exported tensors and checked against these;
# the number of heads cannot be read from any shape, so it comes from here.
TINY = dict(d_model=128, layers=2, heads=4, ffn_dim=512, max_position_embeddings=256)
# The batch --save-logits evaluates: the first 4 validation examples (of the held-out documents, 128 tokens at
# most), built here as prepare and packed_examples.cpp build them. --mask-ratio 0 --no-permute make the noise the identity (text infilling
# masks round(0 * n) = 0 tokens, no sentence permutation), so source = target = <s> sentences </s>, padded.
MAX_TOKENS, LOGITS_BATCH = 128, 4
VALIDATION_DOCS = 2  # whole documents held out (--validation-docs, every run here), which validation_examples rebuilds
NO_NOISE = ["--mask-ratio", "0", "--no-permute"]
# fp32 agreement of two implementations (LibTorch 1.13's kernels against PyTorch 2.x's, sdpa or eager attention,
# other summation orders): max |ours - HF| <= FP32_BOUND * max |HF logits|. Measured: 4.0e-7 (export: max |diff|
# 9.5e-7 on logits up to 2.37) and 3.4e-7 (import: 1.9e-6 on logits up to 5.57), about 3 float32 epsilons of the
# largest logit; each side is that far from the float64 result too (ours 4.5e-7 and 5.0e-7, HF's fp32 4.7e-7 and
# 4.6e-7 of max |logit|: the summary line prints both). 2e-6 is 5x the measured agreement, and still 10^4 to 10^5
# below real mistakes: dropping the encoder padding mask moves logits by 0.15 to 0.53, masking the decoder's padding
# by 0.05 to 0.49, one fc2 bias of one layer moved by random 1e-3 by 2.6e-5 to 1.6e-3.
FP32_BOUND = 2e-6
SEED = 1234


def run(cmd, expect=0, env=None):
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != expect:
        sys.exit(f"FAIL: {' '.join(cmd)}: exit {p.returncode}, expected {expect}\n{p.stdout[-6000:]}{p.stderr[-6000:]}")
    return p.stdout, p.stderr


def pretrain(build, run_dir, nproc, *args):
    exe = os.path.join(build, "examples", "bart_pretrain")
    data = [] if "--data" in args else ["--data", DATA]
    base = [exe, *data, "--run-dir", run_dir, "--no-plot", "--progress-interval", "1000", "--validation-docs",
            str(VALIDATION_DOCS), *args]
    env = dict(os.environ, ZS_LOG_LEVEL="warn")
    if nproc == 0:  # alone, without the launcher
        return run(base, env=env)
    return run([os.path.join(build, "zeroshard-run"), "--nproc-per-node", str(nproc), "--", *base], env=env)


# ---- the batch of --save-logits, rebuilt from the corpus (examples/bart/data/corpus.cpp) ----

def read_texts(directory):
    """corpus.cpp read_texts: regular files under `directory` (recursively, links followed) in std::filesystem::path
    order (component by component), a link to a file already read skipped, empty files skipped; bytes."""
    files = []
    for root, dirs, names in os.walk(directory, followlinks=True):
        files += [os.path.join(root, n) for n in names if os.path.isfile(os.path.join(root, n))]
    files.sort(key=lambda f: [part.encode() for part in f.split(os.sep)])
    seen, texts = set(), []
    for f in files:
        real = os.path.realpath(f)
        if real in seen:
            continue
        seen.add(real)
        with open(f, "rb") as fh:
            data = fh.read()
        if data:
            texts.append(data)
    return texts


def validation_examples(texts, encode, count):
    """packed_examples.cpp: sentences encoded (a leading space after a text's first), packed greedily into examples
    of at most MAX_TOKENS - 2 tokens, never across texts (documents); with --validation-docs V (VALIDATION_DOCS), the
    examples of documents floor((2j + 1) D / 2V) for each j < V of the D are held out. Returns the first `count`
    held-out examples as flat token lists."""
    docs = [[encode((b"" if k == 0 else b" ") + s) for k, s in enumerate(split_sentences(t))] for t in texts]
    docs = [d for d in docs if d]  # a document without a sentence is not recorded
    held_count = VALIDATION_DOCS
    held = {(2 * j + 1) * len(docs) // (2 * held_count) for j in range(held_count)}
    budget, out = MAX_TOKENS - 2, []
    for d, sentences in enumerate(docs):
        if d not in held:
            continue
        ex, used = [], 0
        for ids in sentences:
            p = 0
            while p < len(ids):
                take = min(len(ids) - p, budget)
                if used + take > budget:
                    if ex:
                        out.append(ex)
                    ex, used = [], 0
                ex += ids[p:p + take]
                used += take
                p += take
        if ex:
            out.append(ex)
        if len(out) >= count:
            return out[:count]
    return out


def logits_batch(tokenizer_dir, bos, eos, pad):
    """input_ids, attention_mask and decoder_input_ids of the batch run.cpp's --save-logits evaluates (with
    NO_NOISE): the tokens come from Hugging Face's byte-level BPE with our vocabulary (the corpus is ASCII, where
    the tokenizer check shows both tokenizers agree)."""
    from tokenizers import ByteLevelBPETokenizer
    tok = ByteLevelBPETokenizer(os.path.join(tokenizer_dir, "vocab.json"), os.path.join(tokenizer_dir, "merges.txt"),
                                add_prefix_space=False)
    examples = validation_examples(read_texts(DATA), lambda b: tok.encode(b.decode("utf-8")).ids, LOGITS_BATCH)
    check(len(examples) == LOGITS_BATCH, f"the corpus under {DATA} has {len(examples)} validation examples")
    rows = [[bos, *e, eos] for e in examples]
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), pad, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, :len(row)] = torch.tensor(row)
    # training.cpp: labels = target (= source here); the decoder reads them shifted right behind
    # decoder_start_token_id (eos), padding staying padding (shift_tokens_right).
    decoder = torch.full_like(ids, pad)
    decoder[:, 1:] = ids[:, :-1]
    decoder[:, 0] = eos
    return ids, (ids != pad).long(), decoder


def hf_logits(model, ids, mask, decoder):
    """Hugging Face's logits in eval mode (no dropout), with its default attention (sdpa) and with eager; and in
    float64 (eager), for the report only: how far each fp32 side is from the exact result."""
    import copy
    out = {}
    model.eval()
    for impl in ("sdpa", "eager"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            # No decoder_attention_mask: HF's decoder then masks only the future, as ours does.
            out[impl] = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder).logits.float().numpy()
    exact = copy.deepcopy(model).double()
    with torch.no_grad():
        out["fp64"] = exact(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder).logits.numpy()
    model.set_attn_implementation("sdpa")
    return out


def compare_logits(what, ours_path, theirs, vocab):
    ours = np.fromfile(ours_path, dtype=np.float32)
    ref = theirs["sdpa"]
    check(ours.size == ref.size, (
        f"{what}: --save-logits wrote {ours.size} floats, the rebuilt batch gives {list(ref.shape)} = {ref.size}: "
        f"the batch rebuilt here is not the one run.cpp evaluates (corpus.cpp or the tokenizer changed?)"))
    ours = ours.reshape(ref.shape)
    check(ref.shape[-1] == vocab and np.isfinite(ours).all(),
          lambda: f"{what}: {ref.shape[-1]} logits per position for a vocabulary of {vocab}; "
                  f"{int((~np.isfinite(ours)).sum())} of our {ours.size} logits not finite")
    scale = float(np.max(np.abs(ref)))
    exact = theirs["fp64"]
    report = {"ours_vs_fp64": float(np.abs(ours - exact).max()) / scale,
              "hf_vs_fp64": float(np.abs(ref - exact).max()) / scale}
    for impl in ("sdpa", "eager"):
        t = theirs[impl]
        diff = np.abs(ours - t)
        worst = float(diff.max())
        at = np.unravel_index(int(diff.argmax()), diff.shape)
        report[impl] = worst
        check(worst <= FP32_BOUND * scale, (
            f"{what}: logits differ from Hugging Face's ({impl} attention): max |diff| {worst:.3e} at (example, "
            f"position, token) {tuple(int(x) for x in at)}: ours {ours[at]:.6f}, HF {t[at]:.6f}; bound "
            f"{FP32_BOUND} x max |logit| {scale:.3f} = {FP32_BOUND * scale:.3e}"))
    return list(ref.shape), scale, report


def hf_config(vocab, pad, bos, eos, d_model, layers, heads, ffn, positions):
    from transformers import BartConfig
    return BartConfig(vocab_size=vocab, d_model=d_model, encoder_layers=layers, decoder_layers=layers,
                      encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn,
                      decoder_ffn_dim=ffn, max_position_embeddings=positions, dropout=0.1, attention_dropout=0.1,
                      activation_dropout=0.1, activation_function="gelu", scale_embedding=False,
                      tie_word_embeddings=True, pad_token_id=pad, bos_token_id=bos, eos_token_id=eos,
                      decoder_start_token_id=eos, forced_eos_token_id=eos)


def special_ids(tokenizer_dir):
    with open(os.path.join(tokenizer_dir, "vocab.json"), encoding="utf-8") as f:
        vocab = json.load(f)
    return vocab, vocab["<s>"], vocab["</s>"], vocab["<pad>"]


def read_safetensors(path):
    from safetensors.numpy import load_file
    return load_file(path)


def check_export(build, work):
    from transformers import BartForConditionalGeneration
    d, hf_dir = os.path.join(work, "run"), os.path.join(work, "hf")
    for x in (d, hf_dir):
        shutil.rmtree(x, ignore_errors=True)
    steps = 20
    pretrain(build, d, 2, "--max-steps", str(steps), "--save-every", str(steps), "--eval-every", "0", "--no-sample")
    # bart_pretrain export-hf writes everything from_pretrained reads; nothing is written here.
    exe = os.path.join(build, "examples", "bart_pretrain")
    run([exe, "export-hf", "--run-dir", d, "--out", hf_dir])  # the run's options after the subcommand, as typed
    files = sorted(os.listdir(hf_dir))
    check(files == ["config.json", "merges.txt", "model.safetensors", "special_tokens_map.json",
                    "tokenizer_config.json", "vocab.json"], lambda: f"export-hf wrote {files}")
    tensors = read_safetensors(os.path.join(hf_dir, "model.safetensors"))
    check("final_logits_bias" in tensors, "export-hf did not export final_logits_bias")
    # The config it wrote is the tiny one with the run's vocabulary, checked against the tensors' shapes.
    vocab_json, bos, eos, pad = special_ids(os.path.join(d, "tokenizer"))
    vocab, d_model = tensors["model.shared.weight"].shape
    layers = len({k.split(".")[3] for k in tensors if k.startswith("model.encoder.layers.")})
    dec_layers = len({k.split(".")[3] for k in tensors if k.startswith("model.decoder.layers.")})
    ffn = tensors["model.encoder.layers.0.fc1.weight"].shape[0]
    positions = tensors["model.encoder.embed_positions.weight"].shape[0] - 2  # BART's offset of 2
    got = dict(d_model=d_model, layers=layers, heads=TINY["heads"], ffn_dim=ffn, max_position_embeddings=positions)
    check(got == TINY and dec_layers == layers, f"the export is not the tiny config: {got}, "
                                                f"{dec_layers} decoder layers")
    check(vocab == max(vocab_json.values()) + 1, (vocab, len(vocab_json)))
    with open(os.path.join(hf_dir, "config.json"), encoding="utf-8") as f:
        written = json.load(f)
    want = hf_config(vocab, pad, bos, eos, d_model, layers, TINY["heads"], ffn, positions).to_dict()
    for key in ("vocab_size", "d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads",
                "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim", "max_position_embeddings",
                "activation_function", "scale_embedding", "tie_word_embeddings", "pad_token_id", "bos_token_id",
                "eos_token_id", "decoder_start_token_id", "forced_eos_token_id", "model_type"):
        check(written.get(key) == want[key], lambda: f"config.json {key}: {written.get(key)!r}, want {want[key]!r}")
    # The tokenizer loads as is and encodes as ours does.
    from transformers import BartTokenizer
    hf_tok = BartTokenizer.from_pretrained(hf_dir)
    texts = ["The quick brown fox jumps over the lazy dog.", "  Two  spaces, and\ta tab; don't stop!"]
    inp = "".join(json.dumps(t) + "\n" for t in texts)
    p = subprocess.run([exe, "encode", "--tokenizer", hf_dir], input=inp.encode("utf-8"), capture_output=True)
    check(p.returncode == 0, lambda: p.stderr.decode()[-2000:])
    ours = [json.loads(line) for line in p.stdout.decode().splitlines()]
    for t, o in zip(texts, ours):
        theirs = hf_tok(t, add_special_tokens=False)["input_ids"]
        check(theirs == o, lambda: f"BartTokenizer.from_pretrained({hf_dir}) encodes {t!r} as {theirs}, ours {o}")
    check((hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id) == (bos, eos, pad),
          lambda: f"the tokenizer's specials {hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id}")
    model, info = BartForConditionalGeneration.from_pretrained(hf_dir, output_loading_info=True)
    for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        check(not info[k], lambda: f"from_pretrained({hf_dir}): {k} {sorted(info[k])[:10]}")
    # Every tensor as exported, the head and both token embeddings tied to model.shared.
    state = model.state_dict()
    for name, t in tensors.items():
        check(np.array_equal(state[name].numpy(), t), f"{name} differs after from_pretrained")
    shared = state["model.shared.weight"]
    for tied in ("lm_head.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"):
        check(torch.equal(state[tied], shared), f"{tied} is not model.shared.weight after from_pretrained")

    logits = os.path.join(work, "logits_ours.f32")
    pretrain(build, d, 2, "--max-steps", str(steps), "--eval-every", "0", "--no-sample", *NO_NOISE,
             "--save-logits", logits)
    ids, mask, decoder = logits_batch(os.path.join(d, "tokenizer"), bos, eos, pad)
    shape, scale, diffs = compare_logits("export", logits, hf_logits(model, ids, mask, decoder), vocab)
    print(f"export: {steps} steps on 2 ranks (ZeRO-3), {len(tensors)} tensors exported, from_pretrained: no missing/"
          f"unexpected key; logits {shape} ({int((mask == 0).sum())} padded source positions), max |logit| "
          f"{scale:.2f}: max |ours - HF| {diffs['sdpa']:.2e} (sdpa), {diffs['eager']:.2e} (eager) = "
          f"{max(diffs['sdpa'], diffs['eager']) / scale:.1e} x max |logit| (bound {FP32_BOUND:g}; from float64: ours "
          f"{diffs['ours_vs_fp64']:.1e}, HF fp32 {diffs['hf_vs_fp64']:.1e})")


def randomize(model, seed):
    """Every parameter and buffer away from its initial value (HF initialises biases, layer norms'
    shifts and final_logits_bias to 0, layer norms' scales to 1): a tensor the import missed, or one
    used the wrong way, then shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):  # tied ones once
            scale = 0.5 if name == "final_logits_bias" else 0.1 if "norm" in name else 0.05
            p.add_(torch.randn(p.shape, generator=g) * scale)


def check_import(build, work):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import BartForConditionalGeneration
    d, hf_dir, tok_dir = (os.path.join(work, n) for n in ("run", "hf", "tokenizer"))
    for x in (d, hf_dir, tok_dir):
        shutil.rmtree(x, ignore_errors=True)
    # A Hugging Face vocabulary too: ours loads it (--tokenizer), as with a real BART's vocab.json/merges.txt.
    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    tok.train(corpus_files(), vocab_size=2048, min_frequency=2, special_tokens=SPECIALS, show_progress=False)
    os.makedirs(tok_dir)
    tok.save_model(tok_dir)
    vocab_json, bos, eos, pad = special_ids(tok_dir)
    vocab = max(vocab_json.values()) + 1
    config = hf_config(vocab, pad, bos, eos, TINY["d_model"], TINY["layers"], TINY["heads"], TINY["ffn_dim"],
                       TINY["max_position_embeddings"])
    torch.manual_seed(SEED)
    model = BartForConditionalGeneration(config)
    randomize(model, SEED)
    model.save_pretrained(hf_dir)
    st = os.path.join(hf_dir, "model.safetensors")
    saved = read_safetensors(st)
    check("final_logits_bias" in saved and "model.shared.weight" in saved,
          lambda: f"{st} lacks final_logits_bias or model.shared.weight: {sorted(saved)[:10]}")
    run([os.path.join(build, "zeroshard-ckpt"), "import", st, os.path.join(d, "checkpoints"), "--safetensors",
         "--step", "1"])
    # Our side reads Hugging Face's config.json (--config) and the vocabulary; the imported step is 1 and so is
    # --max-steps: nothing trains, the logits are the imported model's.
    logits = os.path.join(work, "logits_ours.f32")
    pretrain(build, d, 0, "--config", os.path.join(hf_dir, "config.json"), "--tokenizer", tok_dir,
             "--max-steps", "1", "--eval-every", "0", "--no-sample", *NO_NOISE, "--save-logits", logits)
    ids, mask, decoder = logits_batch(tok_dir, bos, eos, pad)
    shape, scale, diffs = compare_logits("import", logits, hf_logits(model, ids, mask, decoder), vocab)
    print(f"import: random HF BART (seed {SEED}, {len(saved)} tensors, every one random) saved with save_pretrained, "
          f"imported, run by bart_pretrain --config config.json: logits {shape}, max |logit| {scale:.2f}: max |ours "
          f"- HF| {diffs['sdpa']:.2e} (sdpa), {diffs['eager']:.2e} (eager) = "
          f"{max(diffs['sdpa'], diffs['eager']) / scale:.1e} x max |logit| (bound {FP32_BOUND:g}; from float64: ours "
          f"{diffs['ours_vs_fp64']:.1e}, HF fp32 {diffs['hf_vs_fp64']:.1e})")


# ---- the tokenizer ----

def corpus_files():
    """The demo corpus's files, each once (GPL, LGPL and GFDL are links to a versioned file)."""
    return sorted({os.path.realpath(f) for f in glob.glob(os.path.join(DATA, "**"), recursive=True)
                   if os.path.isfile(f)})


# Non-ASCII text: accents (precomposed and combining), other scripts, emoji (with modifiers and joiners),
# typographic punctuation, numbers outside ASCII digits, letters below U+00C0 (ª µ º), unusual whitespace.
MULTILINGUAL = [
    "Grüße aus Köln: Straße, Mädchen, Übermaß und naïve Cafés à la française.",
    "¿Qué tal? ¡Mañana será otro día! El niño comió piñones.",
    "Ångström, Øresund, Æsir; Zoë's résumé isn't déjà vu, l'été d'Hélène.",
    "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "Σίσυφος και Ὀδυσσεύς· ΑΒΓΔ αβγδ.",
    "中文字符测试：你好，世界！日本語のテキスト、ひらがなとカタカナ。한국어 문장입니다.",
    "שָׁלוֹם עוֹלָם and مرحبا بالعالم ١٢٣ ٤٥٦ and हिन्दी क्षत्रिय नमस्ते.",
    "Emoji: 🙂🙂 ok🙂ok 👍🏽 👨\u200d👩\u200d👧 ❤️ 🎉🎉🎉 end🎉.",
    "Units and numbers: 10µm, 5µs, 25°C, x²+y²=z², ½ cup, 1½ cups, ¾ done, ²3 ³4.",
    "Fullwidth ＡＢＣ ９９ x９, Roman ⅫⅪ Ⅻa, circled ①②③abc, superscript ª1 º2 nº5.",
    "Quotes “curly” ‘single’ — dashes – and… ellipses; don’t, it’s, I’m, we’ll, they’ve.",
    "Prices: €100, £5, ¥300, ₹42, $7.50 and 3×4÷2 ± 1 ≤ 2 ≥ 0 ≠ ∞.",
    "Combining: cafe\u0301 e\u0301e a\u0300a n\u0303; ligature ﬁne ﬂow; Ǆ ǅ ǆ ǅungla.",
    "Whitespace:\tTAB\t\ttabs  two   three\u00a0nbsp\u00a0\u00a0x\u3000ideographic\u2009thin\u202fnarrow end.",
    "Numbers 12345 678,90 3.14159 1e-9 0x1F 2024-06-01 +49 (0)30 123456.",
    "Contractions: I'm you're he's she'd we've they'll 'tis O'Neil'll x'S ''s it's.",
]
# Short cases for each branch of GPT-2's pattern,
#   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
EDGE_CASES = [
    "", " ", "  ", "a", " a", "  a", "a  ", "a \t b", "a\t\tb", " \n x", "\n\n", "a\n\nb", "a\r\n\r\n c", "\t x",
    "x \u00a0 y", "\u00a0\u00a0a", "\u3000x", "x\u0085y", "ab\u2028cd", "a\u2029b", "x\u200by", "\x0c\x0b x",
    "I'm", "we'll", "they've", "'s", "''s", " 's", "x'S", "O'Neil'll", "it’s", "I’m", "don't!!'s", "'",
    "123", " 123", "1,234.56", "3rd", "v2.0", "²3", "1½", "x²", "٣٤a", "x９", "Ⅻa", "①②③abc", "ª1", "µm", "3µ",
    "ok🙂ok", "🙂🙂 a🙂", "a€b", "10€", "x×y", "«quote»", "e\u0301e", "\u0300a", "ﬁne", "ǅungla", "mañana",
    "Σίσυφος", "Привет, мир!", "中文ok", "한국어", "क्षि", "مرحبا١٢٣", "שָׁלוֹם", "Ωmega ωmega", "naïve café",
]


# tokenizer.cpp's is_space(): \s of GPT-2's pattern.
WHITESPACE = [0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F,
              0x205F, 0x3000]


def hf_classes():
    """Each code point's class in tokenizers' ByteLevel pre-tokenizer (GPT-2's pattern on Oniguruma):
    'L' (\\p{L}), 'N' (\\p{N}), 'S' (\\s), 'P' (the rest); surrogates 'x'."""
    from tokenizers import pre_tokenizers
    pt = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    out = []
    for cp in range(0x110000):
        if 0xD800 <= cp <= 0xDFFF:
            out.append("x")
            continue
        ch = chr(cp)
        if len(pt.pre_tokenize_str("a" + ch)) == 1:
            out.append("L")
        elif len(pt.pre_tokenize_str("1" + ch)) == 1:
            out.append("N")
        elif len(pt.pre_tokenize_str("!" + ch)) == 1:
            out.append("P")
        else:
            out.append("S")
    return "".join(out)


def ranges_of(classes, c):
    out, start = [], None
    for cp, k in enumerate(classes + "."):
        if k == c and start is None:
            start = cp
        elif k != c and start is not None:
            out.append((start, cp - 1))
            start = None
    return out


def header_ranges(path, name):
    import re
    with open(path, encoding="utf-8") as f:
        text = f.read()
    body = text[text.index(name):]
    body = body[:body.index("};")]
    return [(int(a, 16), int(b, 16)) for a, b in re.findall(r"\{0x([0-9A-Fa-f]+), 0x([0-9A-Fa-f]+)\}", body)]


def check_tokenizer(build, work):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import BartTokenizer
    # 1. tokenizer.cpp's letter and number tables and its whitespace list are tokenizers' classes.
    classes = hf_classes()
    table = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "bart",
                         "tokenizer/unicode_classes.h")
    check(os.path.exists(table), f"{table} is missing (tokenizer.cpp's Unicode classes)")
    for name, c in (("kLetters", "L"), ("kNumbers", "N")):
        want, got = ranges_of(classes, c), header_ranges(table, name)
        first = next(((a, b) for a, b in zip(got + [None] * len(want), want + [None] * len(got)) if a != b), None)
        check(got == want, f"unicode_classes.h {name}: {len(got)} ranges, tokenizers' pre-tokenizer gives "
                           f"{len(want)}; first difference (ours, theirs): {first}")
    spaces = [cp for cp, k in enumerate(classes) if k == "S"]
    check(spaces == WHITESPACE,
          lambda: f"tokenizers' \\s is {[hex(c) for c in spaces]}; tokenizer.cpp's is_space differs")

    # 2. A vocabulary trained by tokenizers, loaded by ours.
    tok_dir = os.path.join(work, "vocab")
    shutil.rmtree(tok_dir, ignore_errors=True)
    os.makedirs(tok_dir)
    page = os.path.join(work, "multilingual.txt")
    with open(page, "w", encoding="utf-8") as f:  # repeated: merges over non-ASCII bytes need frequent pairs
        f.write("\n".join(MULTILINGUAL * 20) + "\n")
    files = corpus_files()
    trainer_tok = ByteLevelBPETokenizer(add_prefix_space=False)
    trainer_tok.train(files + [page], vocab_size=2048, min_frequency=2, special_tokens=SPECIALS, show_progress=False)
    trainer_tok.save_model(tok_dir)
    vocab, merges = os.path.join(tok_dir, "vocab.json"), os.path.join(tok_dir, "merges.txt")
    # The oracles, with BART's settings: no prefix space, GPT-2's pattern (ByteLevel use_regex), no normalizer.
    hf = ByteLevelBPETokenizer(vocab, merges, add_prefix_space=False)
    bart_tok = BartTokenizer(vocab=vocab, merges=merges, add_prefix_space=False)  # transformers 5: vocab=, merges=
    state = json.loads(hf._tokenizer.pre_tokenizer.__getstate__())
    check(state["add_prefix_space"] is False and state["use_regex"] is True, state)

    lines, whole = [], []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            text = fh.read()
        whole.append(text)
        lines += text.split("\n")
    texts = lines + whole + MULTILINGUAL + EDGE_CASES
    inp = "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in texts)
    exe = os.path.join(build, "examples", "bart_pretrain")
    p = subprocess.run([exe, "encode", "--tokenizer", tok_dir], input=inp.encode("utf-8"), capture_output=True)
    err = p.stderr.decode("utf-8", "replace")
    check(p.returncode == 0, f"{exe} encode --tokenizer {tok_dir}: exit {p.returncode}"
                             + (" (a bart_pretrain without the encode subcommand: rebuild it)"
                                if "encode" in err and "not expected" in err else "") + f"\n{err[-3000:]}")
    ours = [json.loads(line) for line in p.stdout.decode("utf-8").splitlines()]
    check(len(ours) == len(texts), f"bart_pretrain encode printed {len(ours)} lines for {len(texts)} texts")
    theirs = [e.ids for e in hf.encode_batch(texts)]
    bad = [(t, a, b, "tokenizers") for t, a, b in zip(texts, ours, theirs) if a != b]
    skipped = 0
    for t, a in zip(texts, ours):  # transformers' BartTokenizer reads special tokens in text; ours does not
        if any(s in t for s in SPECIALS):
            skipped += 1
            continue
        b = bart_tok(t, add_special_tokens=False)["input_ids"]
        if a != b:
            bad.append((t, a, b, "BartTokenizer"))
    if bad:
        def around(ids, k):  # the tokens around the first difference
            return [hf.id_to_token(i) for i in ids[max(0, k - 3):k + 6]]
        show = []
        for t, a, b, oracle in bad[:8]:
            k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            show.append(f"  {t[:100]!r} (vs {oracle}), from token {k}:\n    ours {around(a, k)}\n"
                        f"    HF   {around(b, k)}")
        sys.exit(f"FAIL: tokenizer: {len(bad)} of {2 * len(texts) - skipped} encodings ({len({x[0] for x in bad})} "
                 f"texts) differ from Hugging Face's:\n" + "\n".join(show))
    check_tokenizer_training(exe, work, files + [page])
    non_ascii = sum(1 for t in texts if any(ord(c) > 127 for c in t))
    tokens = sum(len(a) for a in ours)
    print(f"tokenizer: ByteLevelBPETokenizer ({hf.get_vocab_size()} entries, trained on {len(files)} corpus files + a "
          f"multilingual page) loaded by ours: the same ids as tokenizers' and BartTokenizer's on {len(lines)} corpus "
          f"lines, {len(whole)} whole files, {len(MULTILINGUAL) + len(EDGE_CASES)} more texts ({non_ascii} non-ASCII) "
          f"- {tokens} tokens; unicode_classes.h = tokenizers' classes ({len(ranges_of(classes, 'L'))} letter, "
          f"{len(ranges_of(classes, 'N'))} number ranges; {len(spaces)} whitespace code points)")


def content_of(path):
    """A corpus file's text: a .gz decompressed (Python's gzip), else as it is."""
    with open(path, "rb") as f:
        data = f.read()
    return gzip.decompress(data) if path.endswith(".gz") else data


def sampled_sentences(training):
    """The sentences `bart_pretrain train-tokenizer` learned from, rebuilt from its training.json: each range of
    the sample cut at separator lines (the first line only where the range starts a line), split into sentences
    (corpus_oracle), a space before every sentence but a document's first (a range starting a file starts one)."""
    sep = training["document_separator"].encode()
    out = []
    for r in training["sample"]:
        data = content_of(r["path"])  # the ranges are in the text's bytes (decompressed)
        text = data[r["begin"]:r["end"]]
        line_start = r["begin"] == 0 or data[r["begin"] - 1] == 0x0A
        parts, cur = [], []
        for k, line in enumerate(text.split(b"\n")):
            if sep and (k > 0 or line_start) and line.strip(b" \t\r") == sep:
                parts.append(b"\n".join(cur))
                cur = []
            else:
                cur.append(line)
        parts.append(b"\n".join(cur))
        for k, part in enumerate(parts):
            first = r["begin"] == 0 if k == 0 else True
            for sentence in split_sentences(part):
                out.append(sentence if first else b" " + sentence)
                first = False
    return out


def hf_trained_merges(sentences, vocab_size, out_dir):
    """tokenizers' BpeTrainer, BART's way (byte-level, no prefix space, every byte in the alphabet), on the
    sentences: its merges.txt's lines."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=0, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator([s.decode("utf-8") for s in sentences], trainer=trainer)
    os.makedirs(out_dir, exist_ok=True)
    tk.model.save(out_dir)
    return merges_of(out_dir)


def merges_of(tok_dir):
    with open(os.path.join(tok_dir, "merges.txt"), encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f if line.strip() and not line.startswith("#version")]


def check_tokenizer_training(exe, work, files):
    """3. Our trainer learns the merges tokenizers' BpeTrainer learns from the same sentences: from a whole corpus,
    and from a sample of windows spread over a larger one cut into documents at separator lines, plain and gzip
    (whose windows are as long in text: about the sample asked, not the windows counted in compressed bytes)."""
    corpus = os.path.join(work, "training-corpus")
    shutil.rmtree(corpus, ignore_errors=True)
    os.makedirs(corpus)
    for f in files:
        shutil.copy(f, corpus)
    sampled = os.path.join(work, "sampled-corpus")  # 3 files of about 1 MB: documents of 40 lines, '%' between
    shutil.rmtree(sampled, ignore_errors=True)
    os.makedirs(sampled)
    lines = []
    for f in files:
        with open(f, "rb") as fh:
            lines += fh.read().split(b"\n")
    for n in range(3):
        with open(os.path.join(sampled, f"part-{n}"), "wb") as out:
            size, k = 0, n * 997
            while size < 1_000_000:
                doc = b"\n".join(lines[(k + i) % len(lines)] for i in range(40)) + b"\n%\n"
                out.write(doc)
                size += len(doc)
                k += 40
    sampled_gz = os.path.join(work, "sampled-corpus-gz")  # the same files, gzip-compressed: windows of text
    shutil.rmtree(sampled_gz, ignore_errors=True)
    os.makedirs(sampled_gz)
    for n in range(3):
        with open(os.path.join(sampled, f"part-{n}"), "rb") as f:
            open(os.path.join(sampled_gz, f"part-{n}.gz"), "wb").write(gzip.compress(f.read(), 6))
    sampling = ["--sample-mb", "0.4", "--chunk-bytes", "16384", "--document-separator", "%", "--workers", "3"]
    for name, data, vocab, extra in (
            ("whole", corpus, 2048, ["--sample-mb", "1000"]),
            ("sampled", sampled, 3000, sampling),
            ("sampled-gzip", sampled_gz, 3000, sampling)):
        out = os.path.join(work, f"trained-{name}")
        shutil.rmtree(out, ignore_errors=True)
        run([exe, "train-tokenizer", "--data", data, "--vocab-size", str(vocab), "--out", out] + extra)
        with open(os.path.join(out, "training.json")) as f:
            training = json.load(f)
        total = sum(os.path.getsize(os.path.join(data, x)) for x in os.listdir(data))
        check(training["corpus_bytes"] == total, f"{name}: training.json says {training['corpus_bytes']} corpus "
                                                 f"bytes, the files hold {total}")
        if name == "whole":
            check(training["sample_bytes"] == total, f"whole: sampled {training['sample_bytes']} of {total} bytes")
        else:
            ranges = training["sample"]
            for r in ranges:  # each cut where a sentence ends: '.', '!' or '?' before whitespace, or a blank line
                text = content_of(r["path"])
                for at in (r["begin"], r["end"]):
                    after_end = text[at:at + 1] in (b" ", b"\t", b"\n", b"\r", b"\f", b"\v") and \
                        text[at - 1:at] in (b".", b"!", b"?")
                    after_blank_line = text[at - 1:at] == b"\n" and text[:at - 1].rstrip(b" \t\r").endswith(b"\n")
                    check(at in (0, len(text)) or after_end or after_blank_line,
                          f"sampled: {r['path']} is cut at byte {at}, not where a sentence ends: "
                          f"{text[max(0, at - 40):at + 40]!r}")
            check(0.3e6 < training["sample_bytes"] <= 0.4e6 + 16384 and len(ranges) >= 20
                  and len({r["path"] for r in ranges}) == 3,
                  f"sampled: {training['sample_bytes']} bytes in {len(ranges)} ranges of "
                  f"{len({r['path'] for r in ranges})} files; expected about 0.4 MB in windows over all 3")
        ours = merges_of(out)
        theirs = hf_trained_merges(sampled_sentences(training), vocab, os.path.join(work, f"hf-trained-{name}"))
        first = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        check(ours == theirs, f"train-tokenizer ({name}): {len(ours)} merges, tokenizers' BpeTrainer learned "
                              f"{len(theirs)} from the same sentences; first difference at merge {first}: ours "
                              f"{ours[first:first + 3]}, theirs {theirs[first:first + 3]}")
        with open(os.path.join(out, "vocab.json"), encoding="utf-8") as f:
            vocab_json = json.load(f)
        check(len(vocab_json) == vocab, f"{name}: {len(vocab_json)} distinct entries in vocab.json, not {vocab}")
        print(f"train-tokenizer ({name}): the {len(ours)} merges tokenizers' BpeTrainer learns from the same "
              f"{training['sample_bytes'] / 1e6:.2f} MB ({len(training['sample'])} ranges)")


if __name__ == "__main__":
    build, work, which = os.path.abspath(sys.argv[1]), sys.argv[2], sys.argv[3]
    work = os.path.abspath(os.path.join(work, "hf_" + which))  # the checks may run at the same time
    os.makedirs(work, exist_ok=True)
    {"export": check_export, "import": check_import, "tokenizer": check_tokenizer}[which](build, work)
    print("OK")
