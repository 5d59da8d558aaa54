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
  3. megatron.core's IndexedDatasetBuilder, given prepare's documents, writes the same bytes, and bart_pretrain
     trains from its store (--dataset PREFIX --tokenizer) with the losses it has from ours.
  4. megatron.core's IndexedDatasetBuilder writes stores (uint16, and int32 with ids above 65535; documents
     added whole, by item, and merged with add_index) and `bart_pretrain inspect` reads every sequence as
     Megatron's IndexedDataset does.
  5. A prepare killed (SIGKILL) while writing leaves no dataset; run again, it finishes, equal to step 2's.
  6. Two parts prepared apart and merged (bart_pretrain merge): the same store and sources as both prepared at once.
  7. A truncated tokens.bin is refused at opening, naming the file; a changed byte by `inspect --verify`, naming
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


def run(cmd, expect=0, env_level="warn"):
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, ZS_LOG_LEVEL=env_level))
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


def expected_documents(texts, tok, separator=None):
    """The documents prepare makes of the texts: a text each, or its runs of lines between separator lines (spaces,
    tabs and \\r around them aside), each document's sentences encoded with a leading space after its first;
    documents without a sentence dropped."""
    docs = []
    for text in texts:
        parts = [text]
        if separator is not None:
            parts, cur = [], []
            for line in text.split(b"\n"):
                if line.strip(b" \t\r") == separator:
                    parts.append(b"\n".join(cur))
                    cur = []
                else:
                    cur.append(line)
            parts.append(b"\n".join(cur))
        for part in parts:
            sentences = split_sentences(part)
            if sentences:
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
    check(len(got) == len(want), f"{len(got)} documents, expected {len(want)} (one per text file with a sentence)")
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

    # Documents cut at separator lines (fortune's %), across chunk boundaries; a separator-like text inside a line
    # or a sentence is text.
    fortunes = os.path.join(work, "fortunes")
    os.makedirs(fortunes)
    one = (b"A fortune. It has two sentences!\n%\nAnother one, 50% longer? Yes.\n  %\t\r\n%\n"
           b"Ends with a percent %\n%\nA last one\nover two lines.\n")
    with open(os.path.join(fortunes, "f1"), "wb") as f:
        f.write(b"%\n" + one * 400)
    with open(os.path.join(fortunes, "f2"), "wb") as f:
        f.write(b"No separator here. Only text.\n")
    texts = [b"%\n" + one * 400, b"No separator here. Only text.\n"]
    out = os.path.join(work, "ds-fortunes")
    run([exe, "prepare", "--data", fortunes, "--tokenizer", tok_dir, "--out", out, "--workers", "2",
         "--chunk-bytes", "4096", "--document-separator", "%"])
    want = expected_documents(texts, tok, separator=b"%")
    _, got = megatron_documents(os.path.join(out, "tokens"))
    check(got == want, f"--document-separator %: {len(got)} documents, expected {len(want)}; first differing: "
          f"{next(((g, w) for g, w in zip(got, want) if g != w), None)}")
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    check(manifest["documents_are"] == "files, cut at lines '%'", manifest["documents_are"])
    print(f"prepare --document-separator %: {len(want)} documents, as the lines between the separators make them")
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


def check_train_from_megatron(exe, work, reference, tok_dir):
    """prepare's store copied document by document through megatron-core's IndexedDatasetBuilder: the same bytes, and
    bart_pretrain trains from Megatron's copy (--dataset PREFIX --tokenizer) with the losses it has on ours."""
    ds = IndexedDataset(os.path.join(reference, "tokens"), mmap=True)
    prefix = os.path.join(work, "mega-copy")
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for d in range(len(ds.document_indices) - 1):
        seqs = [ds[i] for i in range(ds.document_indices[d], ds.document_indices[d + 1])]
        b.add_document(np.concatenate(seqs) if seqs else np.zeros(0, np.uint16), [len(x) for x in seqs])
    b.finalize(prefix + ".idx")
    for ext in (".bin", ".idx"):
        check(open(prefix + ext, "rb").read() == open(os.path.join(reference, "tokens" + ext), "rb").read(),
              f"megatron-core's builder writes another {ext} for the same documents than prepare")
    losses = []
    for name, data in (("ours", ["--dataset", reference]), ("megatron", ["--dataset", prefix, "--tokenizer", tok_dir])):
        run_dir = os.path.join(work, f"train-{name}")
        run([exe, *data, "--run-dir", run_dir, "--max-steps", "3", "--global-batch", "4", "--max-tokens", "64",
             "--eval-every", "0", "--no-sample", "--no-plot", "--ckpt-dir", "none", "--progress-interval", "1000"])
        losses.append([json.loads(line)["loss"] for line in open(os.path.join(run_dir, "metrics.jsonl"))
                       if '"event"' not in line])
    check(len(losses[0]) == 3 and losses[0] == losses[1], f"losses from our store {losses[0]}, from Megatron's "
          f"{losses[1]}")
    print(f"megatron-core's builder writes prepare's bytes; trained from its store, the losses are ours: {losses[1]}")


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


def make_tokenizer(work):
    """A tokenizers vocabulary (non-ASCII merges included), which both sides load: its directory, and tokenizers'
    ByteLevelBPETokenizer of it."""
    tok_dir = os.path.join(work, "tok")
    os.makedirs(tok_dir)
    hf = ByteLevelBPETokenizer(add_prefix_space=False)
    hf.train_from_iterator([open("/usr/share/common-licenses/GPL-3").read(), "Ein Satz. Zwei Sätze! Ça va. 数字"],
                           vocab_size=1200, min_frequency=2, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
                           show_progress=False)
    hf.save_model(tok_dir)
    return tok_dir, ByteLevelBPETokenizer(os.path.join(tok_dir, "vocab.json"), os.path.join(tok_dir, "merges.txt"),
                                          add_prefix_space=False)


def main():
    build, work = sys.argv[1], sys.argv[2]
    exe = os.path.join(build, "examples", "bart_pretrain")
    work = os.path.join(work, "megatron")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    tok_dir, tok = make_tokenizer(work)
    corpus, reference = check_prepare(exe, work, tok_dir, tok)
    check_merge(exe, work, tok_dir)
    check_train_from_megatron(exe, work, reference, tok_dir)
    check_megatron_written(exe, work)
    check_killed(exe, work, corpus, reference, tok_dir)
    check_damage(exe, work, reference)
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
