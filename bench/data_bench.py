#!/usr/bin/env python3
"""BART's data path at corpus scale: `bart_pretrain prepare` beside Hugging Face `tokenizers` on the same text,
vocabulary and cores, and the trainer's start-up, memory and data wait as the corpus grows.

Usage: bench/data_bench.py BUILD_DIR [--sizes-gb 0.1 1 10] [--tokenizer-gb 1] [--formats-mb 100] [--work DIR]
                           [--workers N] [--keep]
(run with the project's Python: .venv/bin/python)

1. A pool of this machine's own text (Debian's changelogs, licenses and fortunes; valid UTF-8 only) is cut into
   documents of about 3 KB, and each corpus of S GB is files of 64 MB of them, a line '%' between documents.
2. A vocabulary of 8,192 entries is learned from the licenses and fortunes (bart_pretrain train-tokenizer).
3. Prepare: the smallest corpus, then each, on --workers threads (default: every core): MB of text per second,
   and per core. Beside it, `tokenizers`' ByteLevelBPETokenizer (same vocab.json/merges.txt) encodes the smallest
   corpus's sentences (when it is 1 GB or less) with encode_batch_fast (its fastest: no offsets) on the same number of threads (RAYON_NUM_THREADS; its sentence splitting,
   in Python, is not timed), and its ids are checked equal to the store's, sentence by sentence.
4. Training: tiny BART, 2 ranks, ZeRO-3, 20 steps of 32 sequences of 128 tokens (4 documents held out, evaluated
   before the first step and after the last), from each dataset, twice (the
   first run packs the examples into the dataset's file, the second only reads it): launch to the first step's
   metrics line, peak RSS per rank, and the share of the steps' time spent waiting for batches.
5. Corpora as they ship (--formats-mb, default 100; 0: skipped): the pool as JSON lines shards of 64 MB, a
   document per line, plain and compressed by the zstd CLI: prepare's MB of text per second on each beside
   `tokenizers`' encode_batch_fast on the same sentences (their ids checked equal to the store's).
6. Tokenizer training (--tokenizer-gb, default 1; 0: skipped): a corpus of that size, learned whole (--sample-mb
   its size) into BART's 50,265 entries by `bart_pretrain train-tokenizer`, and by `tokenizers`' BpeTrainer (BART's
   settings: byte-level, no prefix space, every byte in the alphabet, no minimum count) reading the same files
   itself (its fastest way: lines, in Rust), each in its own process on --workers threads: seconds, peak RSS, and
   the share of the two vocabularies' entries in common (ours learns from sentences, theirs from lines; from the
   same sentences they learn the same merges, tests/bart/check_hf.py).
Prints the tables docs/performance.md keeps.
"""
import argparse
import glob
import gzip
import json
import os
import shutil
import subprocess
import sys
import time

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "tests", "bart"))
from corpus_oracle import split_sentences  # noqa: E402

DOC_BYTES, FILE_BYTES = 3000, 64 << 20


def pool_text():
    parts = []
    for f in sorted(glob.glob("/usr/share/doc/*/changelog*.gz")):
        try:
            parts.append(gzip.open(f).read())
        except OSError:
            pass
    for f in sorted(glob.glob("/usr/share/common-licenses/*") + glob.glob("/usr/share/games/fortunes/*")):
        if os.path.isfile(f) and not f.endswith(".dat"):
            parts.append(open(f, "rb").read().replace(b"\n%\n", b"\n\n"))
    text = b"\n\n".join(parts).decode("utf-8", "ignore").replace("\r", "")
    # Documents of about DOC_BYTES, cut at line ends; no line is the separator.
    docs, cur, size = [], [], 0
    for line in text.split("\n"):
        if line.strip() == "%":
            continue
        cur.append(line)
        size += len(line) + 1
        if size >= DOC_BYTES:
            docs.append("\n".join(cur).strip("\n").encode())
            cur, size = [], 0
    return [d for d in docs if d.strip()]


def make_corpus(directory, gb, docs):
    os.makedirs(directory, exist_ok=True)
    total, want, k, n = 0, int(gb * 1e9), 0, 0
    while total < want:
        with open(os.path.join(directory, f"part-{n:05}.txt"), "wb") as f:
            size = 0
            while size < FILE_BYTES and total + size < want:
                d = docs[k % len(docs)] + b"\n%\n"
                f.write(d)
                size += len(d)
                k += 1
        total += size
        n += 1
    return total


def run(cmd, env=None):
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"FAIL: {' '.join(cmd)}: exit {p.returncode}\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    return p.stdout + p.stderr


def prepare(exe, corpus, tok, out, workers):
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.monotonic()
    run([exe, "prepare", "--data", corpus, "--tokenizer", tok, "--out", out, "--document-separator", "%",
         "--workers", str(workers)])
    return time.monotonic() - t0


