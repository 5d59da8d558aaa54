#!/usr/bin/env bash
# comm_bench across hosts: HOSTS network-namespace hosts (scripts/cluster.sh) with
# RANKS ranks each, every host's link shaped to RATE in each direction, the raw TCP
# ring anchor measured in the same run. Needs root; the cluster is removed at exit.
#
#   bench/cluster_comm_bench.sh BUILD_DIR [HOSTS=4] [RANKS=2] [RATE=1gbit] [comm_bench flags...]
#   bench/cluster_comm_bench.sh build 4 2 1gbit --min-kib 16384 --algorithm pairwise
set -euo pipefail
build=$(realpath "${1:?usage: cluster_comm_bench.sh BUILD_DIR [HOSTS] [RANKS] [RATE] [comm_bench flags...]}")
hosts=${2:-4}
ranks=${3:-2}
rate=${4:-1gbit}
shift $(( $# < 4 ? $# : 4 ))
cluster=$(dirname "$0")/../scripts/cluster.sh
n=42  # the cluster's number (10.213.42.0/24)

"$cluster" can
trap '"$cluster" down $n' EXIT
"$cluster" up $n "$hosts"
for ((i = 0; i < hosts; i++)); do "$cluster" shape $n $i "$rate"; done
master=$("$cluster" addr $n 0)
# Every host shares this machine's cores: one thread per rank.
for ((i = hosts - 1; i >= 0; i--)); do
  cmd=("$cluster" exec $n $i -- env OMP_NUM_THREADS=1 "$build/zeroshard-run" --nnodes "$hosts" --node-rank $i
       --nproc-per-node "$ranks" --master-addr "$master" --master-port 29600 -- "$build/bench/comm_bench" "$@")
  if (( i > 0 )); then "${cmd[@]}" > /dev/null & else "${cmd[@]}"; fi
done
wait
