#!/usr/bin/env bash
# The memory wall: bart_pretrain at RANKS ranks with each rank's memory capped at CAP
# by a cgroup (v1) of its own, 3 steps per run. Needs root and the cgroup v1 memory
# controller (else exits 77, saying why); its cgroups are removed at exit.
#
#   bench/memory_wall.sh BUILD_DIR [RANKS=4] [CAP=3G] [CONFIG=large] [STAGES="3 2 1 0"]
#     one run per ZeRO stage of CONFIG: whether it trained or the kernel killed a rank
#     at the cap, the most memory any rank's cgroup held, and the model states per
#     rank the formulas give.
#   bench/memory_wall.sh BUILD_DIR [RANKS=4] [CAP=3G] search [STRATEGIES="0 1 2 3 3ac pp2"]
#     per strategy (ZeRO stage 0-3; 3ac: ZeRO-3 recomputing each layer in backward;
#     pp2: 2 pipeline stages of ZeRO-3, units gathered per pass), the most encoder + decoder layers of BART-large's
#     width (d_model 1024, FFN 4096, 16 heads; a 4,096-entry vocabulary) that train under
#     the cap, found by bisection, beside the most the model-state formulas allow.
set -euo pipefail
build=$(realpath "${1:?usage: memory_wall.sh BUILD_DIR [RANKS] [CAP] [CONFIG|search] [STAGES|STRATEGIES]}")
ranks=${2:-4}
cap=${3:-3G}
config=${4:-large}
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

# capped NAME CONFIG [bart_pretrain flags...]: one 3-step run with every rank capped.
# Sets `status` (0: trained), `peak` (bytes, the most any rank's cgroup held) and `log`.
capped() {
  local name=$1 cfg=$2
  shift 2
  for cg in "$base"/rank*; do [[ -d $cg ]] && rmdir "$cg"; done
  log=$work/$name.log
  set +e
  OMP_NUM_THREADS=1 "$build/zeroshard-run" --nproc-per-node "$ranks" -- "$work/capped.sh" \
    "$build/examples/bart_pretrain" --config "$cfg" --data "$here/docs" --tokenizer "$work/tokenizer" \
    --run-dir "$work/run-$name" --max-steps 3 --global-batch "$ranks" --max-tokens 32 --eval-every 0 \
    --ckpt-dir none --no-sample --no-plot "$@" > "$log" 2>&1
  status=$?
  set -e
  peak=0
  for cg in "$base"/rank*; do
    local p
    p=$(cat "$cg/memory.max_usage_in_bytes")
    (( p > peak )) && peak=$p
  done
  rm -rf "$work/run-$name"
}

# The flags of a strategy.
flags_of() {
  case $1 in
    3ac) echo "--stage 3 --activation-checkpointing" ;;
    pp2) echo "--stage 3 --pp 2 --micro-batches 2 --pp-gather pass" ;;  # gathered per pass: the least memory
    *) echo "--stage $1" ;;
  esac
}

if [[ $config == search ]]; then
  strategies=${5:-0 1 2 3 3ac pp2}
  echo "bart_pretrain, BART-large's width with L encoder and L decoder layers (4,096-entry vocabulary, fp32), $ranks ranks, each capped at $cap; 3 steps of $ranks x 32 tokens"
  echo
  echo "| strategy | most layers L that train | parameters | most memory a rank's cgroup held, MiB | L the model-state formula allows | runs |"
  echo "|---|---:|---:|---:|---:|---:|"
  for s in $strategies; do
    formula_l=$("$python" "$here/bench/bench_memory_formula.py" formula "$s" "$ranks" "$cap")
    # From the formula's answer: grow by half until a run fails, then bisect
    # between the most layers that trained and the fewest that did not.
    good=0 good_peak=0 bad=0 runs=0
    try=$(( formula_l > 0 ? formula_l : 1 ))
    while :; do
      "$python" "$here/bench/bench_memory_formula.py" config "$try" > "$work/config-$try.json"
      # shellcheck disable=SC2046
      capped "$s-$try" "$work/config-$try.json" $(flags_of "$s")
      runs=$((runs + 1))
      if (( status != 0 )) && ! grep -q SIGKILL "$log"; then  # not the cap: a search would only hide it
        echo "memory_wall: strategy $s at $try layers failed without reaching the cap; its log ends:" >&2
        tail -20 "$log" >&2
        exit 1
      fi
      if (( status == 0 )); then good=$try good_peak=$peak; else bad=$try; fi
      if (( bad == 0 )); then
        (( try >= 64 )) && break  # trains beyond any model this box can compute in time
        try=$(( try + 1 + try / 2 ))
        continue
      fi
      (( bad - good <= 1 )) && break
      try=$(( (good + bad) / 2 ))
    done
    "$python" "$here/bench/bench_memory_formula.py" row "$s" "$good" "$good_peak" "$formula_l" "$runs"
  done
  exit 0
fi

stages=${5:-3 2 1 0}  # ZeRO-3 first: it lives long enough to print the parameter count
echo "bart_pretrain --config $config (4,096-entry vocabulary), $ranks ranks, each capped at $cap; 3 steps, global batch $ranks x 32 tokens"
echo
echo "| ZeRO stage | outcome | most memory a rank's cgroup held, MiB | model states per rank by the formula, MiB |"
echo "|---:|---|---:|---:|"
for stage in $stages; do
  capped "stage$stage" "$config" --stage "$stage"
  "$python" - "$stage" "$status" "$peak" "$ranks" "$log" "$work/psi" <<'PY'
import os, re, sys
stage, status, peak, n, log, saved = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
                                      sys.argv[5], sys.argv[6])
text = open(log).read()
params = re.search(r"([0-9.]+)M parameters", text)
if params:  # a run killed before it logged the count takes an earlier run's
    open(saved, "w").write(params.group(1))
psi = float(open(saved).read()) * 1e6 if os.path.exists(saved) else None
# fp32 model states (docs/drop-in.md, docs/fully-shard.md): 16 psi replicated, 8 psi + 12 psi / N, 4 psi + 12 psi / N, 16 psi / N
formula = {0: 16, 1: 8 + 12 / n, 2: 4 + 12 / n, 3: 16 / n}[stage] * psi / 2**20 if psi else float("nan")
if status == 0:
    outcome = "trained (3 steps)"
elif "SIGKILL" in text:
    outcome = "killed at the cap (SIGKILL)"
else:
    outcome = f"failed, exit status {status}"
print(f"| {stage} | {outcome} | {peak / 2**20:,.0f} | {formula:,.0f} |")
PY
done
