"""Packed-batch (varlen) speed (issue 12's bar): a batch of sequences whose lengths are drawn from
64..8192 should run at >= 95% of the dense kernel's TFLOP/s on the same number of real tokens, and
faster than SDPA on the padded batch.

bf16, head dim 128, 16 query and key/value heads; FLOPs count real pairs only (causal: the pairs on
and below the diagonal). The dense reference holds the same tokens as sequences of the packed
batch's mean length (rounded to 128). SDPA runs the padded batch (every sequence padded to the
longest, no mask: the least work SDPA can do there). Forward, and forward + backward, timed apart:
each provider's median over 20 calls (CUDA events, one a call) after 3 warm-up calls, the providers'
calls interleaved (an H100's clocks drift by several percent within seconds: interleaved, the
providers see the same drift), the best of --rounds rounds kept.

    python3 benchmarks/bench_varlen.py [--sequences 16] [--seeds 0 1] [--out DIR]
"""
import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

# bench_timing puts the repository on sys.path, so this checkout's flashattn_ext is the one imported.
from bench_timing import interleaved_median_cuda_events
import flashattn_ext

HEADS, DIM, DTYPE = 16, 128, torch.bfloat16


def pair_flops(lengths, causal):
    """4 * D FLOPs a (query, key) pair and head, forward; the backward 2.5 times that."""
    pairs = sum(n * (n + 1) // 2 if causal else n * n for n in lengths)
    return 4 * DIM * HEADS * pairs


def forward_and_step(forward, inputs):
    """The forward, and forward + backward."""
    def step():
        out = forward()
        torch.autograd.grad(out, inputs, torch.ones_like(out))
    return forward, step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    lines = [f"# Packed batch (varlen): flashattn_ext ({torch.cuda.get_device_name()}, torch {torch.__version__})", "",
             f"bf16, D={DIM}, {HEADS} heads, {args.sequences} sequences of lengths drawn uniformly from 64..8192. "
             "TFLOP/s on real pairs, forward / forward+backward (backward FLOPs 2.5x the forward's); ratio: ours "
             "packed over ours dense on the same tokens (the bar: >= 0.95).", "",
             "| seed | causal | tokens | ours packed | ours dense, same tokens | SDPA padded | ratio |",
             "|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for seed in args.seeds:
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.randint(64, 8193, (args.sequences,), generator=gen).tolist()
        total, longest = sum(lengths), max(lengths)
        mean = max(128, round(total / len(lengths) / 128) * 128)
        q, k, v = (torch.randn(total, HEADS, DIM, device="cuda", dtype=DTYPE, requires_grad=True) for _ in range(3))
        cu = torch.tensor([0] + lengths, device="cuda").cumsum(0, dtype=torch.int32)
        dense = [torch.randn(total // mean, HEADS, mean, DIM, device="cuda", dtype=DTYPE, requires_grad=True)
                 for _ in range(3)]
        padded = [torch.randn(len(lengths), HEADS, longest, DIM, device="cuda", dtype=DTYPE, requires_grad=True)
                  for _ in range(3)]
        for causal in (False, True):
            providers = {
                "packed": (lambda: flashattn_ext.varlen_attention(q, k, v, cu, cu, longest, longest, is_causal=causal),
                           [q, k, v], pair_flops(lengths, causal)),
                "dense": (lambda: flashattn_ext.scaled_dot_product_attention(*dense, is_causal=causal), dense,
                          pair_flops([mean] * (total // mean), causal)),
                "sdpa": (lambda: F.scaled_dot_product_attention(*padded, is_causal=causal), padded,
                         pair_flops(lengths, causal)),
            }
            best = {name: [1e9, 1e9] for name in providers}
            for _ in range(args.rounds):
                for part in (0, 1):  # forward, forward + backward
                    fns = [forward_and_step(fn, inputs)[part] for fn, inputs, _ in providers.values()]
                    for name, seconds in zip(providers, interleaved_median_cuda_events(fns, 20)):
                        best[name][part] = min(best[name][part], seconds * 1e3)
            tflops = {name: (flops / best[name][0] / 1e9, 3.5 * flops / best[name][1] / 1e9)
                      for name, (_, _, flops) in providers.items()}
            cell = {name: f"{f:.0f} / {fb:.0f}" for name, (f, fb) in tflops.items()}
            ratio = " / ".join(f"{tflops['packed'][i] / tflops['dense'][i]:.2f}" for i in (0, 1))
            row = (f"| {seed} | {causal} | {total} | {cell['packed']} | {cell['dense']} (B={total // mean}, "
                   f"N={mean}) | {cell['sdpa']} | {ratio} |")
            lines.append(row)
            print(row, flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        name = torch.cuda.get_device_name().lower().replace(" ", "-")
        (args.out / f"bench_varlen_{name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
