"""CPU attention: flashattn_ext against torch's CPU SDPA, forward and forward+backward.

Issue 11's cells: causal, the README's demo shape (1 x 4 x 512 x 64) and 4 x 16 x 2048 x 64, float32 and
bfloat16 (--dtypes: others), on every core torch uses. The providers take turns in each round (so that a
machine's drift hits both alike); in its turn a provider runs each call back to back for at least
--turn-ms (once where a call takes longer), and each cell is the fastest call of all its turns, in
milliseconds, wall clock: on a shared machine whose speed drifts by a third between runs, the minimum is
what stays put (medians moved more than the changes being measured), and calls of a fraction of a
millisecond, timed one a turn, read 0.65-0.95x from run to run of the same code.

    python3 benchmarks/bench_cpu.py [--rounds 5] [--turn-ms 20] [--dtypes float32 bfloat16 float16] [--out DIR]
"""
import argparse
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import flashattn_ext

SHAPES = [(1, 4, 512, 64), (4, 16, 2048, 64)]
DTYPES = ["float32", "bfloat16"]
PROVIDERS = {"flashattn_ext": flashattn_ext.scaled_dot_product_attention, "torch": F.scaled_dot_product_attention}


def fastest_ms(fn, turn_ms) -> float:
    """The fastest of fn's calls, run back to back for at least turn_ms (at least one call)."""
    best, spent = float("inf"), 0.0
    while spent < turn_ms or best == float("inf"):
        start = time.perf_counter()
        fn()
        ms = (time.perf_counter() - start) * 1e3
        best, spent = min(best, ms), spent + ms
    return best


def attention_calls(attention, q, k, v, dout, **options):
    """(forward, forward+backward) of one attention function on the inputs (causal)."""
    def forward():
        with torch.no_grad():
            attention(q, k, v, is_causal=True, **options)

    def forward_backward():
        torch.autograd.grad(attention(q, k, v, is_causal=True, **options), (q, k, v), dout)

    return forward, forward_backward


def timed_rounds(shape, dtype, rounds, variants, turn_ms=0.0):
    """{name: ([forward ms], [forward+backward ms])}, one of each a round (fastest_ms over turn_ms)
    after a warm-up round, the variants ({name: (attention, options)}) taking turns on the same random
    inputs."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen).to(dtype).requires_grad_() for _ in range(3))
    dout = torch.randn(shape, generator=gen).to(dtype)
    calls = {name: attention_calls(attention, q, k, v, dout, **options)
             for name, (attention, options) in variants.items()}
    times = {name: ([], []) for name in calls}
    for round_ in range(rounds + 1):  # round 0 warms up
        for name, (forward, forward_backward) in calls.items():
            f, fb = fastest_ms(forward, turn_ms), fastest_ms(forward_backward, turn_ms)
            if round_ > 0:
                times[name][0].append(f)
                times[name][1].append(fb)
    return times


def measure(shape, dtype, rounds, turn_ms):
    """{provider: (forward ms, forward+backward ms)}, minima over the rounds."""
    variants = {name: (attention, {}) for name, attention in PROVIDERS.items()}
    times = timed_rounds(shape, dtype, rounds, variants, turn_ms)
    return {name: tuple(min(t) for t in pair) for name, pair in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--turn-ms", type=float, default=20.0,
                        help="each provider's calls run back to back for at least this long a round")
    parser.add_argument("--dtypes", nargs="+", default=DTYPES, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--out", type=Path, help="write the table to DIR/bench_cpu_<threads>threads.md")
    args = parser.parse_args()
    threads = torch.get_num_threads()
    cpu = platform.processor() or platform.machine()
    lines = [f"# CPU attention, causal: flashattn_ext against torch's CPU SDPA ({cpu}, {threads} threads, "
             f"torch {torch.__version__})", "",
             f"ms forward / forward+backward, the fastest call of {args.rounds} rounds (calls back to back "
             f"for {args.turn_ms:g} ms a turn), providers alternating; "
             "ratio: torch's time / ours (>= 1: ours at least as fast).", "",
             "| shape | dtype | flashattn_ext | torch | ratio |", "|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for shape in SHAPES:
        for dtype in (getattr(torch, name) for name in args.dtypes):
            result = measure(shape, dtype, args.rounds, args.turn_ms)
            ours, theirs = result["flashattn_ext"], result["torch"]
            line = (f"| {' x '.join(map(str, shape))} | {str(dtype).removeprefix('torch.')} | "
                    f"{ours[0]:.1f} / {ours[1]:.1f} | {theirs[0]:.1f} / {theirs[1]:.1f} | "
                    f"{theirs[0] / ours[0]:.2f} / {theirs[1] / ours[1]:.2f} |")
            lines.append(line)
            print(line, flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"bench_cpu_{threads}threads.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
