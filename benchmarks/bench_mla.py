"""Values of another head dim (issue 47, item 4): the Hopper kernels at MLA's prefill shape (queries and keys
of head dim 192, values of 128) against the same kernel family at head dim 128, forward and backward, in
TFLOP/s of each call's own FLOPs, timed in turns (CUDA events, medians). Per (query, key) pair the forward
does 2 (E + Ev) FLOPs (S = Q K^T, O = P V) and the backward 2 (3 E + 2 Ev) (S again, dP = dO V^T,
dV = P^T dO, dK = dS^T Q, dQ = dS K); causal calls half the pairs. Beside them, the MLA call through the
ATen fallback (FLASHATTN_EXT_KERNELS=aten), which ran it before the Hopper kernels took it.
The bar: at least 0.9x the head-dim-128 kernels' TFLOP/s.

    python3 benchmarks/bench_mla.py [--out results/training/FILE.md]
"""

from bench_timing import (  # (puts this checkout first on sys.path)
    interleaved_median_cuda_events, save_table, table_arguments, with_kernels)

import torch

import flashattn_ext

# (batch, heads, length, causal)
SHAPES = [(4, 16, 4096, False), (4, 16, 4096, True), (1, 16, 16384, False), (1, 16, 16384, True)]


def main():
    args = table_arguments(__doc__)
    gen = torch.Generator(device="cuda").manual_seed(0)
    lines = [f"# MLA's prefill shape (192 / 128) against head dim 128 ({torch.cuda.get_device_name()}, bf16, "
             f"torch {torch.__version__})", "",
             "| B | H | N | causal | pass | 192/128 ms | 128 ms | 192/128 TFLOP/s | 128 TFLOP/s | ratio | "
             "192/128 ATen ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for batch, heads, length, causal in SHAPES:
        def inputs(dim, dim_v):
            return [torch.randn(batch, heads, length, d, device="cuda", dtype=torch.bfloat16, generator=gen,
                                requires_grad=True) for d in (dim, dim, dim_v)]
        mla, d128 = inputs(192, 128), inputs(128, 128)
        with torch.no_grad():
            forwards = [lambda t=t: flashattn_ext.scaled_dot_product_attention(*t, is_causal=causal)
                        for t in (mla, d128)]
            forward_times = interleaved_median_cuda_events(forwards + [with_kernels("aten", forwards[0])], args.reps)
        outs = [flashattn_ext.scaled_dot_product_attention(*t, is_causal=causal) for t in (mla, d128)]
        grad_out = torch.randn_like(outs[0])
        backwards = [lambda o=o, t=t: torch.autograd.grad(o, t, grad_out, retain_graph=True)
                     for o, t in zip(outs, (mla, d128))]
        backward_times = interleaved_median_cuda_events(backwards + [with_kernels("aten", backwards[0])], args.reps)
        pairs = batch * heads * length * length / (2 if causal else 1)
        for name, times, flops in (("forward", forward_times, lambda e, ev: 2 * (e + ev)),
                                   ("backward", backward_times, lambda e, ev: 2 * (3 * e + 2 * ev))):
            rates = [pairs * flops(192, 128) / times[0] / 1e12, pairs * flops(128, 128) / times[1] / 1e12]
            line = (f"| {batch} | {heads} | {length} | {causal} | {name} | {times[0] * 1e3:.3f} | "
                    f"{times[1] * 1e3:.3f} | {rates[0]:.0f} | {rates[1]:.0f} | {rates[0] / rates[1]:.2f} | "
                    f"{times[2] * 1e3:.3f} |")
            print(line, flush=True)
            lines.append(line)
    save_table(lines, args.out)


if __name__ == "__main__":
    main()
