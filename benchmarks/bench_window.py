"""Sliding-window speed (issue 12's bar): a window of W keys at N tokens should take at most 1.2x of
(W / N) times full attention's time, full attention being the same call without the window and
without causal masking (N x N pairs against about N x W).

bf16, head dim 128, B x H = 1 x 16, forward and backward timed apart (the backward:
torch.autograd.grad on one saved forward). Times are the median of 20 calls (CUDA events) after
3 warm-up calls, the windowed and full calls alternating over --rounds rounds (the best round's
median kept).

    python3 benchmarks/bench_window.py [--seqlens 32768] [--windows 4096] [--out DIR]
"""
import argparse
from pathlib import Path

import torch

# bench_timing puts the repository on sys.path, so this checkout's flashattn_ext is the one imported.
from bench_timing import median_cuda_events
import flashattn_ext

BATCH, HEADS, DIM = 1, 16, 128


def median_ms(fn, calls=20, warmup=3):
    for _ in range(warmup):
        fn()
    return median_cuda_events(fn, calls) * 1e3


def forward_and_backward(q, k, v, **kwargs):
    """Two callables: the forward, and the backward of one saved forward."""
    out = flashattn_ext.attention_with_lse(q, k, v, **kwargs)[0]
    dout = torch.randn_like(out)
    return (lambda: flashattn_ext.attention_with_lse(q, k, v, **kwargs),
            lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[32768])
    parser.add_argument("--windows", type=int, nargs="+", default=[4096])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    lines = [f"# Sliding window: flashattn_ext ({torch.cuda.get_device_name()}, torch {torch.__version__})", "",
             f"bf16, D={DIM}, B x H = {BATCH} x {HEADS}; window (W, 0) is causal with W keys back (Mistral's), "
             "(W/2, W/2) two-sided. A cell is ms forward / backward; ratio: windowed ms / ((W / N) x full ms), "
             "the bar <= 1.2.", "",
             "| N | window | full ms | windowed ms | ratio |", "|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for n in args.seqlens:
        q, k, v = (torch.randn(BATCH, HEADS, n, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        full = forward_and_backward(q, k, v)
        for w in args.windows:
            for kwargs in (dict(window=(w, 0), is_causal=True), dict(window=(w // 2, w // 2))):
                windowed = forward_and_backward(q, k, v, **kwargs)
                best = {}
                for _ in range(args.rounds):
                    for name, calls in (("full", full), ("windowed", windowed)):
                        for step, fn in enumerate(calls):
                            best[name, step] = min(best.get((name, step), float("inf")), median_ms(fn))
                cells = [" / ".join(f"{best[name, step]:.3f}" for step in (0, 1)) for name in ("full", "windowed")]
                ratio = " / ".join(f"{best['windowed', step] / (w / n * best['full', step]):.2f}" for step in (0, 1))
                row = f"| {n} | {kwargs['window']} | {cells[0]} | {cells[1]} | {ratio} |"
                lines.append(row)
                print(row, flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        name = torch.cuda.get_device_name().lower().replace(" ", "-")
        (args.out / f"bench_window_{name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
