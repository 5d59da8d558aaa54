#!/usr/bin/env python3
"""The model-state formulas behind bench/memory_wall.sh's search, for BART-large's width.

  bench_memory_formula.py formula STRATEGY RANKS CAP   the most layers whose model states fit CAP
  bench_memory_formula.py config L                     a config.json with L encoder and L decoder layers
  bench_memory_formula.py row STRATEGY L PEAK FORMULA_L RUNS   the search's table row
"""
import json
import sys

D, FFN, HEADS, VOCAB, POSITIONS = 1024, 4096, 16, 4096, 1024
ENCODER = 4 * (D * D + D) + (D * FFN + FFN) + (FFN * D + D) + 4 * D  # attention, FFN, 2 layer norms
DECODER = 8 * (D * D + D) + (D * FFN + FFN) + (FFN * D + D) + 6 * D  # 2 attentions, FFN, 3 layer norms
ROOT = VOCAB * D + 2 * (POSITIONS + 2) * D + 4 * D  # shared embedding (the tied head), positions, embedding norms
NAMES = {"0": "ZeRO-0 (replicated)", "1": "ZeRO-1", "2": "ZeRO-2", "3": "ZeRO-3",
         "3ac": "ZeRO-3, activation checkpointing", "pp2": "pp 2 x ZeRO-3"}


def units(layers):
    return layers * (ENCODER + DECODER)


def states(strategy, layers, n):
    """fp32 model states per rank (docs/drop-in.md, docs/fully-shard.md): parameters, gradients, AdamW moments."""
    psi_u, psi_r = units(layers), ROOT
    psi = psi_u + psi_r
    if strategy == "0":
        return 16 * psi
    if strategy == "1":
        return (8 + 12 / n) * psi
    if strategy == "2":
        return (4 + 12 / n) * psi
    if strategy == "3" or strategy == "3ac":  # the root stays gathered: its parameters whole, the rest sharded
        return 16 * psi_u / n + 4 * psi_r + 12 * psi_r / n
    if strategy == "pp2":  # half the layers per pipeline stage, sharded over its n / 2 ranks; the root on stage 0
        return 16 * (psi_u / 2) / (n / 2) + 4 * psi_r + 12 * psi_r / (n / 2)
    raise SystemExit(f"unknown strategy {strategy!r}: 0, 1, 2, 3, 3ac or pp2")


def bytes_of(cap):
    units_ = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(float(cap[:-1]) * units_[cap[-1].upper()]) if cap[-1].upper() in units_ else int(cap)


def main(argv):
    if argv[0] == "formula":
        strategy, n, cap = argv[1], int(argv[2]), bytes_of(argv[3])
        layers = 0
        while layers < 1000 and states(strategy, layers + 1, n) <= cap:
            layers += 1
        print(layers)
    elif argv[0] == "config":
        layers = int(argv[1])
        print(json.dumps({"d_model": D, "encoder_layers": layers, "decoder_layers": layers,
                          "encoder_attention_heads": HEADS, "decoder_attention_heads": HEADS,
                          "encoder_ffn_dim": FFN, "decoder_ffn_dim": FFN, "vocab_size": VOCAB,
                          "max_position_embeddings": POSITIONS}))
    elif argv[0] == "row":
        strategy, layers, peak, formula_layers, runs = argv[1], int(argv[2]), int(argv[3]), int(argv[4]), int(argv[5])
        params = f"{(units(layers) + ROOT) / 1e6:,.0f}M" if layers else "-"
        held = f"{peak / 2**20:,.0f}" if layers else "-"
        print(f"| {NAMES[strategy]} | {layers} | {params} | {held} | {formula_layers} | {runs} |")
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
