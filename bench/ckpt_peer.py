#!/usr/bin/env python3
"""PyTorch Distributed Checkpoint (DCP) on the state of bench/ckpt_bench.cpp (its peer).

The state: `layers` 2048x2048 linear layers without bias (24: 100.7M
parameters), each sharded by FSDP2's fully_shard (plus the root), after one
torch.optim.AdamW step (lr 1e-4), so a save writes the fp32 parameters and
both moments, 12 bytes per parameter, sharded over the ranks: 1.21 GB, as
ckpt_bench writes. Timed as ckpt_bench times (slowest rank, median of
--repeats, 3 by default to stay near 2 minutes on 2 cores; every timed write
starts after an untimed sync() and barrier):
  save        dcp.save of get_state_dict(model, opt) (FileSystemWriter:
              one file per rank, fsync), beside its anchor: every rank's dd of
              its share of the same bytes with conv=fsync, all at once,
              alternating with the saves as in ckpt_bench
  load        dcp.load into the live state dict + set_state_dict (DCP keeps
              no checksums, so nothing is verified)
  async_save  dcp.async_save: thread-based, on a Gloo group of its own so
              its collectives never interleave with training's; its default
              stager copies the state to CPU memory before it returns. The
              stall is the time until async_save returns and the training loop
              can go on; then one training step runs while the write goes on.

Needs torch 2.6 or later: run it with the project's .venv/bin/python, launched
with torchrun's environment variables, e.g.

  build/zeroshard-run --nproc-per-node 4 -- .venv/bin/python bench/ckpt_peer.py --dir build/ckpt_peer

Rank 0 prints a heading line and "ROW |...|" lines in ckpt_bench's format.
A part that fails prints a ROW that says what failed.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback

import torch
import torch.distributed as dist

if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 6):
    sys.exit(f"ckpt_peer.py: torch {torch.__version__} at {torch.__file__} is too old (needs 2.6+); "
             "run it with the project's .venv/bin/python")

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402


class Stack(torch.nn.Module):
    def __init__(self, layers, width):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def dir_bytes(path):
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def fail_row(what, e):
    return "ROW | %s | failed: %s | - | - |" % (what, " ".join(("%s: %s" % (type(e).__name__, e)).split())[:200])


def fsspec_rows(a, model, opt, state, slowest, train_step, rank):
    """DCP to an S3 store through fsspec (s3fs): save, load and async_save's stall, timed as the local ones."""
    from torch.distributed.checkpoint import FsspecReader, FsspecWriter
    import s3fs
    options = {"client_kwargs": {"endpoint_url": os.environ.get("AWS_ENDPOINT_URL"),
                                 "region_name": os.environ.get("AWS_REGION", "us-east-1")}}
    fs = s3fs.S3FileSystem(**options)
    rows, save_s, load_s, stall_s, nbytes = [], [], [], [], 0
    try:
        for i in range(a.repeats):
            path = "%s/dcp/step%d" % (a.fsspec, i + 1)
            dist.barrier()
            t0 = time.perf_counter()
            dcp.save(state(), storage_writer=FsspecWriter(path, **options))
            save_s.append(slowest(time.perf_counter() - t0))
            if rank == 0:
                nbytes = sum(f["size"] for f in fs.ls(path[5:], detail=True))
        gb = nbytes / 1e9
        save_med = statistics.median(save_s)
        rows.append("ROW | PyTorch DCP + s3fs save (FsspecWriter) | %.2f s | %.2f GB/s | - |" % (save_med, gb / save_med))
        for _ in range(a.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            sd = state()
            dcp.load(sd, storage_reader=FsspecReader("%s/dcp/step%d" % (a.fsspec, a.repeats), **options))
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            load_s.append(slowest(time.perf_counter() - t0))
        load_med = statistics.median(load_s)
        rows.append("ROW | PyTorch DCP + s3fs load (FsspecReader, no checksums) + set_state_dict | %.2f s | %.2f GB/s | - |"
                    % (load_med, gb / load_med))
        group = dist.new_group(backend="gloo")
        for i in range(a.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            pending = dcp.async_save(state(), storage_writer=FsspecWriter("%s/dcp-async/step%d" % (a.fsspec, i + 1),
                                                                          **options), process_group=group)
            stall_s.append(slowest(time.perf_counter() - t0))
            train_step()
            (pending.upload_completion if hasattr(pending, "upload_completion") else pending).result()
        rows.append("ROW | PyTorch DCP + s3fs async_save: training loop stall (until async_save returns) | %.3f s | - | - |"
                    % statistics.median(stall_s))
    except Exception as e:
        traceback.print_exc()
        rows.append(fail_row("PyTorch DCP + s3fs", e))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="build/ckpt_peer", help="checkpoint directory (on the disk to measure)")
    ap.add_argument("--layers", type=int, default=24, help="2048x2048 layers")
    ap.add_argument("--width", type=int, default=2048, help="layer width")
    ap.add_argument("--repeats", type=int, default=3,
                    help="saves and loads timed (median; ckpt_bench takes 5, which takes 2.5 minutes here)")
    ap.add_argument("--fsspec", default="",
                    help="s3://BUCKET/PREFIX: instead, DCP through FsspecWriter/FsspecReader and s3fs to that store "
                         "(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY), as bench/durable_bench.sh runs it")
    a = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Stack(a.layers, a.width)
    psi = sum(p.numel() for p in model.parameters())
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train_step():
        opt.zero_grad()
        model(torch.randn(2, a.width)).sum().backward()
        opt.step()

    train_step()  # one step, so the moments hold real values
    if rank == 0:
        shutil.rmtree(a.dir, ignore_errors=True)
        os.makedirs(a.dir)
    dist.barrier()

    def slowest(mine):
        t = torch.tensor([mine], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def quiet():  # each timed write starts from a quiet disk
        os.sync()
        dist.barrier()

    def state():
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd}

    rows = []
    if a.fsspec:
        rows = fsspec_rows(a, model, opt, state, slowest, train_step, rank)
        if rank == 0:
            print("ckpt_peer.py: %d ranks, %.1fM parameters, DCP + s3fs %s" % (world, psi / 1e6, a.fsspec), flush=True)
            for r in rows:
                print(r, flush=True)
        dist.barrier()
        dist.destroy_process_group()
        return

    # Synchronous saves, alternating with the dd anchor.
    save_s, dd_s, load_s = [], [], []
    nbytes, mine_mib, last = 0, 1, None
    try:
        for i in range(a.repeats):
            path = os.path.join(a.dir, "sync", "step%d" % (i + 1))
            quiet()
            t0 = time.perf_counter()
            dcp.save(state(), checkpoint_id=path)
            save_s.append(slowest(time.perf_counter() - t0))
            if rank == 0:
                nbytes = dir_bytes(path)
                if last is not None:
                    shutil.rmtree(last, ignore_errors=True)  # keep one on disk
            last = path
            nb = torch.tensor([nbytes], dtype=torch.float64)
            dist.broadcast(nb, 0)
            nbytes = int(nb.item())
            mine_mib = max(1, nbytes // world // (1 << 20))
            dd_file = os.path.join(a.dir, "dd.rank%d" % rank)
            quiet()
            t1 = time.perf_counter()
            subprocess.run(["dd", "if=/dev/zero", "of=" + dd_file, "bs=1M", "count=%d" % mine_mib, "conv=fsync",
                            "status=none"], check=True)
            dd_s.append(slowest(time.perf_counter() - t1))
            os.remove(dd_file)
        gb = nbytes / 1e9
        dd_gbs = mine_mib * (1 << 20) * world / 1e9 / statistics.median(dd_s)
        save_med = statistics.median(save_s)
        rows.append("ROW | PyTorch DCP save (sync, fsync) | %.2f s | %.2f GB/s | %.2f of dd |" %
                    (save_med, gb / save_med, (gb / save_med) / dd_gbs))
        rows.append("ROW | dd beside DCP, same bytes, conv=fsync, one per rank | %.2f s | %.2f GB/s | 1 |" %
                    (statistics.median(dd_s), dd_gbs))
    except Exception as e:
        traceback.print_exc()
        rows.append(fail_row("PyTorch DCP save (sync, fsync)", e))
        save_med, gb = None, None

    # Loads of the last synchronous save, into the live state.
    if last is not None and gb is not None:
        try:
            for _ in range(a.repeats):
                dist.barrier()
                t0 = time.perf_counter()
                sd = state()
                dcp.load(sd, checkpoint_id=last)
                set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
                load_s.append(slowest(time.perf_counter() - t0))
            load_med = statistics.median(load_s)
            rows.append("ROW | PyTorch DCP load (read, no checksums) + set_state_dict | %.2f s | %.2f GB/s | - |" %
                        (load_med, gb / load_med))
        except Exception as e:
            traceback.print_exc()
            rows.append(fail_row("PyTorch DCP load", e))

    # Async saves: the stall, and a training step with the write beside it.
    try:
        async_group = dist.new_group(backend="gloo")
        step_s, step_with_save_s, stall_s = [], [], []
        for i in range(a.repeats):
            quiet()
            t0 = time.perf_counter()
            train_step()
            step_s.append(slowest(time.perf_counter() - t0))
            quiet()
            t0 = time.perf_counter()
            pending = dcp.async_save(state(), checkpoint_id=os.path.join(a.dir, "async", "step%d" % (i + 1)),
                                     process_group=async_group)
            stall = time.perf_counter() - t0
            train_step()
            step_with_save = time.perf_counter() - t0
            stall_s.append(slowest(stall))
            step_with_save_s.append(slowest(step_with_save))
            (pending.upload_completion if hasattr(pending, "upload_completion") else pending).result()
            dist.barrier()
            if rank == 0 and i > 0:
                shutil.rmtree(os.path.join(a.dir, "async", "step%d" % i), ignore_errors=True)
        stall_med = statistics.median(stall_s)
        rows.append("ROW | PyTorch DCP async_save: training loop stall (until async_save returns: its copy of the state"
                    " to CPU memory) | %.3f s | - | %s |" %
                    (stall_med, "%.3f of the sync save" % (stall_med / save_med) if save_med else "-"))
        step_med, with_med = statistics.median(step_s), statistics.median(step_with_save_s)
        rows.append("ROW | PyTorch DCP async_save: a training step (%.2f s alone) with the save running beside it "
                    "| %.2f s | - | +%.2f s |" % (step_med, with_med, with_med - step_med))
    except Exception as e:
        traceback.print_exc()
        rows.append(fail_row("PyTorch DCP async_save", e))

    if rank == 0:
        print("ckpt_peer: PyTorch %s DCP, %d ranks, %.1fM parameters, %s GB of checkpoint files per save, median of %d"
              % (torch.__version__, world, psi / 1e6, "%.2f" % gb if gb is not None else "?", a.repeats))
        for r in rows:
            print(r)
        sys.stdout.flush()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(a.dir, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
