#!/usr/bin/env bash
# zeroshard-plan against measured steps on the namespace cluster (scripts/cluster.sh).
#   1. α-β per link class, fitted to comm_bench's all_gather times (64 KiB to 16 MiB
#      inside a host, to 1 MiB between hosts):
#      inside a host (2 ranks on one host) and between hosts (2 hosts of 1 rank,
#      links shaped to RATE).
#   2. For each host count: the compute per token, measured on unshaped links
#      (10 Gbit/s, ZeRO-2: the rank's compute_s over its tokens), then
#      cluster_bart_bench.sh's "small" BART at RATE in six modes (ZeRO-3 and
#      ZeRO-2, flat and sharded per host; ZeRO-1 flat; 2 pipeline stages of
#      ZeRO-1 with 8 micro-batches).
#   3. zeroshard-plan's step time for each, from 1 and 2, beside the measured median:
#      the shares of hideable gathers and reductions that compute hides
#      (--gather-overlap, --reduce-overlap) are fitted to the fewest hosts'
#      runs and then held for the others.
# Needs root; every cluster is removed at exit.
#
#   bench/plan_validate.sh BUILD_DIR [RATE=200mbit] [HOSTS="2 3 4"] [RANKS=2] [STEPS=8]
set -euo pipefail
build=$(realpath "${1:?usage: plan_validate.sh BUILD_DIR [RATE] [HOSTS] [RANKS] [STEPS]}")
rate=${2:-200mbit}
host_counts=${3:-2 3 4}
ranks=${4:-2}
steps=${5:-8}
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$here/.venv/bin/python}
work=$(mktemp -d /tmp/zs-plan-validate.XXXXXX)
trap 'rm -rf "$work"' EXIT

# 1. The links.
OMP_NUM_THREADS=1 "$build/zeroshard-run" --nproc-per-node 2 -- "$build/bench/comm_bench" --min-kib 64 --max-mib 16 \
  2> /dev/null | grep '^\[rank0\]' > "$work/intra.txt"
# (up to 1 MiB between hosts: comm_bench times 100 calls per size, and a shaped link is slow)
"$here/bench/cluster_comm_bench.sh" "$build" 2 1 "$rate" --min-kib 64 --max-mib 1 2> /dev/null > "$work/inter.txt"
read -r intra_alpha intra_bw inter_alpha inter_bw < <("$python" - "$work/intra.txt" "$work/inter.txt" <<'PY'
import re, sys
import numpy as np
def fit(path):
    sizes, times = [], []
    for line in open(path):
        m = re.search(r"\| all_gather \| ([0-9]+) (KiB|MiB) \| ([0-9]+) \|", line)
        if m:
            sizes.append(int(m.group(1)) * (1024 if m.group(2) == "KiB" else 1024 * 1024))
            times.append(int(m.group(3)) * 1e-6)
    # 2 ranks: one step of half the buffer. time = alpha + (S / 2) / bandwidth
    a = np.vstack([np.ones(len(sizes)), np.array(sizes) / 2]).T
    (alpha, per_byte), *_ = np.linalg.lstsq(a, np.array(times), rcond=None)
    return max(alpha, 0.0) * 1e6, 1 / per_byte / 1e9  # microseconds, GB/s
ia, ib = fit(sys.argv[1])
ea, eb = fit(sys.argv[2])
print(f"{ia:.1f} {ib:.4f} {ea:.1f} {eb:.5f}")
PY
)
echo "Links fitted to comm_bench's all_gather: inside a host α $intra_alpha µs, $intra_bw GB/s; between hosts ($rate) α $inter_alpha µs, $inter_bw GB/s"
echo
# 2. The runs.
for hosts in $host_counts; do
  KEEP=$work/fast MODES="2 0 fp32" "$here/bench/cluster_bart_bench.sh" "$build" "$hosts" "$ranks" 10gbit small "$steps" > /dev/null
  KEEP=$work/shaped MODES="3 0 fp32,3 host fp32,2 0 fp32,2 host fp32,1 0 fp32,1 0 fp32 2" \
    "$here/bench/cluster_bart_bench.sh" "$build" "$hosts" "$ranks" "$rate" small "$steps" > /dev/null
