#!/usr/bin/env bash
# The memory wall: bart_pretrain at RANKS ranks with each rank's memory capped at CAP
# by a cgroup (v1) of its own, once per ZeRO stage (0-3), 3 steps each. Prints per
# stage whether the run trained or the kernel killed a rank at the cap, the most
# memory any rank's cgroup held, and the model states per rank the formulas give.
# Needs root and the cgroup v1 memory controller (else exits 77, saying why); its
# cgroups are removed at exit.
#
#   bench/memory_wall.sh BUILD_DIR [RANKS=4] [CAP=3G] [CONFIG=large] [STAGES="3 2 1 0"]
set -euo pipefail
build=$(realpath "${1:?usage: memory_wall.sh BUILD_DIR [RANKS] [CAP] [CONFIG] [STAGES]}")
ranks=${2:-4}
cap=${3:-3G}
config=${4:-large}
stages=${5:-3 2 1 0}  # ZeRO-3 first: it lives long enough to print the parameter count
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$here/.venv/bin/python}
root=/sys/fs/cgroup/memory
if (( EUID != 0 )) || [[ ! -w $root ]]; then
  echo "memory_wall: needs root and a writable cgroup v1 memory controller at $root" >&2
  exit 77
fi
base=$root/zs-memory-wall-$$
work=$(mktemp -d /tmp/zs-memory-wall.XXXXXX)
cleanup() {
  for cg in "$base"/rank*; do [[ -d $cg ]] && rmdir "$cg" 2> /dev/null || true; done
  rmdir "$base" 2> /dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
mkdir -p "$base"
"$build/examples/bart_pretrain" train-tokenizer --data "$here/docs" --vocab-size 4096 --out "$work/tokenizer" > /dev/null 2>&1
# Each rank enters a cgroup of its own (rank$RANK) before it starts.
cat > "$work/capped.sh" <<EOF
#!/bin/sh
cg=$base/rank\$RANK
mkdir -p "\$cg"
echo $cap > "\$cg/memory.limit_in_bytes"
echo \$\$ > "\$cg/cgroup.procs"
exec "\$@"
EOF
chmod +x "$work/capped.sh"

echo "bart_pretrain --config $config (4,096-entry vocabulary), $ranks ranks, each capped at $cap; 3 steps, global batch $ranks x 32 tokens"
echo
echo "| ZeRO stage | outcome | most memory a rank's cgroup held, MiB | model states per rank by the formula, MiB |"
echo "|---:|---|---:|---:|"
for stage in $stages; do
  for cg in "$base"/rank*; do [[ -d $cg ]] && rmdir "$cg"; done
  set +e
  OMP_NUM_THREADS=1 "$build/zeroshard-run" --nproc-per-node "$ranks" -- "$work/capped.sh" \
    "$build/examples/bart_pretrain" --config "$config" --data "$here/docs" --tokenizer "$work/tokenizer" \
    --run-dir "$work/run-$stage" --max-steps 3 --global-batch "$ranks" --max-tokens 32 --eval-every 0 \
    --ckpt-dir none --no-sample --no-plot --stage "$stage" > "$work/stage$stage.log" 2>&1
  status=$?
  set -e
  peak=0
  for cg in "$base"/rank*; do
    p=$(cat "$cg/memory.max_usage_in_bytes")
    (( p > peak )) && peak=$p
  done
  "$python" - "$stage" "$status" "$peak" "$ranks" "$work/stage$stage.log" "$work/run-$stage/metrics.jsonl" "$work/psi" <<'PY'
import json, os, re, sys
stage, status, peak, n, log, metrics, saved = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
                                               sys.argv[5], sys.argv[6], sys.argv[7])
text = open(log).read()
params = re.search(r"([0-9.]+)M parameters", text)
if params:  # a run killed before it logged the count takes an earlier run's
    open(saved, "w").write(params.group(1))
psi = float(open(saved).read()) * 1e6 if os.path.exists(saved) else None
# fp32 model states (docs/drop-in.md, docs/fully-shard.md): 16 psi replicated, 8 psi + 12 psi / N, 4 psi + 12 psi / N, 16 psi / N
formula = {0: 16, 1: 8 + 12 / n, 2: 4 + 12 / n, 3: 16 / n}[stage] * psi / 2**20 if psi else float("nan")
if status == 0:
    summary = [json.loads(l) for l in open(metrics) if '"summary"' in l][-1]
    outcome = f"trained ({summary['steps']} steps)"
elif "SIGKILL" in text:
    outcome = "killed at the cap (SIGKILL)"
else:
    outcome = f"failed, exit status {status}"
print(f"| {stage} | {outcome} | {peak / 2**20:,.0f} | {formula:,.0f} |")
PY
done
