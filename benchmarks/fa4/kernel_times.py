"""Per-kernel GPU time of one forward + backward (bf16), ours against FlashAttention-4 (compiled ahead of
time), at issue 47's anchor shapes, by torch.profiler: is a gap in the main kernels or in the passes around
them (delta / preprocess, dQ convert / postprocess)? On the device, with the FA4 site installed (site.sh):
    PYTHONPATH=/tmp/fa4site:$PWD/benchmarks/fa4:$PWD/benchmarks python3 benchmarks/fa4/kernel_times.py
Its inputs and the two providers serve ncu_backward_call.py too.
"""
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from bench_attention import ext_attention, fa4_attention

SHAPES = [(4, 16, 4096, 128, False), (4, 16, 4096, 128, True), (1, 16, 16384, 128, False),
          (1, 16, 16384, 128, True), (4, 32, 4096, 64, False), (1, 32, 16384, 64, True)]
ITERS = 10


def ours(q, k, v, causal):
    return ext_attention(q, k, v, is_causal=causal)


def fa4(q, k, v, causal):
    return fa4_attention(q, k, v, is_causal=causal)


def bf16_inputs(b, h, n, d, gen):
    """Leaves (B, N, H, D) and q, k, v and the output's gradient seen as (B, H, N, D): FA4's own layout, which
    ours reads through strides too."""
    leaves = [torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
              for _ in range(3)]
    q, k, v = (x.transpose(1, 2) for x in leaves)
    grad = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
    return leaves, q, k, v, grad


def kernel_times(fn, q, k, v, causal, grad, leaves):
    for _ in range(3):
        torch.autograd.grad(fn(q, k, v, causal), leaves, grad)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(ITERS):
            torch.autograd.grad(fn(q, k, v, causal), leaves, grad)
        torch.cuda.synchronize()
    times = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name[:90]] += e.device_time / ITERS  # microseconds
    return times


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)
    for b, h, n, d, causal in SHAPES:
        leaves, q, k, v, grad = bf16_inputs(b, h, n, d, gen)
        print(f"\n## B={b} H={h} N={n} D={d} causal={causal}", flush=True)
        for name, fn in [("ours", ours), ("fa4", fa4)]:
            times = kernel_times(fn, q, k, v, causal, grad, leaves)
            total = sum(times.values())
            print(f"{name}: {total:.0f} us in all")
            for kname, t in sorted(times.items(), key=lambda x: -x[1])[:8]:
                print(f"    {t:9.1f} us  {kname}")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
