#!/usr/bin/python3
"""PyTorch's own stack on the model and batch of bench/zero_vs_ddp.cpp.

Modes: ddp (DistributedDataParallel + torch.optim.AdamW) and ddp_zero (DDP +
ZeroRedundancyOptimizer wrapping AdamW), both on the Gloo backend. Launched by
zeroshard-run (torchrun's environment variables). Rank 0 prints one "ROW |...|"
line in the C++ benchmark's format.
"""
import argparse
import resource
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP


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
        h = self.encoder(h.transpose(0, 1)).transpose(0, 1)
        return self.head(h)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["ddp", "ddp_zero"], default="ddp_zero")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layers", type=int, default=7)
    a = ap.parse_args()
    vocab, d, heads, ff = 8192, 512, 8, 2048

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(Lm(vocab, a.seq, d, heads, ff, a.layers))
    psi = sum(p.numel() for p in model.parameters())
    if a.mode == "ddp_zero":
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4,
                                      weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

    times = []
    for step in range(a.warmup + a.steps):
        torch.manual_seed(1000 * step + rank)
        ids = torch.randint(vocab, (a.batch, a.seq + 1))
        start = time.perf_counter()
        opt.zero_grad()
        logits = model(ids[:, :a.seq])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if step >= a.warmup:
            times.append(t.item())
    median = statistics.median(times)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    # params + grads, plus this rank's AdamW states, plus DDP's gradient buckets (a full copy)
    state_bytes = 0
    inner = opt.optim if a.mode == "ddp_zero" else opt
    for st in inner.state.values():
        state_bytes += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
    states = torch.tensor([(12.0 * psi + state_bytes) / 1048576.0], dtype=torch.float64)
    dist.all_reduce(states, op=dist.ReduceOp.MAX)
    if rank == 0:
        print("ROW | PyTorch (Python) | %s | %d | %.1fM | %.0f | %.0f | %.0f | %.0f |" %
              (a.mode, world, psi / 1e6, median * 1e3, a.batch * a.seq * world / median, rss.item(), states.item()),
              flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
