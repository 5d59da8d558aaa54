#!/usr/bin/env python3
"""`bart_pretrain prepare` and our token store against megatron-core's IndexedDataset and Hugging Face tokenizers.

Usage: check_megatron.py BUILD_DIR WORK_DIR

  1. A corpus of awkward files (blank lines of spaces, CRLF, tabs after a sentence end, non-ASCII text, a file of
     whitespace, an empty file, a binary file, a link to a file already listed, a long file without a sentence
     end) is prepared with 4 KiB chunks on 3 workers. megatron.core's IndexedDataset reads the store, and every
     document and sentence holds exactly the ids tokenizers' ByteLevelBPETokenizer gives the file's sentences
     (split by corpus_oracle.py, a leading space after a file's first): the layout, the splitting across chunk
     boundaries, the order of the workers' output and the tokenizer, each against an independent reader.
  2. Prepared again with 1 worker and 1 MiB chunks: both store files byte for byte the same.
  3. megatron.core's IndexedDatasetBuilder writes stores (uint16, and int32 with ids above 65535; documents
     added whole, by item, and merged with add_index) and `bart_pretrain inspect` reads every sequence as
     Megatron's IndexedDataset does.
  4. A prepare killed (SIGKILL) while writing leaves no dataset; run again, it finishes, equal to step 2's.
  5. Two parts prepared apart and merged (bart_pretrain merge): the same store and sources as both prepared at once.
  6. A truncated tokens.bin is refused at opening, naming the file; a changed byte by `inspect --verify`, naming
     the manifest's checksum.

Without torch/megatron-core/tokenizers (Debian's python3) it prints SKIP and exits 77.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, ".."))
sys.path.insert(0, os.path.join(here, "..", "bart"))
from pycheck import check, skip  # noqa: E402
from corpus_oracle import split_sentences  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
try:
    import logging
    import warnings

    import numpy as np
    import torch
    from tokenizers import ByteLevelBPETokenizer
    warnings.simplefilter("ignore")  # megatron-core warns that Transformer Engine and Apex are absent
    logging.disable(logging.WARNING)
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
except ImportError as e:
    skip(f"{e}: the megatron-core and tokenizers oracles need the project's Python environment "
         "(scripts/install-deps.sh; ZS_PYTHON)")


def run(cmd, expect=0):
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, ZS_LOG_LEVEL="warn"))
    if p.returncode != expect:
        sys.exit(f"FAIL: {' '.join(cmd)}: exit {p.returncode}, expected {expect}\n{p.stdout[-4000:]}{p.stderr[-4000:]}")
    return p.stdout + p.stderr


def make_corpus(d):
    """The files and, in prepare's order, the texts that make documents (empty and binary files, and the link,
    make none)."""
    os.makedirs(os.path.join(d, "sub"))
    lic = open("/usr/share/common-licenses/GPL-3", "rb").read()
    files = {
        "a-gpl": lic,
        "b-crlf": lic[:20000].replace(b"\n", b"\r\n"),
        "c-odd": ("Ein Satz.\tZwei Sätze!\n \t \nFin?  Ça va.\n\n\n   \n"
                  "数字 12345 und 3.14. Ende.\x0bNoch einer.\x0c" * 300).encode(),
        "d-space": b" \n\t\n  \n",
        "e-empty": b"",
        "f-binary": b"\x00\x01binary",
        "g-no-end": (b"word " * 3000).strip(),  # no sentence end: 15 KB in one sentence, past several chunks
        "sub/h": lic[5000:9000],
    }
    for name, data in files.items():
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
    os.symlink(os.path.join(d, "a-gpl"), os.path.join(d, "sub", "z-link"))
    return [files[n] for n in ("a-gpl", "b-crlf", "c-odd", "d-space", "g-no-end", "sub/h")]


def expected_documents(texts, tok):
    docs = []
    for text in texts:
        sentences = split_sentences(text)
        docs.append([encode(tok, (b"" if k == 0 else b" ") + s) for k, s in enumerate(sentences)])
    return docs


def encode(tok, b):
    return tok.encode(b.decode("utf-8")).ids


def megatron_documents(prefix):
    ds = IndexedDataset(prefix, mmap=True)
    docs = []
    for d in range(len(ds.document_indices) - 1):
        docs.append([ds[i].tolist() for i in range(ds.document_indices[d], ds.document_indices[d + 1])])
    return ds, docs


def check_prepare(exe, work, tok_dir, tok):
    corpus = os.path.join(work, "corpus")
    texts = make_corpus(corpus)
    out = os.path.join(work, "ds-chunked")
    run([exe, "prepare", "--data", corpus, "--tokenizer", tok_dir, "--out", out, "--workers", "3",
         "--chunk-bytes", "4096"])
    want = expected_documents(texts, tok)
    ds, got = megatron_documents(os.path.join(out, "tokens"))
    check(ds.index.dtype == np.uint16, f"megatron reads token type {ds.index.dtype}, expected uint16")
    check(len(got) == len(want), f"{len(got)} documents, expected {len(want)} (one per text file)")
    for d, (g, w) in enumerate(zip(got, want)):
        check(len(g) == len(w), f"document {d}: {len(g)} sentences, expected {len(w)}")
        for k, (gs, ws) in enumerate(zip(g, w)):
            check(gs == ws, lambda: f"document {d} sentence {k}: {gs[:20]}... expected {ws[:20]}...")
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    sentences = sum(len(w) for w in want)
    tokens = sum(len(s) for w in want for s in w)
    check(manifest["sequences"] == sentences and manifest["tokens"] == tokens and manifest["documents"] == len(want),
          f"manifest counts {manifest['documents']}/{manifest['sequences']}/{manifest['tokens']}, expected "
          f"{len(want)}/{sentences}/{tokens}")
    check([os.path.basename(s["path"]) for s in manifest["sources"]] == ["a-gpl", "b-crlf", "c-odd", "d-space",
                                                                         "g-no-end", "h"],
          f"manifest sources {manifest['sources']}")
    print(f"prepare: {len(want)} documents, {sentences} sentences, {tokens} tokens in 4 KiB chunks on 3 workers: "
          "megatron-core reads exactly tokenizers' ids of every sentence")

    whole = os.path.join(work, "ds-whole")
    run([exe, "prepare", "--data", corpus, "--tokenizer", tok_dir, "--out", whole, "--workers", "1"])
    for f in ("tokens.bin", "tokens.idx"):
        check(open(os.path.join(out, f), "rb").read() == open(os.path.join(whole, f), "rb").read(),
              f"{f} differs between 4 KiB chunks on 3 workers and 1 MiB chunks on 1")
    print("prepare: 1 worker with 1 MiB chunks writes the same bytes")
    return corpus, whole


def check_merge(exe, work, tok_dir):
    """Two parts prepared apart (as on two hosts) and merged: the same store as both prepared at once."""
    parts = [os.path.join(work, "part-a"), os.path.join(work, "part-b")]
    for k, p in enumerate(parts):
        os.makedirs(p)
        for name in ("GPL-3", "LGPL-3") if k == 0 else ("Apache-2.0", "Artistic", "BSD"):
            shutil.copy(os.path.join("/usr/share/common-licenses", name), p)
    for k, p in enumerate(parts):
        run([exe, "prepare", "--data", p, "--tokenizer", tok_dir, "--out", p + ".ds", "--workers", str(k + 1)])
    run([exe, "merge", parts[0] + ".ds", parts[1] + ".ds", "--out", os.path.join(work, "merged")])
    run([exe, "prepare", "--data", *parts, "--tokenizer", tok_dir, "--out", os.path.join(work, "at-once")])
    for f in ("tokens.bin", "tokens.idx"):
        check(open(os.path.join(work, "merged", f), "rb").read() == open(os.path.join(work, "at-once", f), "rb").read(),
              f"{f}: two parts merged differ from both prepared at once")
    m = json.load(open(os.path.join(work, "merged", "manifest.json")))
    a = json.load(open(os.path.join(work, "at-once", "manifest.json")))
    check(m["sources"] == a["sources"] and m["documents"] == a["documents"] == 5 and m["files"] == a["files"],
          f"merged manifest {m} against {a}")
    run([exe, "inspect", "--dataset", os.path.join(work, "merged"), "--verify"])
    print("merge: two parts prepared apart, merged: the same bytes as both prepared at once")


def check_megatron_written(exe, work):
    rng = np.random.default_rng(7)
    for dtype, top in ((np.uint16, 65535), (np.int32, 1 << 30)):
        prefix = os.path.join(work, f"mega-{np.dtype(dtype).name}")
        part = prefix + "-part"
        b = IndexedDatasetBuilder(part + ".bin", dtype=dtype)
        for _ in range(3):
            lengths = [int(x) for x in rng.integers(0, 9, size=int(rng.integers(1, 5)))]
            b.add_document(torch.from_numpy(rng.integers(0, top, size=sum(lengths))), lengths)
        b.finalize(part + ".idx")
        b = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
        for _ in range(4):
            for _ in range(int(rng.integers(0, 4))):
                b.add_item(torch.from_numpy(rng.integers(0, top, size=int(rng.integers(0, 12)))))
            b.end_document()
        b.add_index(part)
        b.finalize(prefix + ".idx")
        ds = IndexedDataset(prefix, mmap=True)
        lines = run([exe, "inspect", "--dataset", prefix, "--verify", "--sequences", f"0:{len(ds)}"]).splitlines()
        head = json.loads(lines[0])
        check(head["sequences"] == len(ds) and head["documents"] == len(ds.document_indices) - 1 and
              head["token_type"] == np.dtype(dtype).name,
              f"inspect of Megatron's {np.dtype(dtype).name} store: {head}")
        for i in range(len(ds)):
            check(json.loads(lines[1 + i]) == ds[i].tolist(), f"sequence {i}: {lines[1 + i]} != {ds[i].tolist()}")
        print(f"inspect reads Megatron's {np.dtype(dtype).name} store ({len(ds)} sequences, "
              f"{len(ds.document_indices) - 1} documents) as IndexedDataset does")


def check_killed(exe, work, corpus, reference, tok_dir):
    big = os.path.join(work, "big")
    os.makedirs(big)
    text = open("/usr/share/common-licenses/GPL-3", "rb").read()
    for k in range(40):
        with open(os.path.join(big, f"{k:02}"), "wb") as f:
            f.write(text * 8)
    out = os.path.join(work, "ds-killed")
    for attempt in range(5):
        p = subprocess.Popen([exe, "prepare", "--data", big, "--tokenizer", tok_dir, "--out", out, "--workers", "1",
                              "--chunk-bytes", "65536"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        partial = os.path.join(out + ".partial", "tokens.bin.partial")
        deadline = time.time() + 60
        while p.poll() is None and time.time() < deadline and not (
                os.path.exists(partial) and os.path.getsize(partial) > 1 << 20):
            time.sleep(0.005)
        p.send_signal(signal.SIGKILL)
        p.wait()
        if not os.path.exists(out):
            break
        shutil.rmtree(out)  # it finished before the kill: again
    check(not os.path.exists(out) and os.path.exists(out + ".partial"),
          "a prepare killed while writing left a dataset directory (or never started writing)")
    hook, sys.unraisablehook = sys.unraisablehook, lambda _: None  # its __del__ after a failed __init__
    try:
        IndexedDataset(os.path.join(out + ".partial", "tokens"), mmap=True)
        check(False, "megatron-core opened the store of a killed prepare")
    except (FileNotFoundError, AssertionError):
        pass
    import gc
    gc.collect()
    sys.unraisablehook = hook
    # Again, on the small corpus into the same place: it starts over and finishes.
    shutil.rmtree(out + ".partial")
    os.makedirs(out + ".partial")
    open(os.path.join(out + ".partial", "tokens.bin.partial"), "wb").write(b"left over")
    run([exe, "prepare", "--data", corpus, "--tokenizer", tok_dir, "--out", out, "--workers", "2"])
    for f in ("tokens.bin", "tokens.idx"):
        check(open(os.path.join(out, f), "rb").read() == open(os.path.join(reference, f), "rb").read(),
              f"{f} of a prepare run over a killed one's leftovers differs")
    check(not os.path.exists(out + ".partial"), "the killed prepare's partial directory is still there")
    print("a prepare killed while writing leaves no dataset; run again it finishes, the same bytes")


def check_damage(exe, work, reference):
    d = os.path.join(work, "damaged")
    shutil.copytree(reference, d)
    binf = os.path.join(d, "tokens.bin")
    data = open(binf, "rb").read()
    open(binf, "wb").write(data[:-2])
    err = run([exe, "inspect", "--dataset", d], expect=1)
    check(f"'{binf}' is {len(data) - 2} bytes but its index ends at byte {len(data)}" in err, err)
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x40
    open(binf, "wb").write(bytes(flipped))
    run([exe, "inspect", "--dataset", d])  # opening reads only the header: the damage is inside
    err = run([exe, "inspect", "--dataset", d, "--verify"], expect=1)
    check(f"tokens.bin is {len(data)} bytes with xxh3" in err and "its manifest says" in err and
          "prepare the dataset again" in err, err)
    print("a truncated tokens.bin is refused at opening; a changed byte by inspect --verify, naming the checksum")


def main():
    build, work = sys.argv[1], sys.argv[2]
    exe = os.path.join(build, "examples", "bart_pretrain")
    work = os.path.join(work, "megatron")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    # A tokenizers vocabulary (non-ASCII merges included), which both sides load.
    tok_dir = os.path.join(work, "tok")
    os.makedirs(tok_dir)
    hf = ByteLevelBPETokenizer(add_prefix_space=False)
    hf.train_from_iterator([open("/usr/share/common-licenses/GPL-3").read(), "Ein Satz. Zwei Sätze! Ça va. 数字"],
                           vocab_size=1200, min_frequency=2, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
                           show_progress=False)
    hf.save_model(tok_dir)
    tok = ByteLevelBPETokenizer(os.path.join(tok_dir, "vocab.json"), os.path.join(tok_dir, "merges.txt"),
                                add_prefix_space=False)
    corpus, reference = check_prepare(exe, work, tok_dir, tok)
    check_merge(exe, work, tok_dir)
    check_megatron_written(exe, work)
    check_killed(exe, work, corpus, reference, tok_dir)
    check_damage(exe, work, reference)
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
