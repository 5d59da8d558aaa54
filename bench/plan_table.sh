#!/usr/bin/env bash
# Predictions, not measurements: zeroshard-plan's recommendation for BART-large
# and a 7B model (LLaMA-7B's shape) on 8 to 1,024 H100s (its defaults: 8 per host
# on NVLink at 450 GB/s each way, 8 x 400 Gb/s InfiniBand per host, 989 dense bf16
# TFLOP/s at 40% utilization, 80 GB), bf16 with fp32 master and moments, about
# 4M tokens per step. Prints a markdown table: the fastest strategy that fits, and
# the next fastest.
#
#   bench/plan_table.sh BUILD_DIR
set -euo pipefail
build=$(realpath "${1:?usage: plan_table.sh BUILD_DIR}")
echo "| model | H100s | recommended | step, s | tokens/s | memory per rank, GiB | GB between hosts per host link | next fastest (step, s) |"
echo "|---|---:|---|---:|---:|---:|---:|---|"
for spec in "bart-large 1024 4096" "7b 4096 1024"; do
  read -r model seq batch <<<"$spec"
  for gpus in 8 64 256 1024; do
    "$build/zeroshard-plan" --model "$model" --seq "$seq" --global-batch "$batch" --hosts $((gpus / 8)) |
      awk -F' \\| ' -v model="$model" -v gpus="$gpus" '
        /^\| / && !/^\| strategy/ && !/^\|---/ && $9 ~ /yes/ {
          sub(/^\| /, "", $1)
          if (n == 0) { first = $1; step = $2; tps = $3; link = $7; split($8, mem, " "); n = 1 }
          else if (n == 1) { second = $1 " (" $2 ")"; n = 2 }
        }
        END { printf "| %s | %s | %s | %s | %s | %s | %s | %s |\n", model, gpus, first, step, tps, mem[1], link, second }'
  done
done