def corpus_sentences(corpus):
    """The sentences prepare makes of a corpus of text files cut by '%' lines, as it encodes them; the bytes read."""
    sentences, nbytes = [], 0
    for f in sorted(glob.glob(os.path.join(corpus, "*"))):
        data = open(f, "rb").read()
        nbytes += len(data)
        for doc in data.split(b"\n%\n"):
            sentences += [((b"" if k == 0 else b" ") + s).decode() for k, s in enumerate(split_sentences(doc))]
    return sentences, nbytes


def hf_encode(sentences, tok, workers, dataset):
    """tokenizers' encode_batch on the sentences (as prepare makes them), timed; checked against the store."""
    os.environ["RAYON_NUM_THREADS"] = str(workers)
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    import numpy as np
    from tokenizers import ByteLevelBPETokenizer
    t = ByteLevelBPETokenizer(os.path.join(tok, "vocab.json"), os.path.join(tok, "merges.txt"), add_prefix_space=False)
    t0 = time.monotonic()
    encoded = t._tokenizer.encode_batch_fast(sentences, add_special_tokens=False)  # its fastest: no offsets
    seconds = time.monotonic() - t0
    idx = os.path.join(dataset, "tokens")
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    ds = IndexedDataset(idx, mmap=True)
    if len(ds) != len(encoded):
        sys.exit(f"FAIL: the store holds {len(ds)} sentences, tokenizers encoded {len(encoded)}")
    for i in range(len(ds)):
        if not np.array_equal(ds[i], np.asarray(encoded[i].ids, dtype=ds[i].dtype)):
            sys.exit(f"FAIL: sentence {i}: the store's ids differ from tokenizers' ({sentences[i][:80]!r})")
    return seconds, len(ds)


def json_lines_formats(exe, docs, work, tok, mb, workers):
    """The pool as JSON lines shards ({"id", "text", "source"} per document; 64 MB each), plain and zstd-compressed
    (the zstd CLI, level 3): prepare's seconds on each beside tokenizers' encode_batch_fast on the same sentences."""
    plain, packed = os.path.join(work, "jsonl"), os.path.join(work, "jsonl-zst")
    for d in (plain, packed):
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
    texts, total, n, k = [], 0, 0, 0
    while total < mb * 1e6:
        lines, size = [], 0
        while size < FILE_BYTES and total + size < mb * 1e6:
            text = docs[k % len(docs)].decode()
            lines.append(json.dumps({"id": k, "text": text, "source": "debian"}) + "\n")
            texts.append(text.encode())
            size += len(lines[-1])
            k += 1
        blob = "".join(lines).encode()
        open(os.path.join(plain, f"part-{n:05}.jsonl"), "wb").write(blob)
        subprocess.run(["zstd", "-q", "-3", "-o", os.path.join(packed, f"part-{n:05}.jsonl.zst"), "-"], input=blob,
                       check=True)
        total += size
        n += 1
    sentences = [((b"" if k == 0 else b" ") + s).decode() for t in texts for k, s in enumerate(split_sentences(t))]
    text_bytes = sum(len(t) for t in texts)
    rows = []
    for name, corpus in (("JSON lines", plain), ("JSON lines, .zst", packed)):
        dataset = os.path.join(work, "dataset-" + os.path.basename(corpus))
        shutil.rmtree(dataset, ignore_errors=True)
        t0 = time.monotonic()
        run([exe, "prepare", "--data", corpus, "--tokenizer", tok, "--out", dataset, "--workers", str(workers)])
        ours = time.monotonic() - t0
        hf_s, _ = hf_encode(sentences, tok, workers, dataset)
        disk = sum(os.path.getsize(f) for f in glob.glob(os.path.join(corpus, "*")))
        rows.append({"format": name, "disk_bytes": disk, "text_bytes": text_bytes, "prepare_s": ours, "hf_s": hf_s})
        print(json.dumps(rows[-1]), flush=True)
        shutil.rmtree(dataset)
    shutil.rmtree(plain)
    shutil.rmtree(packed)
    return rows


