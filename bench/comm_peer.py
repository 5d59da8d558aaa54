#!/usr/bin/env python3
"""The peer of bench/comm_bench: PyTorch's Gloo backend (torch.distributed, the
project environment's torch) timing the same collectives at the same sizes by the
same rule (float32, the same iteration counts, the best of three trials, each
trial the slowest rank's mean). bench/comm_vs_gloo.sh runs it beside comm_bench
and joins the two tables.

  zeroshard-run --nproc-per-node 4 -- .venv/bin/python bench/comm_peer.py \
      [--min-kib 16384] [--max-mib 64] [--beside comm_bench_output.txt]

Bus bandwidth as comm_bench computes it: algorithm bandwidth x (n-1)/n for
all_gather and reduce_scatter, x 2(n-1)/n for all_reduce. With --beside, rank 0
prints each row of comm_bench's table (ours and its raw-TCP anchor) beside
Gloo's figure for the same operation and size.
"""
import argparse
import os
import re
import time

import torch
import torch.distributed as dist


def best_of_three(fn, iters):
    fn()  # warm-up
    best = float("inf")
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        t = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        best = min(best, t.item())
    return best


def human(nbytes):
    return f"{nbytes >> 20} MiB" if nbytes >= (1 << 20) else f"{nbytes >> 10} KiB"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--min-kib", type=int, default=4)
    ap.add_argument("--max-mib", type=int, default=64)
    ap.add_argument("--beside", help="comm_bench's output: its rows are printed beside Gloo's")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    n, r = dist.get_world_size(), dist.get_rank()
    rows = {}
    nbytes = args.min_kib << 10
    while nbytes <= args.max_mib << 20:
        numel = nbytes // 4 // n * n
        chunk = numel // n
        iters = max(3, min(100, (128 << 20) // nbytes))
        full, part = torch.randn(numel), torch.randn(chunk)
        f1, f2 = (n - 1) / n, 2 * (n - 1) / n
        for op, fn, factor in (
                ("all_gather", lambda: dist.all_gather_into_tensor(full, part), f1),
                ("reduce_scatter", lambda: dist.reduce_scatter_tensor(part, full), f1),
                ("all_reduce", lambda: dist.all_reduce(full), f2)):
            s = best_of_three(fn, iters)
            rows[(op, human(numel * 4))] = (s, numel * 4 / s / 1e9 * factor)
        nbytes *= 4
    if r == 0:
        print(f"comm_peer: {n} ranks, torch {torch.__version__} Gloo, float32, {os.cpu_count()} cores")
        if not args.beside:
            print("| op | size | gloo us | gloo busbw GB/s |")
            print("|---|---:|---:|---:|")
            for (op, size), (s, bus) in rows.items():
                print(f"| {op} | {size} | {s * 1e6:.0f} | {bus:.2f} |")
        else:
            print("| op | size | ours busbw GB/s | gloo busbw GB/s | tcp ring busbw GB/s | ours/tcp | gloo/tcp | ours/gloo |")
            print("|---|---:|---:|---:|---:|---:|---:|---:|")
            row = re.compile(r"\| (all_gather|all_gather in place|reduce_scatter|all_reduce) \| (\d+ [KM]iB) \| "
                             r"[\d.]+ \| [\d.]+ \| ([\d.]+) \| ([\d.]+) \| [\d.]+ \|")
            with open(args.beside) as f:
                for m in map(row.search, f):
                    if not m:
                        continue
                    op, size, ours, tcp = m.group(1), m.group(2), float(m.group(3)), float(m.group(4))
                    peer = rows.get(("all_gather" if op.startswith("all_gather") else op, size))
                    if peer is None:
                        continue
                    gloo = peer[1]
                    print(f"| {op} | {size} | {ours:.2f} | {gloo:.2f} | {tcp:.2f} | {ours / tcp:.2f} | "
                          f"{gloo / tcp:.2f} | {ours / gloo:.2f} |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
