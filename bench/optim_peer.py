#!/usr/bin/env python3
"""PyTorch's AdamW on the flat sizes of bench/optim_bench.cpp (its peer).

One AdamW step (lr 1e-3, weight decay 0.01) over one parameter of n fp32
elements, n = 16M ... 128M (M = 2^20, doubling, as optim_bench), with
  torch.optim.AdamW(fused=True)    PyTorch's fused CPU kernel
  torch.optim.AdamW(foreach=True)  the multi-tensor path (one op per step term)
and the STREAM triad a = b + 3c as torch.add(b, c, alpha=3, out=a), all at 1
and then 2 threads (torch.set_num_threads). Timing is optim_bench's (STREAM's)
rule: best of --reps runs after one warm-up. Bandwidth uses its byte counts:
AdamW 28 B/element (reads p, g, m, v; writes p, m, v), triad 12 B/element
(16 B with the write-allocate read of a).

  .venv/bin/python bench/optim_peer.py [--min-m 16] [--max-m 128] [--reps 7] [--threads 1,2]

Prints, per thread count, a heading line and rows in optim_bench's table
format; the first cell names the stack and threads, the "fused" columns are
AdamW(fused=True), the "torch AdamW" columns AdamW(foreach=True), and "fused
speedup" is foreach time / fused time. A variant that fails prints "failed:
why" in its cells.
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
    ap.add_argument("--reps", type=int, default=7, help="timed repetitions (best reported, as STREAM does)")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    a = ap.parse_args()

    for threads in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(threads)
        print("optim_peer: PyTorch %s, %d threads, best of %d; fused = torch.optim.AdamW(fused=True), torch AdamW = "
              "torch.optim.AdamW(foreach=True), triad = torch.add(b, c, alpha=3, out=a)" %
              (torch.__version__, torch.get_num_threads(), a.reps), flush=True)
        print()
        print("| elements | triad GB/s (12 B) | triad GB/s (16 B) | fused ms | fused GB/s | fused / triad (12 B) | "
              "fused / triad (16 B) | torch AdamW ms | torch GB/s | fused speedup |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        m = a.min_m
        while m <= a.max_m:
            n = m << 20
            with torch.no_grad():
                x, b, c = torch.zeros(n), torch.rand(n), torch.rand(n)
                triad_s = best_seconds(a.reps, lambda: torch.add(b, c, alpha=3.0, out=x))
                del x, b, c
            torch.manual_seed(0)
            p0, g = torch.randn(n), torch.randn(n)
            fused_s = adamw_seconds(p0, g, a.reps, fused=True)
            foreach_s = adamw_seconds(p0, g, a.reps, foreach=True)
            del p0, g
            tri = 12.0 * n / triad_s / 1e9
            tri16 = tri * 16.0 / 12.0
            cells = ["%dM (PyTorch, %d thread%s)" % (m, threads, "" if threads == 1 else "s"), "%.1f" % tri,
                     "%.1f" % tri16]
            if isinstance(fused_s, float):
                fused = 28.0 * n / fused_s / 1e9
                cells += ["%.1f" % (fused_s * 1e3), "%.1f" % fused, "%.2f" % (fused / tri), "%.2f" % (fused / tri16)]
            else:
                cells += [fused_s, "-", "-", "-"]
            if isinstance(foreach_s, float):
                cells += ["%.1f" % (foreach_s * 1e3), "%.1f" % (28.0 * n / foreach_s / 1e9)]
            else:
                cells += [foreach_s, "-"]
            both = isinstance(fused_s, float) and isinstance(foreach_s, float)
            cells.append("%.1fx" % (foreach_s / fused_s) if both else "-")
            print("| " + " | ".join(cells) + " |", flush=True)
            m *= 2
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
