#!/usr/bin/env python3
"""`bart_pretrain prepare` and `train-tokenizer` on corpora as they ship: JSON lines, plain and compressed.

Usage: check_corpus_inputs.py BUILD_DIR WORK_DIR

  1. A corpus of JSON lines shards: `.jsonl` (CRLF line ends, blank lines, a line of 40 KB, longer than a chunk,
     escapes and non-ASCII text, other fields before and after the text, an empty text), `.json.gz` (two gzip
     members, as `cat a.gz b.gz` makes them; by Python's gzip), `.jsonl.zst` (two zstd frames; by the zstd CLI),
     `.ndjson`, and a text file compressed (`.txt.zst`: a document per file, as plain text is). Prepared with 4 KiB
     chunks on 3 workers, megatron-core's IndexedDataset reads exactly the ids tokenizers' ByteLevelBPETokenizer
     gives the sentences (corpus_oracle.py) of the texts Python's json module reads, a document per line.
  2. --json-key: the same lines with the text under "content" give the same store.
  3. A malformed line (not JSON, an array, no key, a number under it, more after the object) stops prepare naming
     FILE:LINE and the fix, and leaves neither the dataset nor its .partial directory; with --skip-bad-lines the
     other lines are the store and the manifest counts the five skipped, naming the first.
  4. A `.zst` cut short, a `.gz` that is not gzip: refused naming the file. --document-separator with JSON lines:
     refused naming both. A UTF-8 BOM opening a text or JSON lines file, a `.gz` with zero padding, a `.zst` with a
     256 MiB window: read as the tools read them; what Python's json accepts in other fields (NaN, 2**70, 1e400, a
     lone surrogate) passes. A raw NUL in a JSON line: that line's error (or skipped); a
     directory's binary file: left out, counted in the log and the manifest; given by name: refused. A `.json` that is
     one JSON document (pretty-printed, an array): refused as such. A JSON line of 30 MB costs prepare at most 5x
     its size in memory, and gives the store of the same text as a text file.
  5. train-tokenizer learns from the JSON lines (compressed) the vocabulary it learns from the same documents as
     plain text files. Sampled (--sample-mb below the file), from plain, gzip and zstd JSON lines: its ranges are the
     whole lines that start in its windows (long ones too), the sample is about the size asked, a compressed file is
     decompressed in one pass, and the vocabulary is the one learned from those lines alone.
  6. One file of running text (the GPL, one document) trains: the start-up line states its validation set, spans
     within the document, a small share of its tokens; the validation loss is measured before and after. What a
     killed prepare of this host left in the run directory is removed; a live process's and another host's stay. One
     sentence cannot train, and the error says the validation set took it.
  6b. An evaluation during the run takes a bounded part of the validation set (the same examples each time), the
     end the whole set too, --eval-full the whole set every time; the summary states the evaluations' share.
  7. Two datasets blended (--dataset A:0.7,B:0.3), 10^4 examples on 2 ranks: each one's share of the examples drawn
     is megatron-core's BlendedDataset's within 1%, and each has its validation loss in metrics.jsonl and the summary;
     saved on 2 ranks and resumed on 1 (the weights given as 7 and 3: the same mix), it takes the uninterrupted run's
     examples and losses; resumed with other weights, it is refused.

Without torch/megatron-core/tokenizers (Debian's python3) it prints SKIP and exits 77.
"""
import gzip
import json
import os
import re
import shutil
import socket
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, ".."))
sys.path.insert(0, os.path.join(here, "..", "bart"))
sys.path.insert(0, here)
from pycheck import check, skip  # noqa: E402

try:
    from check_megatron import expected_documents, make_tokenizer, megatron_documents, run  # noqa: E402
except SystemExit:
    raise
except ImportError as e:
    skip(f"{e}: the megatron-core and tokenizers oracles need the project's Python environment")


def texts_pool():
    gpl = open("/usr/share/common-licenses/GPL-3", encoding="utf-8").read()
    paragraphs = [p for p in gpl.split("\n\n") if p.strip()]
    extra = ["Ein Satz.\tZwei Sätze! Ça va? 数字 12345 und 3.14. Ende.", 'Quotes "inside" and a back\\slash. Done!',
             "Emoji \U0001F600 beyond the BMP. Second sentence.", "Line one\nline two.\n\nA new paragraph.", "",
             "   ", "No sentence end at all"]
    return paragraphs + extra, gpl


def lines_of(texts, key="text", crlf=False):
    out = []
    for k, t in enumerate(texts):
        obj = {"id": k, key: t, "meta": {"source": "gpl", "n": [1, 2]}} if k % 2 else {key: t, "id": k}
        out.append(json.dumps(obj, ensure_ascii=k % 3 == 0) + ("\r\n" if crlf and k % 2 else "\n"))
        if k % 7 == 3:
            out.append("\n" if k % 2 else "  \t\n")  # blank lines: no document
    return "".join(out).encode()


