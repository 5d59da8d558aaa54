#!/usr/bin/env bash
# Hybrid against flat sharding across hosts: bart_pretrain on HOSTS network-namespace
# hosts (scripts/cluster.sh) of RANKS ranks each, every host's link shaped to RATE in
# each direction, once per mode: flat ZeRO-3 and ZeRO-2 (sharded over every rank) and
# hybrid (--shard-size host: sharded inside a host, replicated across hosts), and
# ZeRO-3 with its gathers in bf16 (--gather-dtype bf16), flat and hybrid, and in int8
# (block-quantized), flat. Prints
# per mode the median step time and the bytes each host's link sent per step (from
# the link's counters: everything that crossed it, TCP/IP headers, the rendezvous and
# the validation passes at the start and the end included, averaged over the steps),
# beside what the sharding alone sent between hosts by the formula. Needs root; the
# cluster is removed at exit.
#
#   bench/cluster_bart_bench.sh BUILD_DIR [HOSTS=2] [RANKS=2] [RATE=1gbit] [CONFIG=tiny|small|base|FILE] [STEPS=20]
#   MODES="3 0 fp32,3 0 bf16" bench/cluster_bart_bench.sh build 2 2 200mbit small 8   (some modes only)
#   KEEP=DIR ...: each mode's metrics also copied to DIR/HOSTS-STAGE-SHARD-GATHER.jsonl
set -euo pipefail
build=$(realpath "${1:?usage: cluster_bart_bench.sh BUILD_DIR [HOSTS] [RANKS] [RATE] [CONFIG] [STEPS]}")
hosts=${2:-2}
ranks=${3:-2}
rate=${4:-1gbit}
config=${5:-tiny}
steps=${6:-20}
here=$(cd "$(dirname "$0")/.." && pwd)
cluster=$here/scripts/cluster.sh
python=${PYTHON:-$here/.venv/bin/python}
n=43  # the cluster's number (10.213.43.0/24)
work=$(mktemp -d /tmp/zs-cluster-bart.XXXXXX)

"$cluster" can
trap '"$cluster" down $n; rm -rf "$work"' EXIT
"$cluster" up $n "$hosts"
for ((i = 0; i < hosts; i++)); do "$cluster" shape $n $i "$rate"; done
master=$("$cluster" addr $n 0)
"$build/examples/bart_pretrain" train-tokenizer --data "$here/docs" --vocab-size 4096 --out "$work/tokenizer" > /dev/null 2>&1
case $config in  # "small": between tiny and base, large enough that a 1 Gbit/s link shows
  small) config=$work/small.json
         echo '{"vocab_size": 4096, "d_model": 256, "encoder_layers": 4, "decoder_layers": 4,
                "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 1024,
                "decoder_ffn_dim": 1024, "max_position_embeddings": 256}' > "$config" ;;
esac

tx() { "$cluster" exec $n "$1" -- cat /sys/class/net/eth0/statistics/tx_bytes; }

