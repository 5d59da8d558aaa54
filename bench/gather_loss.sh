#!/usr/bin/env bash
# Whether narrow gathers change training: bart_pretrain ZeRO-3 at RANKS ranks on this
# host, the same seed and data, with its units gathered in fp32, bf16 and block-quantized
# int8 (--gather-dtype), plus fp32 again with another seed: the run-to-run spread a
# difference must exceed to mean anything. Prints the validation loss every STEPS/3
# steps, the mean training loss of the last 10 steps and the bytes each rank sent per
# step (docs/performance.md, "Narrow gathers").
#
#   bench/gather_loss.sh BUILD_DIR [CONFIG=tiny|small|base|FILE] [STEPS=300] [RANKS=4] [LR=bart_pretrain's]
set -euo pipefail
build=$(realpath "${1:?usage: gather_loss.sh BUILD_DIR [CONFIG] [STEPS] [RANKS] [LR]}")
config=${2:-tiny}
steps=${3:-300}
ranks=${4:-4}
lr=()
if [[ -n ${5:-} ]]; then lr=(--lr "$5"); fi
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$here/.venv/bin/python}
work=$(mktemp -d /tmp/zs-gather-loss.XXXXXX)
trap 'rm -rf "$work"' EXIT
case $config in  # "small": cluster_bart_bench.sh's, between tiny and base (8.6M parameters)
  small) config=$work/small.json
         echo '{"vocab_size": 4096, "d_model": 256, "encoder_layers": 4, "decoder_layers": 4,
                "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 1024,
                "decoder_ffn_dim": 1024, "max_position_embeddings": 256}' > "$config" ;;
esac
"$build/examples/bart_pretrain" train-tokenizer --data "$here/docs" --vocab-size 4096 --out "$work/tokenizer" > /dev/null 2>&1
every=$((steps / 3))
echo "bart_pretrain --config ${2:-tiny} ${lr[*]}, ZeRO-3 at $ranks ranks, global batch 16 x 128 tokens, $steps steps"
echo
echo "| gathers | seed | validation loss at step $every | $((2 * every)) | $((3 * every)) | training loss, mean of the last 10 steps | MB sent per step per rank |"
echo "|---|---:|---:|---:|---:|---:|---:|"
for mode in "fp32 1" "fp32 2" "bf16 1" "int8 1"; do
  read -r gather seed <<<"$mode"
  run=$work/run-$gather-$seed
  OMP_NUM_THREADS=1 "$build/zeroshard-run" --nproc-per-node "$ranks" -- "$build/examples/bart_pretrain" \
    --config "$config" --data "$here/docs" --tokenizer "$work/tokenizer" --run-dir "$run" --seed "$seed" \
    --max-steps "$steps" --global-batch 16 --max-tokens 128 --eval-every "$every" --ckpt-dir none \
    --no-sample --no-plot --stage 3 --gather-dtype "$gather" "${lr[@]}" > "$work/log" 2>&1 || { tail -20 "$work/log"; exit 1; }
  "$python" - "$run/metrics.jsonl" "$gather" "$seed" "$ranks" <<'PY'
import json, statistics, sys
path, gather, seed, ranks = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
rows = [json.loads(line) for line in open(path)]
val = {r["step"]: r["val_loss"] for r in rows if r.get("event") == "validation"}
steps = [r for r in rows if "event" not in r]
every = sorted(s for s in val if s > 0)[-3:]
last10 = statistics.mean(r["loss"] for r in steps[-10:])
sent = statistics.median(r["bytes_sent"] for r in steps) / 1e6  # rank 0's
print(f"| {gather} | {seed} | " + " | ".join(f"{val[s]:.4f}" for s in every) + f" | {last10:.4f} | {sent:.2f} |")
PY
done
