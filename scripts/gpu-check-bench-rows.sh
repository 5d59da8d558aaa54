# gpu-check-bench-rows.sh — scripts/gpu-check.sh's rows that measure or train:
# optim_bench, the BART step beside the Hugging Face peers (bench/bart_bench.sh), and
# bart_pretrain on the GPU. Read by gpu-check.sh (it defines timed, verdict, the row's
# $log, $limit and $name, and the settings used here); not run alone.
# shellcheck shell=bash disable=SC2154  # the variables are gpu-check.sh's
row_optim() {
  timed "$build/bench/optim_bench" --device cuda
  local rc=$?
  if [ $rc -ne 0 ]; then verdict FAIL "optim_bench exit status $rc"; return; fi
  verdict measured "$(grep '^ROW | cuda' "$log" | awk -F' *[|] *' '{printf "%s%s %s: %s ms, %s GB/s, %s", sep, $3, $4, $5, $6, $7; sep = "; "}')"
}

# The step's rows: bench/bart_bench.sh (zeroshard's modes, then the HF peers) at the
# step's shapes. Rehearsed on a CPU (GPU_CHECK_REHEARSE=1): the same commands, a tiny
# model and short sequences, on the CPU.
if [ -n "${GPU_CHECK_REHEARSE:-}" ]; then
  step_device=(--device cpu --precision bf16 --steps 2 --warmup 1)
  base_shape=(--config tiny --batch 2 --src-len 64 --tgt-len 64)
  large_shape=(--config tiny --src-len 64 --tgt-len 64)
  fit_ladder="8 4 2"
  two_ranks_comm=()
else
  step_device=(--device cuda --precision bf16 --steps 5 --warmup 2)
  base_shape=(--config base --batch 8 --src-len 512 --tgt-len 512)
  large_shape=(--config large --src-len 512 --tgt-len 512)
  fit_ladder="64 32 16"
  two_ranks_comm=(--device-comm nccl)  # not staged: ranks sharing the GPU would get stage_through_host by default
fi

# bart_bench.sh with the row's time left, its output added to the row's log.
step_bench() {  # ranks [env...] -- [bart_bench args...]
  local ranks=$1 envs=()
  shift
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  timeout -k 15 "$(( row_end - $(date +%s) > 1 ? row_end - $(date +%s) : 1 ))" \
    env PEER_PYTHON="$python" "${envs[@]}" bench/bart_bench.sh "$build" "$ranks" "${step_device[@]}" "$@" >>"$log" 2>&1
}

# The table rows of the log, one clause each; the profile's summary; the peers' versions.
step_detail() {
  local rows peak spec top busy peers
  rows=$(grep '^| \(dp\|zero2\|zero3\|peer-ddp\|peer-fsdp2\) ' "$log" |
         awk -F' *[|] *' '{printf "%s%s: %s s/step, %s tokens/s, MFU %s of spec (%s of measured), peak %s MiB%s", sep, $2, $5, $6, $7, $8,
                          $10, ($9 != "-" && $9 != "" ? ", exposed comm s " $9 : ""); sep = "; "}')
  peak=$(sed -n 's/.*measured now): \([0-9.]*\).*/\1/p' "$log" | head -1)
  spec=$(sed -n 's/^device: .*dense bf16 peak: \(.*\) TF\/s$/\1/p' "$log" | head -1)
  top=$(grep '^PROFILE zero3 top' "$log" | head -5 | awk '{t = $4; n = $5; $1 = $2 = $3 = $4 = $5 = ""; sub(/^ +/, "");
        printf "%s%s %.2f ms x%d", sep, substr($0, 1, 50), t / 1000, n; sep = ", "}')
  busy=$(awk '/^PROFILE [a-z0-9-]* busy/ {printf "%s%s %.1f of %.1f ms (%.0f%%)", sep, $2, $4 / 1000, $5 / 1000, 100 * $4 / $5; sep = ", "}' "$log")
  peers=$(grep -m1 '^peer-[a-z0-9]*: torch' "$log" | sed 's/^peer-[a-z0-9]*: //')
  detail="${rehearsal}${rows}; measured matmul peak ${peak:-?} GFLOP/s, spec ${spec:-?} TF/s${top:+; zero3 top kernels: $top}${busy:+; device busy: $busy}${peers:+; peers: $peers}"
}