def zstd(data, path):
    p = subprocess.run(["zstd", "-q", "-c", "-"], input=data, capture_output=True, check=True)
    open(path, "ab").write(p.stdout)


def make_corpus(d, key="text"):
    """The shards, and the texts (in prepare's order: files by sorted name) that make the documents."""
    texts, gpl = texts_pool()
    os.makedirs(d)
    a = texts[:20] + [gpl] + texts[20:40]  # the GPL whole: one line of 35 KB, past several 4 KiB chunks
    b1, b2 = texts[40:60], texts[60:]
    c1, c2 = list(reversed(texts[:30])), texts[30:50]
    e = texts[50:70]
    open(os.path.join(d, "a.jsonl"), "wb").write(lines_of(a, key, crlf=True))
    with open(os.path.join(d, "b.json.gz"), "wb") as f:
        f.write(gzip.compress(lines_of(b1, key)) + gzip.compress(lines_of(b2, key)))
    zstd(lines_of(c1, key), os.path.join(d, "c.jsonl.zst"))
    zstd(lines_of(c2, key), os.path.join(d, "c.jsonl.zst"))
    text = gpl[:6000].encode()
    zstd(text, os.path.join(d, "d.txt.zst"))
    open(os.path.join(d, "e.ndjson"), "wb").write(lines_of(e, key).rstrip(b"\n"))  # no '\n' after the last line
    return [t.encode() for t in a + b1 + b2 + c1 + c2] + [text] + [t.encode() for t in e]


def check_documents(prefix, want, what):
    _, got = megatron_documents(prefix)
    check(len(got) == len(want), f"{what}: {len(got)} documents, expected {len(want)}")
    for d, (g, w) in enumerate(zip(got, want)):
        check(g == w, lambda: f"{what}: document {d} differs: {[x[:8] for x in g][:3]} expected "
              f"{[x[:8] for x in w][:3]}")


def check_json_lines(exe, work, tok_dir, tok):
    corpus = os.path.join(work, "jsonl")
    texts = make_corpus(corpus)
    want = expected_documents(texts, tok)
    out = os.path.join(work, "ds-jsonl")
    run([exe, "prepare", "--data", corpus, "--tokenizer", tok_dir, "--out", out, "--workers", "3",
         "--chunk-bytes", "4096"])
    check_documents(os.path.join(out, "tokens"), want, "JSON lines")
    m = json.load(open(os.path.join(out, "manifest.json")))
    check(m["documents_are"] == "text files; JSON lines (the text of field \"text\")", m["documents_are"])
    check([os.path.basename(s["path"]) for s in m["sources"]] ==
          ["a.jsonl", "b.json.gz", "c.jsonl.zst", "d.txt.zst", "e.ndjson"] and
          all(s["bytes"] == os.path.getsize(s["path"]) for s in m["sources"]), f"sources {m['sources']}")
    check(m["text_bytes"] > sum(s["bytes"] for s in m["sources"]), "text_bytes should count decompressed bytes")
    print(f"prepare: {len(want)} documents from .jsonl, .json.gz (2 members), .jsonl.zst (2 frames), .txt.zst and "
          ".ndjson in 4 KiB chunks on 3 workers: megatron-core reads exactly tokenizers' ids of json's texts")

    keyed = os.path.join(work, "jsonl-content")
    make_corpus(keyed, key="content")
    out2 = os.path.join(work, "ds-content")
    run([exe, "prepare", "--data", keyed, "--tokenizer", tok_dir, "--out", out2, "--json-key", "content"])
    for f in ("tokens.bin", "tokens.idx"):
        check(open(os.path.join(out, f), "rb").read() == open(os.path.join(out2, f), "rb").read(),
              f"--json-key content: {f} differs from the same texts under \"text\"")
    err = run([exe, "prepare", "--data", keyed, "--tokenizer", tok_dir, "--out", out2 + "-x"], expect=1)
    check('has no field "text"' in err and "--json-key" in err and "a.jsonl:1" in err, err)
    print("--json-key content: the same store; without it, the first line is named (no field \"text\")")
    return corpus


