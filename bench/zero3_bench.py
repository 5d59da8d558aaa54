#!/usr/bin/env python3
"""PyTorch FSDP2 on the model and batch of bench/zero3_bench.cpp (its peer).

The ~30M-parameter transformer LM of zero3_bench (vocabulary 8192, width 512,
8 heads, FFN 2048, 7 layers), torch.optim.AdamW (lr 1e-4, weight decay 0.01),
Gloo backend. FSDP2's fully_shard(reshard_after_forward=True) on every layer
(with --head-unit also on the LM head), then on the root (embeddings, and the
head unless it is a unit), as zeroshard's fully_shard makes units; the root
keeps FSDP2's default for a root (gathered from forward into backward, as
zeroshard's root stays gathered) unless --root-reshard. Modes:
  fsdp2           FSDP2 as it comes. On CPU its streams are no-ops and every
                  all-gather and reduce-scatter blocks the training thread
                  (its implicit prefetch needs CUDA streams): zero3-nopf's peer
  fsdp2-prefetch  explicit prefetch (each layer gathers the next one in forward
                  and the previous one in backward) with asynchronous
                  all-gathers (FSDPModule._set_unshard_async_op(True), a
                  private switch): the peer of zero3

Needs torch 2.6 or later: run it with the project's .venv/bin/python. Launched
with torchrun's environment variables, e.g.

  build/zeroshard-run --nproc-per-node 4 -- .venv/bin/python bench/zero3_bench.py --mode fsdp2-prefetch

Rank 0 prints one "ROW |...|" line in zero3_bench's format: median step time
(slowest rank), exposed communication, peak RSS (largest rank, VmHWM), model
states per rank, then one more column, MiB sent per rank per step (mean over
ranks, see CommCounter), and an informational "wire check" line. A mode that
fails prints a ROW that says what failed.

Exposed communication is zero3_bench's: the time the training thread spent
blocked on all-gathers and reduce-scatters, slowest rank, median step, and of
it the all-gathers (ExposedComm says how it is measured).
"""
import argparse
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist

if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 6):
    sys.exit(f"zero3_bench.py: torch {torch.__version__} at {torch.__file__} is too old (needs 2.6+ for FSDP2); "
             "run it with the project's .venv/bin/python")

from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from peer_util import CommCounter, local_bytes, loopback_tx_bytes, peak_rss_mib  # noqa: E402

MODES = ["fsdp2", "fsdp2-prefetch"]


class Lm(torch.nn.Module):
    """zero3_bench's model: the layers are called one by one (sequence-first)."""

    def __init__(self, vocab, seq, d, heads, ff, layers):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(seq, d)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(d, heads, dim_feedforward=ff, dropout=0.0) for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.tok(ids) + self.pos(torch.arange(ids.size(1))).unsqueeze(0)
        h = h.transpose(0, 1)
        for b in self.blocks:
            h = b(h)
        return self.head(h.transpose(0, 1))


class ExposedComm:
    """Seconds the training thread spends blocked on FSDP2's collectives.

    FSDP2 issues its collectives through torch.distributed's module functions
    (dist.all_gather_single, dist.reduce_scatter_single). A synchronous call
    returns only when Gloo has finished the collective, so its whole duration is
    exposed: these functions are wrapped with a timer. An asynchronous
    all-gather (fsdp2-prefetch) is waited for in foreach_all_gather_copy_out,
    wrapped to time that wait alone. Deltas over a step are zero3_bench's
    "exposed comm" (FullyShardedModel::waits()).
    """

    def __init__(self):
        self.gathers = 0.0
        self.reductions = 0.0
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group
        for name, kind in (("all_gather_single", "gathers"), ("all_gather_into_tensor", "gathers"),
                           ("reduce_scatter_single", "reductions"), ("reduce_scatter_tensor", "reductions")):
            if hasattr(dist, name):
                setattr(dist, name, self._timed(getattr(dist, name), kind))
        copy_out = _fsdp_param_group.foreach_all_gather_copy_out

        def timed_copy_out(result, *args, **kwargs):
            work = result.all_gather_work
            if isinstance(work, dist.distributed_c10d.Work):
                t0 = time.perf_counter()
                work.wait()  # copy_out's own wait() then returns at once
                self.gathers += time.perf_counter() - t0
            return copy_out(result, *args, **kwargs)

        _fsdp_param_group.foreach_all_gather_copy_out = timed_copy_out

    def _timed(self, fn, kind):
        def wrapped(*args, **kwargs):
            if kwargs.get("async_op", False):
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, kind, getattr(self, kind) + time.perf_counter() - t0)
        return wrapped


def label(a):
    return ("PyTorch " + a.mode + (" (head a unit)" if a.head_unit else "") +
            (" (root resharded)" if a.root_reshard else ""))