step_row() {  # shape... : zeroshard's modes and the peers; zero3 profiled
  : >"$log"
  row_end=$(( $(date +%s) + limit ))
  local traces=$state/$name-traces rc
  rm -rf "$traces" && mkdir -p "$traces"
  step_bench 1 MODES="zero2 zero3" PROFILE_DIR="$traces" -- "$@"
  rc=$?
  gzip -f "$traces"/*.json 2>/dev/null
  step_detail
  if timed_out "$rc"; then verdict FAIL "timed out after $limit s; $detail"
  elif [ $rc -ne 0 ]; then verdict FAIL "bart_bench.sh exit status $rc; $detail"
  elif ! grep -q '^| zero3 ' "$log"; then verdict FAIL "no zero3 row; $detail"
  else verdict measured "$detail; traces: $(cd "$traces" && ls | paste -sd ' ')"; fi
}
row_step_base() { step_row "${base_shape[@]}"; }
row_step_large() { step_row "${large_shape[@]}" --batch 8; }

# The largest batch on the ladder whose zero3 step runs, then zero3 and the DDP peer there.
row_step_fit() {
  : >"$log"
  row_end=$(( $(date +%s) + limit ))
  local b fit="" rc ladder=$logs/$name-ladder.log
  : >"$ladder"
  for b in $fit_ladder; do
    echo "== trying batch $b" >>"$ladder"
    if log=$ladder step_bench 1 MODES=zero3 PEER_MODES= -- "${large_shape[@]}" --batch "$b"; then fit=$b; break; fi
  done
  if [ -z "$fit" ]; then verdict FAIL "no batch of $fit_ladder fits (the end of ${ladder##*/} says why)"; return; fi
  step_bench 1 MODES=zero3 PEER_MODES=ddp -- "${large_shape[@]}" --batch "$fit"
  rc=$?
  step_detail
  if [ $rc -ne 0 ]; then verdict FAIL "batch $fit: bart_bench.sh exit status $rc; $detail"
  else verdict measured "largest batch tried that fits: $fit; $detail"; fi
}

row_step_2ranks() {
  : >"$log"
  row_end=$(( $(date +%s) + limit ))
  local rc
  step_bench 2 MODES="zero2 zero3" PEER_MODES=ddp NCCL_HOST_PER_RANK=1 "${shared_gpu_env[@]}" "$(omp 2)" -- \
    "${base_shape[@]}" "${two_ranks_comm[@]}"
  rc=$?
  step_detail
  if [ $rc -ne 0 ]; then verdict FAIL "bart_bench.sh exit status $rc; $detail"
  else verdict measured "$detail"; fi
}

# bart_pretrain's summary lines (its model, losses and bytes sent).
bart_summary() {
  grep -h '^\[rank0\]: \(model\|val loss\|comm\) ' "$log" | sed 's/^\[rank0\]: //; s/  */ /g' | awk '{printf "%s%s", sep, $0; sep = "; "}'
}

row_bart_pp2() {
  local via
  rm -rf "$build/gpu-bart-pp2"
  launcher hosts 2
  timed env "${shared_gpu_env[@]}" "$(omp 2)" "${via[@]}" "$build/examples/bart_pretrain" --pp 2 --device cuda --device-comm nccl --config tiny --data docs \
    --run-dir "$build/gpu-bart-pp2" --max-steps 20 --global-batch 16 --micro-batches 4 --lr 3e-3 --warmup-steps 4 \
    --eval-every 10 --save-every 10 --no-plot --no-sample
  local rc=$? nccl
  nccl=$(grep -m1 -o 'NCCL [0-9]*\.[0-9]*\.[0-9]* \((compiled against\|is loaded\)[^)]*' "$log")
  if timed_out $rc; then verdict FAIL "timed out after $limit s"; elif [ $rc -ne 0 ]; then
    verdict FAIL "exit status $rc: $(grep -m1 -i 'error' "$log" | cut -c1-200)"
  elif [ -z "$nccl" ]; then verdict FAIL "no NCCL communicator was created (the device group was staged?): $(bart_summary)"
  else verdict pass "$(bart_summary); ${nccl})"; fi
}

row_bart60() {
  rm -rf "$build/gpu-bart-run"
  timed "$build/zeroshard-run" --nproc-per-node 1 --grace-period 5 -- "$build/examples/bart_pretrain" --device cuda \
    --config tiny --data docs --run-dir "$build/gpu-bart-run" --max-steps 60 --global-batch 16 --lr 3e-3 \
    --warmup-steps 6 --eval-every 30 --save-every 30 --no-plot
  local rc=$?
  if timed_out $rc; then verdict FAIL "timed out after $limit s"; elif [ $rc -ne 0 ]; then
    verdict FAIL "exit status $rc: $(grep -m1 -i 'error' "$log" | cut -c1-200)"
  else verdict pass "$(bart_summary)"; fi
}
