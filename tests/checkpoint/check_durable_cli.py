#!/usr/bin/env python3
"""zeroshard-ckpt on a durable tier's checkpoints (s3://), under tests/checkpoint/s3_store.py: import a
safetensors file into the store, inspect, verify and export it from there; the export equals the file
imported (read by the safetensors library, the oracle); an object damaged in the store fails verify;
a second import of the same step commits on a line of its own, beside the first, which stays as it was.

Usage: s3_store.py -- python check_durable_cli.py BUILD_DIR
"""
import json
import os
import re
import urllib.parse
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from pycheck import check  # noqa: E402

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

build = sys.argv[1]
tool = os.path.join(build, "zeroshard-ckpt")
bucket = os.environ.get("ZS_TEST_S3_BUCKET")
check(bucket, "run under tests/checkpoint/s3_store.py")
uri = f"s3://{bucket}/cli-test-{os.getpid()}"
endpoint, key, secret = os.environ["AWS_ENDPOINT_URL"], os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]


def ckpt(*args, ok=True):
    p = subprocess.run([tool, *args], capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    print(f"zeroshard-ckpt {' '.join(args)}: exit {p.returncode}", flush=True)
    if ok:
        check(p.returncode == 0, f"zeroshard-ckpt {' '.join(args)} exited {p.returncode}:\n{out[-3000:]}")
    return p.returncode, out


def uploads():
    """The keys of the unfinished multipart uploads under the test's prefix (ListMultipartUploads, with curl)."""
    prefix = urllib.parse.quote(uri.split("/", 3)[3] + "/", safe="")  # encoded as SigV4 signs it
    p = subprocess.run(["curl", "-sf", "--aws-sigv4", "aws:amz:us-east-1:s3", "-u", f"{key}:{secret}",
                        "-H", "x-amz-content-sha256: UNSIGNED-PAYLOAD", f"{endpoint}/{bucket}/?prefix={prefix}&uploads="],
                       capture_output=True, timeout=60)
    check(p.returncode == 0, f"listing the multipart uploads failed: {p.stderr[-300:]!r}")
    return re.findall(r"<Key>([^<]*)</Key>", p.stdout.decode())


def s3(method, name, data_file=None):
    """A signed request with curl (an independent client), returning the body."""
    cmd = ["curl", "-sf", "-X", method, "--aws-sigv4", "aws:amz:us-east-1:s3", "-u", f"{key}:{secret}",
           "-H", "x-amz-content-sha256: UNSIGNED-PAYLOAD", f"{endpoint}/{bucket}/{uri.split('/', 3)[3]}/{name}"]
    if data_file:
        cmd[4:4] = ["--data-binary", f"@{data_file}"]
    p = subprocess.run(cmd, capture_output=True, timeout=60)
    check(p.returncode == 0, f"curl {method} {name} failed ({p.returncode}): {p.stderr[-500:]!r}")
    return p.stdout


with tempfile.TemporaryDirectory(prefix="zs-durable-cli.") as work:
    torch.manual_seed(3)
    tensors = {"encoder.weight": torch.randn(33, 17), "encoder.bias": torch.randn(17), "head.weight": torch.randn(5, 33)}
    original = os.path.join(work, "model.safetensors")
    save_file(tensors, original)

    # What a job killed in the middle of a file's multipart upload leaves: an upload no listing of objects shows.
    s3("POST", "step-00000001/0123456789abcdef/rank-00000-of-00001.h5?uploads=")
    check(len(uploads()) == 1, f"the orphaned upload is not there: {uploads()}")
    ckpt("import", "--safetensors", original, uri, "--step", "7")
    check(uploads() == [], f"retention left the orphaned multipart upload of step 1: {uploads()}")
    latest = json.loads(s3("GET", "latest"))
    first = latest["line"]
    check(latest["step"] == 7 and len(first) == 16, f"latest names {latest}, not step 7 of a line")
    record = json.loads(s3("GET", f"step-00000007/commit-{first}.json"))
    manifest = json.loads(record["manifest"])
    check(record["step"] == 7 and manifest["lineage"] == [{"line": first, "after": -1}], record["step"])

    _, out = ckpt("inspect", uri)
    check("step 7" in out or "step-00000007" in out, f"inspect does not show step 7:\n{out}")
    ckpt("verify", uri + "/step-00000007")

    exported = os.path.join(work, "exported.safetensors")
    ckpt("export", uri, exported, "--safetensors")
    back = load_file(exported)
    check(set(back) == set(tensors), f"exported {sorted(back)}, imported {sorted(tensors)}")
    for name, t in tensors.items():
        check(torch.equal(back[name], t), f"{name}: the export differs from the file imported")
    print(f"  export from {uri}: {len(back)} tensors equal to the file imported", flush=True)

    # A second writer of step 7 (another import, other weights): a line of its own, its files beside the
    # first's, never over them; both verify, `latest` follows the last writer, --line picks the first.
    torch.manual_seed(4)
    others = {k: torch.randn_like(v) for k, v in tensors.items()}
    other = os.path.join(work, "other.safetensors")
    save_file(others, other)
    ckpt("import", "--safetensors", other, uri, "--step", "7")
    second = json.loads(s3("GET", "latest"))["line"]
    check(second != first, "the second import committed on the first one's line")
    check(json.loads(s3("GET", f"step-00000007/commit-{first}.json")) == record, "the first commit changed")
    for line, want in ((first, tensors), (second, others)):
        ckpt("verify", uri + "/step-00000007", "--line", line)
        ckpt("export", uri, exported, "--safetensors", "--line", line)
        check(all(torch.equal(load_file(exported)[k], v) for k, v in want.items()), f"line {line}'s weights changed")
    ckpt("export", uri, exported, "--safetensors")
    check(all(torch.equal(load_file(exported)[k], v) for k, v in others.items()), "latest's weights are not the second's")
    print("  two imports of step 7: two commits side by side, each verifies and exports its own weights", flush=True)

    # Damaged in the store: verify fails, naming the file.
    rank_file = f"step-00000007/{second}/rank-00000-of-00001.h5"
    data = bytearray(s3("GET", rank_file))
    data[len(data) // 2] ^= 0xFF
    damaged = os.path.join(work, "damaged.h5")
    with open(damaged, "wb") as f:
        f.write(data)
    s3("PUT", rank_file, damaged)
    rc, out = ckpt("verify", uri, ok=False)
    check(rc == 1, f"verify of a damaged checkpoint exited {rc}, not 1:\n{out[-2000:]}")
    check("rank-00000-of-00001.h5" in out, f"verify does not name the damaged file:\n{out[-2000:]}")
    print("  a byte flipped in the store's rank file: verify exits 1 naming it", flush=True)

    rc, out = ckpt("inspect", f"s3://{bucket}/no-such-prefix", ok=False)
    check(rc == 2 and "holds no committed checkpoint" in out, f"inspect of an empty prefix: exit {rc}:\n{out[-1000:]}")
print("ok")