done

# 3. The predictions: the overlap shares fitted to the fewest hosts' runs, then every row.
"$python" - "$build" "$work" "$ranks" "$intra_alpha" "$intra_bw" "$inter_alpha" "$inter_bw" $host_counts <<'PY'
import json, statistics, subprocess, sys
build, work, ranks = sys.argv[1], sys.argv[2], int(sys.argv[3])
links = sys.argv[4:8]
host_counts = [int(h) for h in sys.argv[8:]]
MODES = {"3-0-fp32": "ZeRO-3, flat", "3-host-fp32": f"ZeRO-3, sharded per {ranks} ranks",
         "2-0-fp32": "ZeRO-2, flat", "2-host-fp32": f"ZeRO-2, sharded per {ranks} ranks",
         "1-0-fp32": "ZeRO-1, flat", "1-0-fp32-pp2": "pp 2 x ZeRO-1, flat, 8 micro-batches"}

def steady(path):
    rows = [r for r in map(json.loads, open(path)) if "event" not in r]
    return rows[2:] or rows

def runs(hosts):
    n = hosts * ranks
    fast = steady(f"{work}/fast/{hosts}-2-0-fp32.jsonl")
    per_token = statistics.median(r["compute_s"] / (r["tokens"] / n) for r in fast)  # one rank's compute per token
    out = []
    for mode, name in MODES.items():
        rows = steady(f"{work}/shaped/{hosts}-{mode}.jsonl")
        out.append((name, statistics.median(r["step_s"] for r in rows), statistics.median(r["tokens"] for r in rows)))
    return per_token, out

def predicted(hosts, per_token, name, tokens, overlap):  # overlap: (gathers, reductions)
    ia, ib, ea, eb = links
    text = subprocess.run([f"{build}/zeroshard-plan", "--bart", "256,1024,4,4,4096,256", "--seq", "128",
                           "--global-batch", str(hosts * ranks * 4), "--tokens-per-step", str(tokens),
                           "--seconds-per-token", str(per_token), "--hosts", str(hosts), "--ranks-per-host", str(ranks),
                           "--intra-alpha-us", ia, "--intra-GBps", ib, "--inter-alpha-us", ea, "--inter-GBps", eb,
                           "--precision", "fp32", "--memory-GB", "1000", "--gather-overlap", str(overlap[0]),
                           "--reduce-overlap", str(overlap[1])],
                          capture_output=True, text=True).stdout
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells and cells[0] == name:
            return float(cells[1])
    raise SystemExit(f"zeroshard-plan printed no row '{name}':\n{text}")

data = {h: runs(h) for h in host_counts}
first = host_counts[0]
def error(overlap):
    per_token, rows = data[first]
    return sum(((predicted(first, per_token, name, tokens, overlap) - m) / m) ** 2 for name, m, tokens in rows)
overlap = min(((g / 10, r / 10) for g in range(11) for r in range(11)), key=error)
print(f"Overlap shares fitted to the {first}-host runs: gathers {overlap[0]:.1f}, reductions {overlap[1]:.1f}")
print()
print("| hosts x ranks | mode | measured step, s (median) | predicted, s | error | predicted with full overlap, s |")
print("|---|---|---:|---:|---:|---:|")
for h in host_counts:
    per_token, rows = data[h]
    for name, measured, tokens in rows:
        p = predicted(h, per_token, name, tokens, overlap)
        full = predicted(h, per_token, name, tokens, (1.0, 1.0))
        fitted = " (fitted)" if h == first else ""
        print(f"| {h} x {ranks}{fitted} | {name} | {measured:.3f} | {p:.3f} | {100 * (p - measured) / measured:+.0f}% | {full:.3f} |")
PY
