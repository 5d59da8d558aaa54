#!/usr/bin/env python3
"""PyTorch's AdamW on the flat sizes of bench/optim_bench.cpp (its peer).

One AdamW step (lr 1e-3, weight decay 0.01) over one parameter of n fp32
elements, n = 16M ... 128M (M = 2^20, doubling, as optim_bench), with
  torch.optim.AdamW(fused=True)    PyTorch's fused CPU kernel
  torch.optim.AdamW(foreach=True)  the multi-tensor path (one op per step term)
at each thread count of --threads (torch.set_num_threads). Timing is
optim_bench's (STREAM's) rule: best of --reps runs after one warm-up;
bandwidth counts 28 B/element (reads p, g, m, v; writes p, m, v).

  .venv/bin/python bench/optim_peer.py [--min-m 16] [--max-m 128] [--reps 11] [--threads 1,2]

Prints optim_bench's "ROW | threads | elements | stack | ms | GB/s |" lines
(bench/optim_bench.sh puts them beside ours); a variant that fails says
"failed: why" in its cells.
"""
import argparse
import sys
import time

import torch


def best_seconds(reps, f):
    f()  # warm-up: page faults, thread pool start, lazily created state
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - start)
    return best


def adamw_seconds(p0, g, reps, **kwargs):
    """Best step time of torch.optim.AdamW(**kwargs) on one parameter (a copy of p0, gradient g), or the error."""
    try:
        p = p0.clone().requires_grad_(True)
        p.grad = g  # read-only for AdamW
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, **kwargs)
        return best_seconds(reps, opt.step)
    except Exception as e:
        return " ".join(("failed: %s: %s" % (type(e).__name__, e)).split())[:160]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min-m", type=int, default=16, help="smallest size, millions of elements (x 2^20)")
    ap.add_argument("--max-m", type=int, default=128, help="largest size, millions of elements (x 2^20)")
    ap.add_argument("--reps", type=int, default=11, help="timed repetitions (best reported, as STREAM does)")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    a = ap.parse_args()

    for threads in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(threads)
        print("optim_peer: PyTorch %s, %d threads, best of %d" % (torch.__version__, torch.get_num_threads(), a.reps),
              flush=True)
        m = a.min_m
        while m <= a.max_m:
            n = m << 20
            torch.manual_seed(0)
            p0, g = torch.randn(n), torch.randn(n)
            for name, kwargs in (("fused=True", {"fused": True}), ("foreach=True", {"foreach": True})):
                s = adamw_seconds(p0, g, a.reps, **kwargs)
                cells = ["%.1f" % (s * 1e3), "%.1f" % (28.0 * n / s / 1e9)] if isinstance(s, float) else [s, "-"]
                print("ROW | %d | %dM | PyTorch torch.optim.AdamW(%s) | %s |" %
                      (torch.get_num_threads(), m, name, " | ".join(cells)), flush=True)
            del p0, g
            m *= 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
