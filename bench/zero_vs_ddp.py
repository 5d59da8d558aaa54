#!/usr/bin/env python3
"""PyTorch's own stack on the model and batch of bench/zero_vs_ddp.cpp (its peer).

Modes, all on the Gloo backend with torch.optim.AdamW (lr 1e-4, weight decay 0.01):
  ddp              DistributedDataParallel
  ddp_zero         DDP + ZeroRedundancyOptimizer wrapping AdamW
  fsdp2_noreshard  FSDP2: fully_shard(reshard_after_forward=False) on every
                   encoder layer, then on the root (embeddings and head)

Needs torch 2.6 or later (FSDP2's public fully_shard): run it with the project's
virtual environment, not Debian's python3-torch (1.13). Launched with torchrun's
environment variables (RANK, WORLD_SIZE, MASTER_ADDR, ...), e.g.

  build/zeroshard-run --nproc-per-node 4 -- .venv/bin/python bench/zero_vs_ddp.py --mode ddp_zero
  .venv/bin/torchrun --nproc-per-node 4 bench/zero_vs_ddp.py --mode fsdp2_noreshard

Rank 0 prints one "ROW |...|" line in the C++ benchmark's format: median step
time (slowest rank), tokens/s, peak RSS (largest rank, VmHWM), model states per
rank, then one more column, MiB sent per rank per step (mean over ranks, see
CommCounter); and an informational "wire check" line. A mode that fails prints
a ROW that says what failed instead of numbers, and exits 0.
"""
import argparse
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist

if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 6):
    sys.exit(f"zero_vs_ddp.py: torch {torch.__version__} at {torch.__file__} is too old (needs 2.6+ for FSDP2); "
             "run it with the project's .venv/bin/python")

from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from peer_util import CommCounter, local_bytes, loopback_tx_bytes, peak_rss_mib  # noqa: E402

MODES = ["ddp", "ddp_zero", "fsdp2_noreshard"]


class Lm(torch.nn.Module):
    def __init__(self, vocab, seq, d, heads, ff, layers):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(seq, d)
        layer = torch.nn.TransformerEncoderLayer(d, heads, dim_feedforward=ff, dropout=0.0)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.tok(ids) + self.pos(torch.arange(ids.size(1))).unsqueeze(0)
        h = self.encoder(h.transpose(0, 1)).transpose(0, 1)  # sequence-first, as LibTorch's
        return self.head(h)


def run(a, rank, world):
    vocab, d, heads, ff = 8192, 512, 8, 2048
    torch.manual_seed(0)
    lm = Lm(vocab, a.seq, d, heads, ff, a.layers)
    psi = sum(p.numel() for p in lm.parameters())
    if a.mode == "fsdp2_noreshard":
        from torch.distributed.fsdp import fully_shard
        for layer in lm.encoder.layers:
            fully_shard(layer, reshard_after_forward=False)
        model = fully_shard(lm, reshard_after_forward=False)  # every rank built the same model: no broadcast
    else:
        model = DDP(lm)
    if a.mode == "ddp_zero":
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4,
                                      weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

    held = {}  # parameter bytes held unsharded between forward and backward (FSDP2)

    def train_step(step):
        torch.manual_seed(1000 * step + rank)
        ids = torch.randint(vocab, (a.batch, a.seq + 1))
        start = time.perf_counter()
        opt.zero_grad()
        logits = model(ids[:, :a.seq])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
        if step == a.warmup + a.steps:  # the counted step: what FSDP2 keeps gathered for backward
            held["unsharded"] = sum(p.numel() * p.element_size() for p in model.parameters()
                                    if not isinstance(p, DTensor))
        loss.backward()
        opt.step()
        return time.perf_counter() - start

    times = []
    for step in range(a.warmup + a.steps):
        t = torch.tensor([train_step(step)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank's does
        if step >= a.warmup:
            times.append(t.item())
    median = statistics.median(times)
    rss = peak_rss_mib()  # before the counted step, which runs under a Python dispatch mode

    # One more step, untimed, counting the bytes of its collectives.
    counter = CommCounter(world)
    dist.barrier()
    lo_before = loopback_tx_bytes()
    dist.barrier()
    with counter:
        train_step(a.warmup + a.steps)
    dist.barrier()
    lo_after = loopback_tx_bytes()

    if a.mode == "fsdp2_noreshard":
        # Measured from the tensors: this rank's parameter, gradient and AdamW
        # shards, plus the parameters kept unsharded from forward to backward.
        states_bytes = held["unsharded"]
        for p in model.parameters():
            states_bytes += local_bytes(p) + (local_bytes(p.grad) if p.grad is not None else 0)
        for st in opt.state.values():
            states_bytes += sum(local_bytes(v) for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
    else:
        # params + grads, plus DDP's gradient buckets (a full copy), plus this rank's AdamW states
        states_bytes = 12.0 * psi
        inner = opt.optim if a.mode == "ddp_zero" else opt
        for st in inner.state.values():
            states_bytes += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v) and v.dim() > 0)

    v = torch.tensor([rss, states_bytes / 1048576.0], dtype=torch.float64)
    dist.all_reduce(v, op=dist.ReduceOp.MAX)
    total_sent = torch.tensor([counter.bytes], dtype=torch.float64)
    dist.all_reduce(total_sent)
    if rank == 0:
        mean_sent = total_sent.item() / world / 1048576.0
        print("ROW | PyTorch (Python) | %s | %d | %.1fM | %.0f | %.0f | %.0f | %.0f | %.1f |" %
              (a.mode, world, psi / 1e6, median * 1e3, a.batch * a.seq * world / median, v[0].item(), v[1].item(),
               mean_sent), flush=True)
        calls = ", ".join("%s x%d" % kv for kv in sorted(counter.calls.items()))
        print("wire check (%s): counted %.1f MiB sent per rank per step in %s; the loopback device carried %.1f MiB "
              "per rank meanwhile (payload + TCP/Gloo headers + anything else on lo)" %
              (a.mode, mean_sent, calls, (lo_after - lo_before) / world / 1048576.0), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=MODES, default="ddp_zero")
    ap.add_argument("--steps", type=int, default=6, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--layers", type=int, default=7, help="transformer layers")
    a = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        run(a, rank, world)
    except Exception as e:  # one line in the table instead of a traceback
        if rank == 0:
            msg = " ".join(("%s: %s" % (type(e).__name__, e)).split())[:200]
            print("ROW | PyTorch (Python) | %s | %d | failed: %s | - | - | - | - | - |" % (a.mode, world, msg),
                  flush=True)
        traceback.print_exc()
        dist.destroy_process_group()
        return  # exit 0: the row says what failed, and the wrapper goes on to the next mode
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
