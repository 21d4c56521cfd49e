"""CPU attention: what dropout costs flashattn_ext, forward and forward+backward.

bench_cpu.py's cells (causal, 1 x 4 x 512 x 64 and 4 x 16 x 2048 x 64, float32 and bfloat16), each run
without dropout and with dropout_p (0.1), the two taking turns in each round; each time is the median
of the rounds after one warm-up round, in milliseconds, wall clock.

    python3 benchmarks/bench_cpu_dropout.py [--rounds 5] [--threads 2] [--dropout-p 0.1] [--bits 8]
"""
import argparse
import platform
import statistics

import torch

import flashattn_ext
from bench_cpu import SHAPES, timed_rounds

DTYPES = [torch.float32, torch.bfloat16]


def measure(shape, dtype, dropout_p, rounds):
    """{p: (forward ms, forward+backward ms)} for p = 0 and dropout_p, medians over the rounds."""
    attention = flashattn_ext.scaled_dot_product_attention
    variants = {p: (attention, {"dropout_p": p}) for p in (0.0, dropout_p)}
    times = timed_rounds(shape, dtype, rounds, variants)
    return {p: tuple(statistics.median(t) for t in pair) for p, pair in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dropout-p", type=float, default=0.1)
    parser.add_argument("--bits", type=int, default=8, choices=(8, 16), help="dropout's random numbers")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    flashattn_ext.set_dropout_bits(args.bits)
    cpu = platform.processor() or platform.machine()
    print(f"# flashattn_ext on the CPU, causal, without and with dropout_p={args.dropout_p} ({cpu}, "
          f"{args.threads} threads, torch {torch.__version__}, {flashattn_ext.get_dropout_bits()}-bit numbers)\n")
    print(f"ms forward / forward+backward, median of {args.rounds} rounds after a warm-up.\n")
    print("| shape | dtype | no dropout | dropout |")
    print("|---|---|---|---|")
    for shape in SHAPES:
        for dtype in DTYPES:
            result = measure(shape, dtype, args.dropout_p, args.rounds)
            plain, dropped = result[0.0], result[args.dropout_p]
            print(f"| {' x '.join(map(str, shape))} | {str(dtype).removeprefix('torch.')} | "
                  f"{plain[0]:.1f} / {plain[1]:.1f} | {dropped[0]:.1f} / {dropped[1]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
