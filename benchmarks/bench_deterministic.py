"""The deterministic backward (issue 47, item 5): flashattn_ext's backward under
torch.use_deterministic_algorithms against the same call without it, on one GPU, in TFLOP/s.

Three arms, timed in turns (interleaved CUDA events, the median of many calls) on the same autograd graph:
  default:       the Hopper backward, dQ added into float32 as it comes;
  deterministic: the same kernel with the key blocks adding dQ in a fixed order (where it covers the call);
  sm80:          the deterministic mode's former path, the sm80 kernels' separate dQ pass
                 (FLASHATTN_EXT_KERNELS=sm80, read at each call).
Each arm's gradients are checked first: the deterministic ones bitwise equal over two calls, and every
arm's within 1e-2 of the default's (relative to the largest gradient).

    python3 benchmarks/bench_deterministic.py [--out results/deterministic/FILE.md]
"""

from bench_timing import (  # (puts this checkout first on sys.path)
    interleaved_median_cuda_events, save_table, table_arguments, with_kernels)

import torch

import flashattn_ext

# (batch, heads_q, heads_kv, length, head_dim, causal): issue 47's anchor shapes, and GQA 32:8.
SHAPES = [(4, 16, 16, 4096, 128, False), (4, 16, 16, 4096, 128, True), (1, 16, 16, 16384, 128, False),
          (1, 16, 16, 16384, 128, True), (4, 32, 32, 4096, 64, False), (4, 32, 32, 4096, 64, True),
          (1, 32, 32, 16384, 64, False), (1, 32, 32, 16384, 64, True), (2, 32, 8, 8192, 128, True)]


def backward_in_mode(out, inputs, grad_out, deterministic, kernels=None):
    def run():
        torch.use_deterministic_algorithms(deterministic)
        try:
            return torch.autograd.grad(out, inputs, grad_out, retain_graph=True)
        finally:
            torch.use_deterministic_algorithms(False)
    return with_kernels(kernels, run)


def main():
    args = table_arguments(__doc__)
    gen = torch.Generator(device="cuda").manual_seed(0)
    lines = [f"# Deterministic backward against the default ({torch.cuda.get_device_name()}, bf16, "
             f"torch {torch.__version__})", "",
             "Backward TFLOP/s (2.5 x the forward's FLOPs, halved when causal); det / default and sm80 / default.", "",
             "| B | Hq | Hkv | N | D | causal | default | deterministic | sm80 (former) | det / default | "
             "sm80 / default | det bitwise repeatable |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for batch, heads_q, heads_kv, length, dim, causal in SHAPES:
        q = torch.randn(batch, heads_q, length, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(batch, heads_kv, length, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                for _ in range(2))
        inputs = [t.requires_grad_() for t in (q, k, v)]
        out = flashattn_ext.scaled_dot_product_attention(*inputs, is_causal=causal, enable_gqa=heads_q != heads_kv)
        grad_out = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=gen)
        arms = {"default": backward_in_mode(out, inputs, grad_out, False),
                "deterministic": backward_in_mode(out, inputs, grad_out, True),
                "sm80": backward_in_mode(out, inputs, grad_out, True, kernels="sm80")}
        want = arms["default"]()
        scale = max(w.abs().max().item() for w in want)
        first, second = arms["deterministic"](), arms["deterministic"]()
        repeatable = all(torch.equal(a, b) for a, b in zip(first, second))
        for name in ("deterministic", "sm80"):
            got = first if name == "deterministic" else arms[name]()
            error = max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want)) / scale
            assert error <= 1e-2, f"{name} differs from the default by {error:.3g}"
        times = interleaved_median_cuda_events(list(arms.values()), args.reps)
        flops = 2.5 * 4 * batch * heads_q * length * length * dim / (2 if causal else 1)
        rates = [flops / t / 1e12 for t in times]
        line = (f"| {batch} | {heads_q} | {heads_kv} | {length} | {dim} | {causal} | {rates[0]:.0f} | {rates[1]:.0f} | "
                f"{rates[2]:.0f} | {rates[1] / rates[0]:.2f} | {rates[2] / rates[0]:.2f} | {repeatable} |")
        print(line, flush=True)
        lines.append(line)
        del q, k, v, inputs, out, grad_out, want, first, second
        torch.cuda.empty_cache()
    save_table(lines, args.out)


if __name__ == "__main__":
    main()