echo "bart_pretrain --config ${5:-tiny} on $hosts hosts x $ranks ranks, links shaped to $rate; $steps steps each"
echo
echo "| mode | step s (median) | tokens/s | MB sent per step by each host's link | of which the sharding, by formula | MB sent per step per rank (all collectives) | model states per rank, MB |"
echo "|---|---:|---:|---|---:|---:|---:|"
# MODES: "STAGE SHARD GATHER [PP]" separated by commas (default: the seven below). PP > 1: that many
# pipeline stages (PipelineGrid: a stage takes whole hosts first), 8 micro-batches per step.
IFS=, read -r -a modes <<<"${MODES:-3 0 fp32,3 host fp32,3 0 bf16,3 host bf16,3 0 int8,2 0 fp32,2 host fp32}"
for mode in "${modes[@]}"; do
  read -r stage shard gather pp <<<"$mode"
  pp=${pp:-1}
  name=$hosts-$stage-$shard-$gather
  if ((pp > 1)); then name+=-pp$pp; fi
  run=$work/run-$name
  before=()
  for ((i = 0; i < hosts; i++)); do before+=("$(tx $i)"); done
  for ((i = hosts - 1; i >= 0; i--)); do
    cmd=("$cluster" exec $n $i -- env OMP_NUM_THREADS=1 "$build/zeroshard-run" --nnodes "$hosts" --node-rank $i
         --nproc-per-node "$ranks" --master-addr "$master" --master-port 29700 -- "$build/examples/bart_pretrain"
         --config "$config" --data "$here/docs" --tokenizer "$work/tokenizer" --run-dir "$run"
         --max-steps "$steps" --global-batch $((hosts * ranks * 4)) --max-tokens 128 --eval-every 0 --ckpt-dir none
         --no-sample --no-plot --dropout 0 --stage "$stage" --shard-size "$shard" --gather-dtype "$gather"
         --pp "$pp" --micro-batches $((pp > 1 ? 8 : 1)))
    if (( i > 0 )); then "${cmd[@]}" > "$work/host$i.log" 2>&1 & else "${cmd[@]}" > "$work/host0.log" 2>&1; fi
  done
  wait
  if [[ -n ${KEEP:-} ]]; then mkdir -p "$KEEP" && cp "$run/metrics.jsonl" "$KEEP/$name.jsonl"; fi
  per_host=()
  for ((i = 0; i < hosts; i++)); do per_host+=("$(( ($(tx $i) - before[i]) / steps ))"); done
  "$python" - "$run/metrics.jsonl" "$stage" "$shard" "$gather" "$hosts" "$ranks" "$pp" "${per_host[@]}" <<'PY'
import json, statistics, sys
path, stage, shard, gather = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
hosts, ranks, pp = int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
per_host = [int(x) for x in sys.argv[8:]]
rows = [r for r in map(json.loads, open(path)) if "event" not in r]
summary = [r for r in map(json.loads, open(path)) if r.get("event") == "summary"][-1]
steady = rows[2:] or rows
step = statistics.median(r["step_s"] for r in steady)
tps = statistics.median(r["tokens_per_s"] for r in steady)
sent = statistics.median(r["bytes_sent"] for r in steady)
n = hosts * ranks
# The model states' bytes P (fp32): ZeRO-3 gathers P twice (forward, backward) and
# reduce-scatters P once a step; a ring over n ranks on `hosts` hosts sends (n-1)/n P
# through each host's link per operation (ranks are numbered host by host). Hybrid:
# each rank all-reduces its 1/ranks shard across the hosts, 2 (hosts-1)/hosts of it.
P = 4 * summary["params"]
if pp > 1:  # the data-parallel groups stay inside a host when a stage fills whole hosts; activations cross
    formula = "0" if (hosts * ranks // pp) % ranks == 0 else "?"
elif shard == "0":
    # ZeRO-2: reduce-scatter + the update's all-gather; ZeRO-3's two gathers carry 1/2 of P in bf16 and
    # (1 + 4/256)/4 of it in int8 (the root's, in fp32, aside)
    ops = 2 if stage == 2 else 1 + 2 * {"fp32": 1, "bf16": 0.5, "int8": (1 + 4 / 256) / 4}[gather]
    formula = f"{ops * (n - 1) / n * P / 1e6:.1f}"
else:
    formula = f"{ranks * 2 * (hosts - 1) / hosts * P / ranks / 1e6:.1f}"
mode = (f"pp {pp} x " if pp > 1 else "") + f"ZeRO-{stage}, " + \
    ("flat (every rank)" if shard == "0" else "hybrid (a shard group per host)") + (", 8 micro-batches" if pp > 1 else "")
mode += f", {gather} gathers" if gather != "fp32" else ""
links = ", ".join(f"{b / 1e6:.1f}" for b in per_host)
states = max(summary["model_state_bytes"]) / 1e6
print(f"| {mode} | {step:.3f} | {tps:,.0f} | {links} | {formula} | {sent / 1e6:.1f} | {states:.1f} |")
PY
done