def timed(cmd, env=None):
    """Runs cmd; its seconds and peak RSS in bytes (its VmHWM, read every 20 ms: the children's ru_maxrss would
    count this process's memory, which a child has until it execs)."""
    t0 = time.monotonic()
    with open(os.path.join("/tmp", f"zs-data-bench-{os.getpid()}.log"), "w+") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
        peak = 0
        while p.poll() is None:
            try:
                with open(f"/proc/{p.pid}/status") as f:
                    peak = max([peak] + [int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:")])
            except (OSError, ValueError):
                pass
            time.sleep(0.02)
        seconds = time.monotonic() - t0
        log.seek(0)
        out = log.read()
    os.remove(log.name)
    if p.returncode != 0:
        sys.exit(f"FAIL: {' '.join(cmd)}: exit {p.returncode}\n{out[-3000:]}")
    return seconds, peak


HF_TRAIN = """
import sys
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
out, vocab, files = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
tk = Tokenizer(models.BPE())
tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=0, special_tokens=["<s>", "<pad>", "</s>", "<unk>",
                              "<mask>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
tk.train(files, trainer=trainer)
tk.model.save(out)
"""


def tokenizer_training(exe, corpus, work, workers, vocab=50265):
    ours, theirs = os.path.join(work, "trained-ours"), os.path.join(work, "trained-hf")
    for d in (ours, theirs):
        shutil.rmtree(d, ignore_errors=True)
    os.makedirs(theirs)
    files = sorted(glob.glob(os.path.join(corpus, "*")))
    nbytes = sum(os.path.getsize(f) for f in files)
    env = dict(os.environ, ZS_LOG_LEVEL="info")
    our_s, our_rss = timed([exe, "train-tokenizer", "--data", corpus, "--vocab-size", str(vocab), "--sample-mb",
                            str(nbytes / 1e6 + 1), "--workers", str(workers), "--out", ours], env)
    training = json.load(open(os.path.join(ours, "training.json")))
    hf_s, hf_rss = timed([sys.executable, "-c", HF_TRAIN, theirs, str(vocab)] + files,
                         dict(os.environ, RAYON_NUM_THREADS=str(workers), TOKENIZERS_PARALLELISM="true"))
    a, b = (set(json.load(open(os.path.join(d, "vocab.json")))) for d in (ours, theirs))
    return {"bytes": nbytes, "sample_bytes": training["sample_bytes"], "ours_s": our_s, "ours_rss": our_rss,
            "count_s": training["seconds"]["count"], "learn_s": training["seconds"]["learn"], "hf_s": hf_s,
            "hf_rss": hf_rss, "common": len(a & b) / len(b), "vocab": vocab}


def train(build, dataset, run_dir):
    """2 ranks, 20 steps: seconds from launch to the first step's metrics line, the summary."""
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    cmd = [os.path.join(build, "zeroshard-run"), "--nproc-per-node", "2", "--", os.path.join(build, "examples",
           "bart_pretrain"), "--dataset", dataset, "--run-dir", run_dir, "--config", "tiny", "--stage", "3",
           "--max-steps", "20", "--global-batch", "32", "--max-tokens", "128", "--eval-every", "0", "--no-sample",
           "--validation-docs", "4",
           "--no-plot", "--ckpt-dir", "none", "--progress-interval", "1000"]
    metrics = os.path.join(run_dir, "metrics.jsonl")
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, ZS_LOG_LEVEL="warn", OMP_NUM_THREADS="1"))
    first = None
    while p.poll() is None:
        if first is None and os.path.exists(metrics) and any('"event"' not in l for l in open(metrics)):
            first = time.monotonic() - t0
        time.sleep(0.01)
    if p.returncode != 0:
        sys.exit(f"FAIL: {' '.join(cmd)}: exit {p.returncode}\n{p.stderr.read()[-3000:]}")
    summary = [json.loads(l) for l in open(metrics) if '"summary"' in l][-1]
    return first, summary


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--sizes-gb", type=float, nargs="*", default=[0.1, 1, 10])
    ap.add_argument("--tokenizer-gb", type=float, default=1, help="the corpus tokenizers are trained on; 0: none")
    ap.add_argument("--formats-mb", type=float, default=100, help="the JSON lines corpus, plain and .zst; 0: none")
    ap.add_argument("--work", default="/tmp/zs-data-bench")
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--keep", action="store_true", help="keep the corpora and datasets")
    ap.add_argument("--reuse", action="store_true", help="train from datasets --keep left (their prepare times are "
                                                         "their manifests')")
    a = ap.parse_args()
    exe = os.path.join(a.build, "examples", "bart_pretrain")
    os.makedirs(a.work, exist_ok=True)
    docs = pool_text()
    print(f"pool: {len(docs)} documents, {sum(map(len, docs)) / 1e6:.1f} MB of text", flush=True)
    tok = os.path.join(a.work, "tokenizer")
    if not os.path.exists(os.path.join(tok, "vocab.json")):
        run([exe, "train-tokenizer", "--data", "/usr/share/common-licenses", "--vocab-size", "8192", "--out", tok])
    rows = []
    for gb in sorted(a.sizes_gb):
        corpus = os.path.join(a.work, f"corpus-{gb:g}")
        dataset = os.path.join(a.work, f"dataset-{gb:g}")
        if a.reuse and os.path.exists(os.path.join(dataset, "manifest.json")):
            m = json.load(open(os.path.join(dataset, "manifest.json")))
            nbytes, seconds = m["text_bytes"], m["prepare"]["seconds"]
        else:
            shutil.rmtree(corpus, ignore_errors=True)
            nbytes = make_corpus(corpus, gb, docs)
            seconds = prepare(exe, corpus, tok, dataset, a.workers)
        row = {"gb": gb, "bytes": nbytes, "prepare_s": seconds}
        if gb == min(a.sizes_gb) and gb <= 1 and os.path.exists(corpus):  # tokenizers in Python: 0.1 GB is minutes
            sentences, hb = corpus_sentences(corpus)
            hs, count = hf_encode(sentences, tok, a.workers, dataset)
            row.update(hf_bytes=hb, hf_s=hs, sentences=count)
        if not a.keep:
            shutil.rmtree(corpus, ignore_errors=True)
        for k in ("first", "again"):
            row[k] = train(a.build, dataset, os.path.join(a.work, f"run-{gb:g}-{k}"))
        row["store_bytes"] = sum(os.path.getsize(os.path.join(dataset, f)) for f in ("tokens.bin", "tokens.idx"))
        rows.append(row)
        if not a.keep:
            shutil.rmtree(dataset)
        print(json.dumps({k: v for k, v in row.items() if k not in ("first", "again")}), flush=True)

    w = a.workers
    formats = json_lines_formats(exe, docs, a.work, tok, a.formats_mb, w) if a.formats_mb > 0 else []
    if formats:
        print("\n| input | on disk | text | prepare (s) | text MB/s per core | tokenizers encode_batch, MB/s per core "
              "| ours / theirs |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for r in formats:
            ours, theirs = r["text_bytes"] / 1e6 / r["prepare_s"] / w, r["text_bytes"] / 1e6 / r["hf_s"] / w
            print(f"| {r['format']} | {r['disk_bytes'] / 1e6:.0f} MB | {r['text_bytes'] / 1e6:.0f} MB | "
                  f"{r['prepare_s']:.1f} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.2f}x |")
    if a.tokenizer_gb > 0:
        corpus = os.path.join(a.work, f"corpus-tok-{a.tokenizer_gb:g}")
        if not (a.reuse and os.path.isdir(corpus)):
            shutil.rmtree(corpus, ignore_errors=True)
            make_corpus(corpus, a.tokenizer_gb, docs)
        t = tokenizer_training(exe, corpus, a.work, w)
        if not a.keep:
            shutil.rmtree(corpus, ignore_errors=True)
        print(json.dumps(t), flush=True)
        print(f"\n| text | entries | train-tokenizer (count + learn) | peak RSS | tokenizers BpeTrainer | peak RSS | "
              f"ours / theirs | entries in common |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        print(f"| {t['sample_bytes'] / 1e9:.2f} GB | {t['vocab']:,} | {t['ours_s']:.0f} s ({t['count_s']:.0f} + "
              f"{t['learn_s']:.0f}) | {t['ours_rss'] / 2**20:,.0f} MiB | {t['hf_s']:.0f} s | "
              f"{t['hf_rss'] / 2**20:,.0f} MiB | {t['ours_s'] / t['hf_s']:.2f}x | {100 * t['common']:.1f}% |")
    print(f"\n| text | prepare (s) | MB/s | MB/s per core | tokenizers encode_batch, MB/s per core | ours / theirs |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        mbs = r["bytes"] / 1e6 / r["prepare_s"]
        hf = f"{r['hf_bytes'] / 1e6 / r['hf_s'] / w:.2f}" if "hf_s" in r else ""
        ratio = f"{(r['bytes'] / r['prepare_s']) / (r['hf_bytes'] / r['hf_s']):.2f}x" if "hf_s" in r else ""
        print(f"| {r['bytes'] / 1e9:.2f} GB | {r['prepare_s']:.1f} | {mbs:.2f} | {mbs / w:.2f} | {hf} | {ratio} |")
    print(f"\n| text | store | launch to first step, first run (packs) | again (maps) | peak RSS per rank | "
          f"data wait, share of step time |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        first, s1 = r["first"]
        again, s2 = r["again"]
        rss = max(s2["peak_rss_bytes"]) if isinstance(s2["peak_rss_bytes"], list) else s2["peak_rss_bytes"]
        print(f"| {r['bytes'] / 1e9:.2f} GB | {r['store_bytes'] / 1e9:.2f} GB | {first:.2f} s | {again:.2f} s | "
              f"{rss / 2**20:.0f} MiB | {100 * s2['data_wait_s'] / s2['train_seconds']:.2f}% |")


if __name__ == "__main__":
    main()