def run(a, rank, world):
    vocab, d, heads, ff = 8192, 512, 8, 2048
    exposed_comm = ExposedComm()
    torch.manual_seed(0)
    model = Lm(vocab, a.seq, d, heads, ff, a.layers)
    psi = sum(p.numel() for p in model.parameters())
    units = list(model.blocks) + ([model.head] if a.head_unit else [])
    for u in units:
        fully_shard(u, reshard_after_forward=True)
    # The root: FSDP2's default for it (None: not resharded after forward, so it
    # stays gathered into backward, as zeroshard's root does); --root-reshard
    # passes True to it as well.
    fully_shard(model, reshard_after_forward=True if a.root_reshard else None)
    if a.mode == "fsdp2-prefetch":
        for i, u in enumerate(units):
            if i + 1 < len(units):
                u.set_modules_to_forward_prefetch([units[i + 1]])
            if i > 0:
                u.set_modules_to_backward_prefetch([units[i - 1]])
        model.set_modules_to_forward_prefetch([units[0]])
        model._set_unshard_async_op(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

    held = {}

    def train_step(step):
        torch.manual_seed(1000 * step + rank)
        ids = torch.randint(vocab, (a.batch, a.seq + 1))
        waits = (exposed_comm.gathers, exposed_comm.reductions)
        start = time.perf_counter()
        opt.zero_grad()
        logits = model(ids[:, :a.seq])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
        if step == a.warmup + a.steps:  # the counted step: what FSDP2 keeps gathered for backward
            held["unsharded"] = sum(p.numel() * p.element_size() for p in model.parameters()
                                    if not isinstance(p, DTensor))
        loss.backward()
        opt.step()
        mine = time.perf_counter() - start
        gathers = exposed_comm.gathers - waits[0]
        return mine, gathers + exposed_comm.reductions - waits[1], gathers

    times, exposed, exposed_gathers = [], [], []
    for step in range(a.warmup + a.steps):
        t = torch.tensor(train_step(step), dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if step >= a.warmup:
            times.append(t[0].item())
            exposed.append(t[1].item())
            exposed_gathers.append(t[2].item())
    median = statistics.median(times)
    rss = peak_rss_mib()  # before the counted step, which runs under a Python dispatch mode

    counter = CommCounter(world)
    dist.barrier()
    lo_before = loopback_tx_bytes()
    dist.barrier()
    with counter:
        train_step(a.warmup + a.steps)
    dist.barrier()
    lo_after = loopback_tx_bytes()

    # Model states, measured from the tensors: this rank's parameter, gradient
    # and AdamW shards, plus the parameters kept unsharded from forward to
    # backward (the root's), as zeroshard counts its root.
    states_bytes = held["unsharded"]
    for p in model.parameters():
        states_bytes += local_bytes(p) + (local_bytes(p.grad) if p.grad is not None else 0)
    for st in opt.state.values():
        states_bytes += sum(local_bytes(v) for v in st.values() if torch.is_tensor(v) and v.dim() > 0)

    v = torch.tensor([rss, states_bytes / 1048576.0], dtype=torch.float64)
    dist.all_reduce(v, op=dist.ReduceOp.MAX)
    total_sent = torch.tensor([counter.bytes], dtype=torch.float64)
    dist.all_reduce(total_sent)
    if rank == 0:
        mean_sent = total_sent.item() / world / 1048576.0
        ex, exg = statistics.median(exposed), statistics.median(exposed_gathers)
        exposed_col = "%d (%d%%; gathers %d)" % (round(ex * 1e3), round(100 * ex / median), round(exg * 1e3))
        print("ROW | %s | %d | %.1fM | %.0f | %s | %.0f | %.0f | %.1f |" %
              (label(a), world, psi / 1e6, median * 1e3, exposed_col, v[0].item(), v[1].item(), mean_sent), flush=True)
        calls = ", ".join("%s x%d" % kv for kv in sorted(counter.calls.items()))
        print("wire check (%s): counted %.1f MiB sent per rank per step in %s; the loopback device carried %.1f MiB "
              "per rank meanwhile (payload + TCP/Gloo headers + anything else on lo)" %
              (label(a), mean_sent, calls, (lo_after - lo_before) / world / 1048576.0), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=MODES, default="fsdp2")
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--layers", type=int, default=7, help="transformer layers")
    ap.add_argument("--head-unit", action="store_true", help="the LM head is a unit of its own (default: in the root)")
    ap.add_argument("--root-reshard", action="store_true",
                    help="reshard the root after forward too (gathered again for backward)")
    a = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        run(a, rank, world)
    except Exception as e:  # one line in the table instead of a traceback
        if rank == 0:
            msg = " ".join(("%s: %s" % (type(e).__name__, e)).split())[:200]
            print("ROW | %s | %d | failed: %s | - | - | - | - | - |" % (label(a), world, msg), flush=True)
        traceback.print_exc()
        dist.destroy_process_group()
        return  # exit 0: the row says what failed, and the wrapper goes on to the next mode
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
