#!/usr/bin/env python3
"""PyTorch's peer of bench/bart_bench.cpp: the same BART training step with
Hugging Face's BartForConditionalGeneration (the model zeroshard's BART exports
to and imports from), the same configuration, batch and AdamW settings.

Modes:
  ddp    the model in --precision (bf16: bf16 weights and AdamW states, as
         bart_bench's dp), torch.optim.AdamW (fused on CUDA), DistributedDataParallel
  fsdp2  an fp32 model, FSDP2's fully_shard on every encoder and decoder layer
         and then the root, as torchtitan applies it; with --precision bf16 a
         MixedPrecisionPolicy computes in bf16 and reduces gradients in fp32
         (fp32 master weights and AdamW states, as bart_bench's zero2 and zero3)
         and the buffer final_logits_bias is cast to bf16 first (FSDP2 casts
         parameters only; an fp32 bias would make the logits and the loss fp32,
         unlike the DDP peer's); at 1 rank the layers are not resharded after
         forward (nothing to free: zeroshard's units do the same there), on more
         they are (FSDP2's default); torch.optim.AdamW (fused on CUDA)

Both build the model with attn_implementation="sdpa" (PyTorch's fused
attention), and rank 0 prints "PEER torch VERSION transformers VERSION
attention IMPLEMENTATION" before its row.

Launched with torchrun's environment variables (NCCL on CUDA, Gloo on CPU), e.g.

  build/zeroshard-run --nproc-per-node 1 -- .venv/bin/python bench/bart_peer.py --mode fsdp2 \\
      --device cuda --precision bf16 --config base --batch 8 --src-len 512 --tgt-len 512

Rank 0 prints "ROW peer-MODE ranks parameters step_s tokens/s model_tflops
peak_memory_mib": the slowest rank's median step (forward, backward, gradient
reduction and optimizer step), target tokens per second, 6 x parameters x
tokens/s, and the largest rank's peak memory (allocated on CUDA, VmHWM on CPU).
bench/bart_bench.sh prints these rows beside zeroshard's when PEER_PYTHON is set.
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from transformers import BartConfig, BartForConditionalGeneration

from peer_util import peak_rss_mib

# bart::BartConfig::named (examples/bart/model/bart_model.cpp): tiny, base, large.
CONFIGS = {
    "tiny": dict(vocab_size=4096, d_model=128, layers=2, heads=4, ffn=512, positions=256),
    "base": dict(vocab_size=50265, d_model=768, layers=6, heads=12, ffn=3072, positions=1024),
    "large": dict(vocab_size=50265, d_model=1024, layers=12, heads=16, ffn=4096, positions=1024),
}


def hf_config(name):
    c = CONFIGS[name]
    # As BartConfig::hf_config_json: GELU, post-layer-norm, unscaled embeddings, tied head; no dropout (bart_bench).
    return BartConfig(vocab_size=c["vocab_size"], d_model=c["d_model"], encoder_layers=c["layers"],
                      decoder_layers=c["layers"], encoder_attention_heads=c["heads"],
                      decoder_attention_heads=c["heads"], encoder_ffn_dim=c["ffn"], decoder_ffn_dim=c["ffn"],
                      max_position_embeddings=c["positions"], dropout=0.0, attention_dropout=0.0,
                      activation_dropout=0.0, activation_function="gelu", scale_embedding=False,
                      tie_word_embeddings=True, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                      decoder_start_token_id=2, forced_eos_token_id=2, attn_implementation="sdpa")


def profile_step(path, cuda, step):
    """bench/step_profile.h's summary for the peer: the trace, the top kernels (host ops on the CPU, inclusive)
    and, on CUDA, the time some kernel or copy ran against the step's wall time."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True, with_flops=True) as prof:
        t0 = time.perf_counter()
        step()
        span_us = (time.perf_counter() - t0) * 1e6
    prof.export_chrome_trace(path)
    wanted = "cuda" if cuda else "cpu"
    totals, intervals = {}, []
    for e in prof.events():
        if e.device_type.name.lower() != wanted:
            continue
        t, n = totals.get(e.name, (0.0, 0))
        totals[e.name] = (t + e.time_range.elapsed_us(), n + 1)
        if cuda:
            intervals.append((e.time_range.start, e.time_range.end))
    for name, (t, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:10]:
        print(f"PROFILE top {t:.0f} {n} {name}", flush=True)
    if cuda:
        busy, end = 0.0, 0.0
        for s, e in sorted(intervals):
            if e > end:
                busy += e - max(s, end)
                end = e
        print(f"PROFILE busy {busy:.0f} {span_us:.0f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["ddp", "fsdp2"], required=True)
    ap.add_argument("--config", choices=sorted(CONFIGS), default="base")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--src-len", type=int, default=64)
    ap.add_argument("--tgt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--device-comm", default="auto", help="bart_bench's device transport; the peer's is NCCL on "
                    "CUDA, whatever this says")
    ap.add_argument("--profile", help="after the timed steps, one more traced on rank 0 (torch.profiler): its "
                    "Chrome trace to this file, and PROFILE lines as bart_bench prints them")
    args = ap.parse_args()

    cuda = args.device == "cuda"
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    bf16 = args.precision == "bf16"

    torch.manual_seed(0)
    model = BartForConditionalGeneration(hf_config(args.config))
    params = sum(p.numel() for p in model.parameters())
    if args.mode == "ddp":
        model = model.to(device=device, dtype=torch.bfloat16 if bf16 else torch.float32)
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        model = model.to(device)
        if bf16:
            for buf in model.buffers():
                if buf.is_floating_point():
                    buf.data = buf.data.to(torch.bfloat16)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                      reduce_dtype=torch.float32 if bf16 else None)
        reshard = world > 1
        for layer in list(model.model.encoder.layers) + list(model.model.decoder.layers):
            fully_shard(layer, mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(model, mp_policy=policy, reshard_after_forward=False)
    if rank == 0:
        import transformers
        print(f"PEER torch {torch.__version__} transformers {transformers.__version__} "
              f"attention {model.config._attn_implementation if args.mode == 'fsdp2' else model.module.config._attn_implementation}",
              flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True if cuda else None)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    vocab = CONFIGS[args.config]["vocab_size"]
    def run_step(ids, labels):
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        sync()

    times = []
    torch.manual_seed(1000 + rank)
    for step in range(args.warmup + args.steps + (1 if args.profile else 0)):
        ids = torch.randint(4, vocab, (args.batch, args.src_len), device=device)
        labels = torch.randint(4, vocab, (args.batch, args.tgt_len), device=device)
        sync()
        dist.barrier()  # every rank starts the step together: the slowest rank's time is the step's
        if step == args.warmup + args.steps:  # untimed: the profiler slows it
            if rank == 0:
                profile_step(args.profile, cuda, lambda: run_step(ids, labels))
            else:
                run_step(ids, labels)
            continue
        t0 = time.perf_counter()
        run_step(ids, labels)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)

    peak = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else peak_rss_mib()
    mine = torch.tensor([statistics.median(times), peak], dtype=torch.float64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    step_s, peak = mine.tolist()
    tokens_per_s = world * args.batch * args.tgt_len / step_s
    if rank == 0:
        print(f"ROW peer-{args.mode} {world} {params} {step_s:.3f} {tokens_per_s:.1f} "
              f"{6.0 * params * tokens_per_s / 1e12:.4f} {peak:.0f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