def check_bad_lines(exe, work, tok_dir, tok):
    d = os.path.join(work, "bad")
    os.makedirs(d)
    good = ["A good line. Two sentences!", "Another good one.", "The last good one?"]
    lines = [json.dumps({"text": good[0]}), '{"text": "cut short', json.dumps({"text": good[1]}), '["an", "array"]',
             json.dumps({"body": "no text field"}), json.dumps({"text": 42}),
             json.dumps({"text": "an object and then more."}) + ' {"text": "x"}', json.dumps({"text": good[2]})]
    open(os.path.join(d, "x.jsonl"), "w").write("\n".join(lines) + "\n")
    out = os.path.join(work, "ds-bad")
    err = run([exe, "prepare", "--data", d, "--tokenizer", tok_dir, "--out", out, "--workers", "2"], expect=1)
    check(f"{os.path.join(d, 'x.jsonl')}:2 is not JSON" in err and "--skip-bad-lines" in err, err)
    check(not os.path.exists(out) and not os.path.exists(out + ".partial"),
          "a prepare stopped by a malformed line left its dataset or its .partial directory")
    run([exe, "prepare", "--data", d, "--tokenizer", tok_dir, "--out", out, "--skip-bad-lines"])
    check_documents(os.path.join(out, "tokens"), expected_documents([g.encode() for g in good], tok), "skipped lines")
    m = json.load(open(os.path.join(out, "manifest.json")))
    check(m["skipped_lines"]["count"] == 5 and m["skipped_lines"]["first"].startswith(f"{d}/x.jsonl:2 is not JSON"),
          f"skipped_lines {m.get('skipped_lines')}")
    print(f"a malformed line stops prepare naming x.jsonl:2 and leaves nothing; --skip-bad-lines skips the 5 "
          f"({m['skipped_lines']['first']!r} first) and keeps the 3 good lines")

    for name, data, want in (("cut.jsonl.zst", None, "ends inside its zstd frame"),
                             ("plain.jsonl.gz", b'{"text": "not gzip."}\n', "is not gzip data")):
        bad = os.path.join(work, "bad-" + name)
        os.makedirs(bad)
        path = os.path.join(bad, name)
        if data is None:
            zstd(lines_of(texts_pool()[0]), path)
            blob = open(path, "rb").read()
            open(path, "wb").write(blob[: len(blob) // 2])
        else:
            open(path, "wb").write(data)
        err = run([exe, "prepare", "--data", bad, "--tokenizer", tok_dir, "--out", os.path.join(work, "ds-x")],
                  expect=1)
        check(f"'{path}' {want}" in err, err)
    err = run([exe, "prepare", "--data", d, "--tokenizer", tok_dir, "--out", os.path.join(work, "ds-x"),
               "--document-separator", "%"], expect=1)
    check("--document-separator '%' is for text files" in err and "x.jsonl' is JSON lines" in err, err)
    print("a .zst cut short and a .gz that is not gzip are refused naming the file; so is --document-separator "
          "with JSON lines")


def check_edges(exe, work, tok_dir, tok):
    """Files other tools read as text or JSON, read here the same; nothing given vanishes silently."""
    texts = ["A first sentence. A second one!", "Another document here.", "The third? Yes."]
    # A UTF-8 byte order mark opening a text file and a JSON lines file (as Windows editors write them): not text.
    bom = os.path.join(work, "edge-bom")
    os.makedirs(bom)
    open(os.path.join(bom, "a.txt"), "wb").write(b"\xef\xbb\xbf" + texts[0].encode())
    open(os.path.join(bom, "b.jsonl"), "wb").write(b"\xef\xbb\xbf" + lines_of(texts[1:]))
    # gzip members followed by zero padding (gzip -t and zcat accept it); a zstd frame with a 256 MiB window
    # (zstd --long=28 from a pipe: the CLI reads it only with --long=28).
    open(os.path.join(bom, "c.jsonl.gz"), "wb").write(gzip.compress(lines_of(texts)) + bytes(512))
    p = subprocess.run(["zstd", "-q", "--long=28", "-c", "-"], input=lines_of(texts[::-1]), capture_output=True,
                       check=True)
    open(os.path.join(bom, "d.jsonl.zst"), "wb").write(p.stdout)
    # What Python's json (Megatron's reader) accepts in fields the text is not in: NaN, Infinity, integers past 64
    # bits, 1e400, a lone surrogate escape (json.dumps writes the first four; the last as it escapes it).
    odd = [json.dumps({"score": float("nan"), "text": texts[0], "n": 2 ** 70}),
           json.dumps({"big": float("inf"), "text": texts[1], "tiny": -float("inf")}).replace("-Infinity", "1e400"),
           json.dumps({"note": "\ud800", "text": texts[2]})]
    for line in odd:
        json.loads(line)  # the oracle accepts it
    open(os.path.join(bom, "e.jsonl"), "w").write("\n".join(odd) + "\n")
    check(subprocess.run(["zstd", "-t", "-q", os.path.join(bom, "d.jsonl.zst")], capture_output=True).returncode != 0,
          "the zstd CLI reads the --long=28 frame without --long: it does not test what it should")
    out = os.path.join(work, "ds-edge")
    run([exe, "prepare", "--data", bom, "--tokenizer", tok_dir, "--out", out])
    want = [texts[0].encode()] + [t.encode() for t in texts[1:]] + [t.encode() for t in texts] + \
        [t.encode() for t in texts[::-1]] + [t.encode() for t in texts]
    check_documents(os.path.join(out, "tokens"), expected_documents(want, tok), "BOM, padded .gz, long-window .zst")
    print("a UTF-8 BOM opening a text and a JSON lines file is not text; a .gz with zero padding and a .zst with a "
          "256 MiB window are read as gzip and zstd read them; NaN, 2**70, 1e400 and a lone surrogate in other fields "
          "pass as in Python's json")

    # A raw NUL in a JSON lines file is a malformed line (named; skipped with --skip-bad-lines), never the whole
    # file left out; a directory's binary file is left out, counted in the log and the manifest; one given by
    # name is refused.
    nul = os.path.join(work, "edge-nul")
    os.makedirs(nul)
    open(os.path.join(nul, "a.jsonl"), "wb").write(lines_of(texts))
    open(os.path.join(nul, "b.jsonl"), "wb").write(lines_of(texts[:1]) + b'{"text": "a\x00b"}\n' + lines_of(texts[1:]))
    open(os.path.join(nul, "image.bin"), "wb").write(b"\x89PNG\x00\x00" + bytes(range(256)))
    err = run([exe, "prepare", "--data", nul, "--tokenizer", tok_dir, "--out", out + "-nul"], expect=1)
    check(f"{os.path.join(nul, 'b.jsonl')}:2 is not JSON" in err, err)
    err = run([exe, "prepare", "--data", nul, "--tokenizer", tok_dir, "--out", out + "-nul", "--skip-bad-lines"])
    check_documents(os.path.join(out + "-nul", "tokens"), expected_documents([t.encode() for t in texts * 2], tok),
                    "a NUL in a JSON line")
    m = json.load(open(os.path.join(out + "-nul", "manifest.json")))
    check(m["skipped_lines"]["count"] == 1 and m.get("binary_files_left_out") == [os.path.join(nul, "image.bin")],
          f"manifest: {m.get('skipped_lines')}, {m.get('binary_files_left_out')}")
    check("left out 1 binary file(s)" in err and "image.bin" in err, err[-2000:])
    err = run([exe, "prepare", "--data", os.path.join(nul, "image.bin"), "--tokenizer", tok_dir, "--out",
               out + "-bin"], expect=1)
    check("image.bin' has a NUL byte in its first 8000 bytes" in err, err)
    print("a NUL in a JSON line is that line's error (b.jsonl:2), skipped with --skip-bad-lines; a directory's binary "
          "file is left out, in the log and the manifest; given by name, refused")

    # A `.json` that is one JSON document (a pretty-printed package.json, an array) is named as such, not taken for a
    # malformed first line of JSON lines.
    for name, doc in (("package.json", json.dumps({"name": "x", "version": "1.0"}, indent=2)),
                      ("records.json", json.dumps([{"text": t} for t in texts]))):
        d = os.path.join(work, "edge-doc-" + name)
        os.makedirs(d)
        open(os.path.join(d, "a.txt"), "w").write(texts[0])
        open(os.path.join(d, name), "w").write(doc + "\n")
        err = run([exe, "prepare", "--data", d, "--tokenizer", tok_dir, "--out", out + "-doc"], expect=1)
        check(f"'{os.path.join(d, name)}' is one JSON document" in err and "not JSON lines" in err, err)
    print("a pretty-printed package.json and a JSON array named .json are refused as JSON documents, not JSON lines")


def check_tokenizer_training(exe, work, corpus):
    """The JSON lines' documents as plain text files (a document per file): the same vocabulary."""
    plain = os.path.join(work, "as-text")
    os.makedirs(plain)
    texts = make_corpus(os.path.join(work, "again"))
    for k, t in enumerate(texts):
        open(os.path.join(plain, f"{k:04}"), "wb").write(t)
    outs = []
    for name, data in (("json", corpus), ("text", plain)):
        out = os.path.join(work, f"tok-{name}")
        run([exe, "train-tokenizer", "--data", data, "--vocab-size", "600", "--out", out, "--workers", "2",
             "--chunk-bytes", "4096"])
        outs.append([open(os.path.join(out, f), "rb").read() for f in ("vocab.json", "merges.txt")])
    check(outs[0] == outs[1], "train-tokenizer learns another vocabulary from the JSON lines than from the same "
          "documents as text files")
    print("train-tokenizer: the JSON lines shards give the vocabulary the same documents as text files give")


def check_tokenizer_sampling(exe, work):
    """train-tokenizer's sample of one JSON lines file, plain, gzip and zstd, in windows of 16 KiB of text: the
    ranges it records (training.json) are whole lines of the decompressed text, in order, among them lines longer
    than a window; the sample holds about what was asked (not the windows counted in compressed bytes); a compressed
    file is decompressed once, not once per window; and the vocabulary equals the one learned from exactly those
    lines, written out by Python as a corpus of their own."""
    import random
    rng = random.Random(5)
    words = re.findall(r"[A-Za-z]+", texts_pool()[1])
    docs = []
    for k in range(900):  # about 6 MB of text; every 25th document 60-90 KB (longer than 3 windows)
        n = rng.randint(9000, 14000) if k % 25 == 7 else rng.randint(20, 1200)
        sentences, left = [], n
        while left > 0:
            m = min(left, rng.randint(4, 20))
            sentences.append(" ".join(rng.choice(words) for _ in range(m)).capitalize() + ".")
            left -= m
        docs.append(" ".join(sentences))
    raw = "".join(json.dumps({"id": k, "text": t}) + "\n" for k, t in enumerate(docs)).encode()
    window, sample_mb = 16384, 0.8
    d = os.path.join(work, "sampling")
    os.makedirs(d)
    files = {"plain": os.path.join(d, "s.jsonl"), "gzip": os.path.join(d, "s.jsonl.gz"),
             "zstd": os.path.join(d, "s.jsonl.zst")}
    open(files["plain"], "wb").write(raw)
    open(files["gzip"], "wb").write(gzip.compress(raw, 6))
    zstd(raw, files["zstd"])

    for kind, path in files.items():
        check(os.path.getsize(path) > sample_mb * 1e6, f"{kind}: the corpus file is smaller than the sample asked")
        out = os.path.join(work, f"tok-sampled-{kind}")
        log = run([exe, "train-tokenizer", "--data", path, "--vocab-size", "700", "--out", out, "--workers", "2",
                   "--sample-mb", str(sample_mb), "--chunk-bytes", str(window)], env_level="info")
        training = json.load(open(os.path.join(out, "training.json")))
        ranges = [(r["begin"], r["end"]) for r in training["sample"]]
        check(all(r["path"] == path for r in training["sample"]), f"{kind}: ranges of another file")
        last_end = -1
        longest = 0
        for b, e in ranges:
            check(b > last_end and b < e <= len(raw), f"{kind}: ranges out of order or overlapping: {ranges}")
            check(b == 0 or raw[b - 1] == 0x0A, f"{kind}: range [{b}, {e}) starts inside a line")
            check(raw[e - 1] == 0x0A, f"{kind}: range [{b}, {e}) ends inside a line")
            last_end = e
            longest = max([longest] + [len(x) + 1 for x in raw[b:e].split(b"\n")[:-1]])
        sampled = training["sample_bytes"]
        check(sampled == sum(e - b for b, e in ranges), f"{kind}: sample_bytes {sampled} is not the ranges' sum")
        asked = sample_mb * 1e6
        check(0.75 * asked <= sampled <= 1.5 * asked, f"{kind}: {sampled} bytes of text sampled for {asked:.0f} asked")
        check(longest > window, f"{kind}: no line longer than a window ({window}) was sampled; the longest: {longest}")
        decompressed = training["decompressed_bytes"]
        if kind == "plain":
            check(decompressed == 0, f"{kind}: {decompressed} bytes decompressed")
        else:
            check(0 < decompressed <= len(raw), f"{kind}: {decompressed} bytes decompressed for {len(raw)} of text: "
                                                f"the file was not read in one pass")
            check(f"{decompressed / 1e6:.1f} MB of text decompressed" in log, log)
        # The oracle: the sampled lines as a corpus of their own (under --sample-mb: read whole).
        alone = os.path.join(work, f"sampled-lines-{kind}.jsonl")
        open(alone, "wb").write(b"".join(raw[b:e] for b, e in ranges))
        alone_out = os.path.join(work, f"tok-alone-{kind}")
        run([exe, "train-tokenizer", "--data", alone, "--vocab-size", "700", "--out", alone_out, "--workers", "2",
             "--sample-mb", "100"])
        for f in ("vocab.json", "merges.txt"):
            check(open(os.path.join(out, f), "rb").read() == open(os.path.join(alone_out, f), "rb").read(),
                  f"{kind}: the sample's {f} differs from the one learned from its lines alone")
        print(f"train-tokenizer on {kind} JSON lines: {sampled / 1e6:.2f} MB of text sampled for {sample_mb} asked in "
              f"{len(ranges)} ranges of whole lines (the longest {longest} bytes, windows of {window}); "
              f"{decompressed / 1e6:.2f} MB decompressed of {len(raw) / 1e6:.2f}; the vocabulary of those lines alone")



def prepare_peak_mb(cmd):
    """Runs a prepare (expecting exit 0) and returns the peak memory its log line states (its own VmHWM, in MB; a
    child's ru_maxrss would count the Python process it was forked from)."""
    out = run(cmd, env_level="info")
    m = re.search(r"peak memory (\d+) MB\)", out)
    check(m is not None, f"no peak memory in prepare's line: {out[-2000:]}")
    return float(m.group(1))


def check_long_line_memory(exe, work, tok_dir):
    """A JSON line of 30 MB between two short ones: prepare's peak memory grows by at most 5x the line over the
    same command on a 0.1 MB corpus (before: about 9.5x, a copy of the line at each step, and its ids as int64),
    and the store equals the one prepared from the same texts as text files (a document per file)."""
    import random
    rng = random.Random(9)
    words = re.findall(r"[A-Za-z]+", texts_pool()[1])
    parts, n = [], 0
    while n < 30_000_000:
        s = " ".join(rng.choice(words) for _ in range(rng.randint(5, 25))) + ". "
        parts.append(s)
        n += len(s)
    texts = ["A short first document. Two sentences.", "".join(parts), "A short last one."]
    d, small, as_text = (os.path.join(work, x) for x in ("long-line", "long-line-small", "long-line-text"))
    for x in (d, small, as_text):
        os.makedirs(x)
    open(os.path.join(d, "l.jsonl"), "w").write("".join(json.dumps({"text": t}) + "\n" for t in texts))
    open(os.path.join(small, "s.jsonl"), "w").write("".join(json.dumps({"text": t[:30000]}) + "\n" for t in texts))
    for k, t in enumerate(texts):
        open(os.path.join(as_text, f"{k}.txt"), "w").write(t)
    prepare = [exe, "prepare", "--tokenizer", tok_dir, "--workers", "2"]
    base = prepare_peak_mb(prepare + ["--data", small, "--out", small + "-ds"])
    peak = prepare_peak_mb(prepare + ["--data", d, "--out", d + "-ds"])
    run(prepare + ["--data", as_text, "--out", as_text + "-ds"])
    for f in ("tokens.bin", "tokens.idx"):
        check(open(os.path.join(d + "-ds", f), "rb").read() == open(os.path.join(as_text + "-ds", f), "rb").read(),
              f"a 30 MB JSON line: {f} differs from the same texts as text files")
    line_mb = len(texts[1]) / 1e6
    check(peak - base <= 5 * line_mb, f"a {line_mb:.0f} MB JSON line: prepare's peak memory {peak:.0f} MB, "
                                        f"{(peak - base) / line_mb:.1f}x the line over {base:.0f} MB (at most 5x)")
    print(f"a {line_mb:.0f} MB JSON line: prepare peaks at {peak:.0f} MB, {(peak - base) / line_mb:.1f}x the line over "
          f"the {base:.0f} MB of a 0.1 MB corpus; the store of the same texts as text files")


def check_one_file_trains(exe, work):
    """One file of running text (one document) trains: its validation set is spans within it, a small share."""
    run_dir = os.path.join(work, "one-file-run")
    # What a prepare of this host killed midway left (its process gone) is removed; a live one's, and another
    # host's, are not this run's to remove.
    host = socket.gethostname()
    gone = subprocess.Popen(["true"])
    gone.wait()
    leftovers = {f"dataset.partial.{host}.{gone.pid}": False, f"dataset.partial.{host}.{os.getpid()}": True,
                 "dataset.partial.another-host.1": True}
    for name in leftovers:
        os.makedirs(os.path.join(run_dir, name, "tokens"))
    out = run([exe, "--data", "/usr/share/common-licenses/GPL-3", "--run-dir", run_dir, "--max-steps", "3",
               "--global-batch", "8", "--max-tokens", "64", "--eval-every", "0", "--no-sample", "--no-plot",
               "--ckpt-dir", "none", "--progress-interval", "1000"], env_level="info")
    for name, kept in leftovers.items():
        check(os.path.exists(os.path.join(run_dir, name)) == kept, f"{name}: {'removed' if kept else 'kept'}")
    check(f"removed '{os.path.join(run_dir, 'dataset.partial.' + host + '.' + str(gone.pid))}'" in out, out[-3000:])
    line = next((l for l in out.splitlines() if "validation: " in l and " within 1 document (" in l), None)
    check(line is not None, f"no start-up line states the validation set of one file:\n{out[-3000:]}")
    share = float(line.split("tokens, ")[1].split("%")[0])
    check(0 < share <= 8, f"one file: {share}% of its tokens held out: {line}")
    evals = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl")) if '"validation"' in l]
    check(len(evals) == 2 and all(0 < e["val_loss"] < 20 for e in evals), f"validation events {evals}")
    print(f"one file trains: {line.split('] ')[-1]}; validation loss {evals[0]['val_loss']:.3f} -> "
          f"{evals[1]['val_loss']:.3f}")
    # One sentence cannot train: the validation set takes it, and the error says so.
    one = os.path.join(work, "one-sentence")
    os.makedirs(one)
    open(os.path.join(one, "a.txt"), "w").write("This single sentence of plain English text is the whole corpus that "
                                                "the user gave to the trainer to learn from today.\n")
    err = run([exe, "--data", one, "--run-dir", os.path.join(work, "one-sentence-run"), "--max-steps", "1",
               "--global-batch", "1", "--no-plot", "--ckpt-dir", "none"], expect=1)
    check("has no training examples: its validation set took all of its text" in err and "give more text" in err,
          err[-2000:])


def check_bounded_evaluation(exe, work):
    """An evaluation during the run takes a bounded part of the validation set (the same examples every time: the same
    tokens), about 5% of the training between two by default; the end also evaluates the whole set; --eval-full
    evaluates the whole set every time; the summary states the evaluations' share of the time."""
    def train(name, *extra):
        run_dir = os.path.join(work, name)
        run([exe, "--data", "/usr/share/common-licenses/GPL-3", "--run-dir", run_dir, "--max-steps", "4",
             "--global-batch", "8", "--max-tokens", "64", "--eval-every", "2", "--no-sample", "--no-plot",
             "--ckpt-dir", "none", "--progress-interval", "1000", *extra])
        rows = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
        return [r for r in rows if r.get("event") == "validation"], [r for r in rows if r.get("event") == "summary"][-1]

    evals, summary = train("eval-bounded", "--eval-batch", "2")
    # 15% of eval_every x global batch = 2.4 -> 3 examples, in whole passes of --eval-batch (2) on 1 rank: 4 (of 9).
    check([e["step"] for e in evals] == [0, 2, 4], f"validation events {evals}")
    check(all(e["val_examples"] == 4 and not e["val_whole_set"] for e in evals), f"bounded evaluations {evals}")
    check(len({e["val_tokens"] for e in evals}) == 1, f"not the same examples each time: {evals}")
    last = evals[-1]
    check("val_loss_whole_set" in last and last["val_tokens_whole_set"] > last["val_tokens"] and
          all("val_loss_whole_set" not in e for e in evals[:-1]), f"the end's whole set: {evals}")
    check(summary["val_loss_whole_set"] == last["val_loss_whole_set"] and 0 < summary["eval_share"] < 1 and
          summary["eval_seconds"] > 0, f"summary {summary}")
    full, _ = train("eval-full", "--eval-full")
    check(len(full) == 3 and all(e["val_whole_set"] and "val_loss_whole_set" not in e for e in full) and
          full[0]["val_tokens"] == last["val_tokens_whole_set"], f"--eval-full: {full}")
    check(abs(full[-1]["val_loss"] - last["val_loss_whole_set"]) <= 1e-6 * last["val_loss_whole_set"],
          f"the end's whole set {last['val_loss_whole_set']} against --eval-full's {full[-1]['val_loss']}")
    iters, _ = train("eval-iters", "--eval-iters", "2", "--eval-batch", "3")
    check(all(e["val_examples"] == 6 for e in iters), f"--eval-iters 2 --eval-batch 3: {iters}")
    print(f"evaluation: 4 of {full[0]['val_examples']} validation examples at every evaluation ({last['val_tokens']} "
          f"tokens each time), the whole set at the end ({last['val_tokens_whole_set']} tokens, its loss --eval-full's); "
          f"{100 * summary['eval_share']:.1f}% of the time in the summary")


def check_blend(exe, build, work, tok_dir, jsonl_ds):
    """Two datasets blended 0.7/0.3 over 10^4 samples (100 steps of 100 on 2 ranks): each dataset's share of the
    examples drawn is Megatron-LM's BlendedDataset's (megatron-core's build_blending_indices) within 1%; each has
    its own validation loss, in metrics.jsonl and the summary."""
    import numpy as np
    from megatron.core.datasets import helpers_cpp
    texts = os.path.join(work, "blend-texts")
    os.makedirs(texts)
    for name in ("GPL-3", "LGPL-3", "Apache-2.0", "Artistic", "MPL-2.0"):
        shutil.copy(os.path.join("/usr/share/common-licenses", name), texts)
    text_ds = os.path.join(work, "ds-licenses")
    run([exe, "prepare", "--data", texts, "--tokenizer", tok_dir, "--out", text_ds])
    run_dir = os.path.join(work, "blend-run")
    steps, batch = 100, 100
    out = run([os.path.join(build, "zeroshard-run"), "--nproc-per-node", "2", "--", exe, "--dataset",
               f"{jsonl_ds}:0.7,{text_ds}:0.3", "--run-dir", run_dir, "--max-steps", str(steps), "--global-batch",
               str(batch), "--max-tokens", "16", "--eval-every", "50", "--no-sample", "--no-plot", "--ckpt-dir", "none",
               "--progress-interval", "1000", "--loader-threads", "1"], env_level="info")
    rows = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
    counts = np.sum([r["examples_by_dataset"] for r in rows if "event" not in r], axis=0)
    check(counts.sum() == steps * batch, f"{counts.sum()} examples drawn, expected {steps * batch}")
    index, sample = np.zeros(steps * batch, np.int16), np.zeros(steps * batch, np.int64)
    helpers_cpp.build_blending_indices(index, sample, np.array([0.7, 0.3]), 2, steps * batch, False)
    theirs = np.bincount(index, minlength=2) / (steps * batch)
    ours = counts / counts.sum()
    check(np.all(np.abs(ours - theirs) <= 0.01), f"shares {ours} against Megatron's {theirs}")
    evals = [r for r in rows if r.get("event") == "validation"]
    check(len(evals) == 3 and all(set(e["val_loss_by_dataset"]) == {jsonl_ds, text_ds} for e in evals),
          f"validation events {evals}")
    for e in evals:  # the headline weighs the sets as the blend does
        by = e["val_loss_by_dataset"]
        want = 0.7 * by[jsonl_ds] + 0.3 * by[text_ds]
        check(abs(e["val_loss"] - want) <= 1e-9 * want, f"val_loss {e['val_loss']}, 0.7/0.3 of {by}: {want}")
    summary = [r for r in rows if r.get("event") == "summary"][-1]
    check(set(summary.get("val_loss_by_dataset", {})) == {jsonl_ds, text_ds}, f"summary {summary}")
    check("val loss by dataset" in out and f"data: '{jsonl_ds}', weight 0.7" in out, out[-3000:])
    # The start-up line counts the blend's examples: every dataset's, as the lines that name each say.
    each = [int(n) for n in re.findall(r"data: '[^']*', weight [0-9.e+-]+: (\d+) training examples", out)]
    whole = re.search(r"; (\d+) training / (\d+) validation examples", out)
    check(len(each) == 2 and whole is not None and int(whole.group(1)) == sum(each),
          f"start-up line {whole and whole.group(0)} against the datasets' {each}")
    check_blend_resume(exe, build, work, f"{jsonl_ds}:0.7,{text_ds}:0.3")
    print(f"blend 0.7/0.3, {steps * batch} examples on 2 ranks: shares {ours[0]:.4f}/{ours[1]:.4f}, Megatron's "
          f"BlendedDataset {theirs[0]:.4f}/{theirs[1]:.4f}; validation loss by dataset "
          f"{ {os.path.basename(k): round(v, 3) for k, v in evals[-1]['val_loss_by_dataset'].items()} }")


def check_blend_resume(exe, build, work, datasets):
    """A blend saved at step 3 on 2 ranks and resumed on 1 takes the uninterrupted run's batches (the same examples
    of each dataset) and losses."""
    def launch(run_dir, ranks, steps, mix=datasets, expect=0):
        out = run([os.path.join(build, "zeroshard-run"), "--nproc-per-node", str(ranks), "--", exe, "--dataset", mix,
                   "--run-dir", run_dir, "--max-steps", str(steps), "--global-batch", "12", "--max-tokens", "16",
                   "--eval-every", "100", "--save-every", "3", "--dropout", "0", "--no-sample", "--no-plot",
                   "--progress-interval", "1000"], expect=expect)
        if expect:
            return out
        return {r["step"]: r for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl"))) if "event" not in r}

    ref = launch(os.path.join(work, "blend-ref"), 2, 6)
    cut = os.path.join(work, "blend-cut")
    launch(cut, 2, 3)
    err = launch(cut, 1, 6, mix=datasets.replace(":0.7,", ":0.6,").replace(":0.3", ":0.4"), expect=1)
    check("cannot resume from step 3" in err and '"weight":0.7' in err and '"weight":0.6' in err, err[-2000:])
    got = launch(cut, 1, 6, mix=datasets.replace(":0.7,", ":7,").replace(":0.3", ":3"))  # the same mix, unnormalised
    for step in range(4, 7):
        check(got[step]["examples_by_dataset"] == ref[step]["examples_by_dataset"] and
              abs(got[step]["loss"] - ref[step]["loss"]) <= 1e-5 * abs(ref[step]["loss"]),
              f"step {step} resumed on 1 rank: {got[step]['loss']} {got[step]['examples_by_dataset']}, uninterrupted "
              f"on 2: {ref[step]['loss']} {ref[step]['examples_by_dataset']}")
    print("blend: saved at step 3 on 2 ranks, resumed on 1: steps 4-6 draw the same examples of each dataset, with "
          "the uninterrupted run's losses (given as 7:3, the saved 0.7:0.3); resumed with other weights, refused naming "
          "both")


def main():
    build, work = sys.argv[1], sys.argv[2]
    exe = os.path.join(build, "examples", "bart_pretrain")
    work = os.path.join(work, "corpus-inputs")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    tok_dir, tok = make_tokenizer(work)
    corpus = check_json_lines(exe, work, tok_dir, tok)
    check_bad_lines(exe, work, tok_dir, tok)
    check_edges(exe, work, tok_dir, tok)
    check_long_line_memory(exe, work, tok_dir)
    check_tokenizer_training(exe, work, corpus)
    check_tokenizer_sampling(exe, work)
    check_one_file_trains(exe, work)
    check_bounded_evaluation(exe, work)
    check_blend(exe, build, work, tok_dir, os.path.join(work, "ds-jsonl"))
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
