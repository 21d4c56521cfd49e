"""The FP8 forward (issue 47): the Hopper forward's e4m3 kernel (attention_forward_fp8 with descales a
(batch, key/value head), head dim 128) against our bfloat16 forward at the same shape, in TFLOP/s
(4 E FLOPs a visible (query, key) pair: S = Q K^T and O = P V; causal calls half the pairs), timed in
turns (CUDA events, medians). Beside them the FP8 op's dequantize path (block descales, which the e4m3
kernel does not take: the operands dequantized to bfloat16, then the bfloat16 forward), what every FP8
call ran before. The FP8 time includes its transpose of V (its own column too). The bar: at least 1.5x
the bfloat16 forward's TFLOP/s.

    python3 benchmarks/bench_fp8.py [--out results/training/FILE.md]
"""
import math

from bench_timing import (  # (puts this checkout first on sys.path)
    interleaved_median_cuda_events, save_table, table_arguments)

import torch
from torch.profiler import ProfilerActivity, profile

import flashattn_ext  # noqa: F401 (registers the ops)

# (batch, heads, length, causal), head dim 128
SHAPES = [(2, 16, 8192, False), (2, 16, 8192, True), (1, 16, 16384, False), (1, 16, 16384, True)]
DIM = 128


def kernel_times_ms(fn):
    """The CUDA time of each kernel fn launches (one call, profiled), by name."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / 1e3 for e in prof.key_averages() if e.device_time_total > 0}


def main():
    args = table_arguments(__doc__)
    gen = torch.Generator(device="cuda").manual_seed(0)
    lines = [f"# FP8 (e4m3) forward against bfloat16, head dim {DIM} ({torch.cuda.get_device_name()}, "
             f"torch {torch.__version__})", "",
             "| B | H | N | causal | fp8 ms | bf16 ms | fp8 TFLOP/s | bf16 TFLOP/s | ratio | V transpose ms | "
             "dequantize path ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    scale = 1 / math.sqrt(DIM)
    for batch, heads, length, causal in SHAPES:
        shape = (batch, heads, length, DIM)
        bf16 = [torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3)]
        fp8 = [(x * 40).clamp(-448, 448).to(torch.float8_e4m3fn) for x in bf16]
        descales = [torch.full((batch, heads), 1 / 40, device="cuda") for _ in range(3)]
        blocks = [d[:, :, None].expand(-1, -1, (length + 127) // 128).contiguous() for d in descales]
        fns = [
            lambda: torch.ops.flashattn_ext.attention_forward_fp8(*fp8, *descales, causal, False, scale),
            lambda: torch.ops.flashattn_ext.attention_forward(*bf16, None, 0.0, causal, False, scale),
            lambda: torch.ops.flashattn_ext.attention_forward_fp8(*fp8, *blocks, causal, False, scale),
        ]
        with torch.no_grad():
            times = interleaved_median_cuda_events(fns, args.reps)
            transpose_ms = sum(t for name, t in kernel_times_ms(fns[0]).items() if "fp8_transpose_values" in name)
        pairs = batch * heads * length * length / (2 if causal else 1)
        rates = [pairs * 4 * DIM / t / 1e12 for t in times[:2]]
        line = (f"| {batch} | {heads} | {length} | {causal} | {times[0] * 1e3:.3f} | {times[1] * 1e3:.3f} | "
                f"{rates[0]:.0f} | {rates[1]:.0f} | {rates[0] / rates[1]:.2f} | {transpose_ms:.3f} | "
                f"{times[2] * 1e3:.3f} |")
        print(line, flush=True)
        lines.append(line)
    save_table(lines, args.out)


if __name__ == "__main__":
    main()
