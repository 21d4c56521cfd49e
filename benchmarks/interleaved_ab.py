"""Kernel variants against each other and cuDNN, interleaved in one process.

For deciding on a kernel change: build the candidate behind a temporary environment switch that the
launch code reads at each call, then time the variants in turns (short bursts, each variant in every
round), so that clock and temperature drift over the run hits all of them alike. Separate runs of
bench_attention.py differ by up to 15% a cell, more than most single changes are worth.

    python3 benchmarks/interleaved_ab.py --variant old:FLASHATTN_EXT_SOME_SWITCH=1 [--variant ...]

Each variant is NAME or NAME:VAR=VALUE[,VAR=VALUE...]; "ours" (no switch) and cuDNN always run.
Prints forward / backward TFLOP/s (bf16; the medians of the rounds) and the largest difference of each
variant's output from cuDNN's.
"""
import argparse
import os
import statistics
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashattn_ext

# (batch, heads_q, heads_kv, len, head_dim, causal): the bench's D=128 and D=64 causal cells, the
# model benchmark's GQA shapes, and non-causal cells.
SHAPES = [(8, 16, 16, 2048, 128, True), (4, 16, 16, 4096, 128, True), (1, 16, 16, 16384, 128, True),
          (2, 16, 4, 8192, 128, True), (8, 16, 4, 2048, 128, True), (4, 32, 32, 4096, 64, True),
          (1, 32, 32, 16384, 64, True), (4, 16, 16, 4096, 128, False), (8, 16, 16, 2048, 128, False),
          (1, 16, 16, 16384, 128, False), (4, 32, 32, 4096, 64, False)]


def parse_variant(text: str) -> Tuple[str, Dict[str, str]]:
    name, _, assignments = text.partition(":")
    env = dict(pair.split("=", 1) for pair in assignments.split(",") if pair)
    return name, env


def burst_ms(fn, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def compare(shape, variants: Dict[str, Dict[str, str]], rounds: int, calls: int, backward: bool) -> str:
    b, hq, hkv, n, d, causal = shape
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (hq, hkv, hkv))
    dout = torch.randn(b, hq, n, d, device="cuda", dtype=torch.bfloat16)
    options = dict(is_causal=causal, enable_gqa=hq != hkv)
    switches = {var for env in variants.values() for var in env}

    def ours():
        return flashattn_ext.scaled_dot_product_attention(q, k, v, **options)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, **options)

    runs = {"cudnn": (cudnn, {})} | {name: (ours, env) for name, env in variants.items()}
    times: Dict[str, Tuple[List[float], List[float]]] = {name: ([], []) for name in runs}
    outputs = {}
    names = list(runs)
    for round_ in range(rounds + 1):  # round 0 warms up
        # Each round starts one provider later: in a fixed order, the one after
        # cuDNN read 1-3% below the same build timed later in the round.
        start = round_ % len(names)
        for name in names[start:] + names[:start]:
            fn, env = runs[name]
            for var in switches:
                os.environ.pop(var, None)
            os.environ.update(env)
            with torch.no_grad():
                forward = burst_ms(fn, calls)
            out = fn()
            backward_ms = (burst_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), calls)
                           if backward else float("nan"))
            if round_ == 0:
                outputs[name] = out.detach().float()
            else:
                times[name][0].append(forward)
                times[name][1].append(backward_ms)
    for var in switches:
        os.environ.pop(var, None)
    flops = 4 * b * hq * n * n * d / (2 if causal else 1)
    cells = [str(shape)]
    for name in runs:
        forward_ms, backward_ms = (statistics.median(t) for t in times[name])
        error = (outputs[name] - outputs["cudnn"]).abs().max().item()
        cells.append(f"{name} {flops / forward_ms / 1e9:.0f}/{2.5 * flops / backward_ms / 1e9:.0f} (err {error:.2g})")
    return " | ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", action="append", default=[], help="NAME or NAME:VAR=VALUE[,VAR=VALUE...]")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calls", type=int, default=5, help="calls per burst")
    parser.add_argument("--forward-only", action="store_true", help="time the forward only (backward: nan)")
    args = parser.parse_args()
    variants = dict([("ours", {})] + [parse_variant(text) for text in args.variant])
    print("forward/backward TFLOP/s, bf16; shape = (B, Hq, Hkv, N, D, causal)", flush=True)
    for shape in SHAPES:
        print(compare(shape, variants, args.rounds, args.calls, not args.forward_only), flush=True)


if __name__ == "__main__":
    main()
