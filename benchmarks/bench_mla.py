"""Values of another head dim (issue 47, item 4): the Hopper forward at MLA's prefill shape (queries and keys of
head dim 192, values of 128) against the same kernel family at head dim 128, in TFLOP/s of each call's own
FLOPs (2 x rows x keys x (E + Ev), halved when causal), timed in turns (CUDA events, medians).
The bar: at least 0.9x the head-dim-128 forward's TFLOP/s.

    python3 benchmarks/bench_mla.py [--out results/training/FILE.md]
"""
import argparse
from pathlib import Path

from bench_timing import interleaved_median_cuda_events  # (puts this checkout first on sys.path)

import torch

import flashattn_ext

# (batch, heads, length, causal)
SHAPES = [(4, 16, 4096, False), (4, 16, 4096, True), (1, 16, 16384, False), (1, 16, 16384, True)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    lines = [f"# MLA's prefill shape (192 / 128) against head dim 128, forward ({torch.cuda.get_device_name()}, "
             f"bf16, torch {torch.__version__})", "",
             "| B | H | N | causal | 192/128 ms | 128 ms | 192/128 TFLOP/s | 128 TFLOP/s | ratio |",
             "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for batch, heads, length, causal in SHAPES:
        def inputs(dim, dim_v):
            return [torch.randn(batch, heads, length, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                    for d in (dim, dim, dim_v)]
        mla, d128 = inputs(192, 128), inputs(128, 128)
        calls = [lambda: flashattn_ext.scaled_dot_product_attention(*mla, is_causal=causal),
                 lambda: flashattn_ext.scaled_dot_product_attention(*d128, is_causal=causal)]
        times = interleaved_median_cuda_events(calls, args.reps)
        pairs = batch * heads * length * length / (2 if causal else 1)
        rates = [2 * pairs * (192 + 128) / times[0] / 1e12, 2 * pairs * 256 / times[1] / 1e12]
        line = (f"| {batch} | {heads} | {length} | {causal} | {times[0] * 1e3:.3f} | {times[1] * 1e3:.3f} | "
                f"{rates[0]:.0f} | {rates[1]:.0f} | {rates[0] / rates[1]:.2f} |")
        print(line, flush=True)
        lines.append(line)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
