"""One shape's forward + backward, twice, by ours or FlashAttention-4 (compiled ahead of time), for ncu to
profile the second backward kernel (ncu_backward.sh; inputs and providers as kernel_times.py's):
    python3 benchmarks/fa4/ncu_backward_call.py {ours|fa4} B H N D {0|1}
"""
import sys

import torch

from kernel_times import bf16_inputs, fa4, ours

who, b, h, n, d, causal = sys.argv[1], *map(int, sys.argv[2:7])
leaves, q, k, v, grad = bf16_inputs(b, h, n, d, torch.Generator(device="cuda").manual_seed(0))
fn = ours if who == "ours" else fa4
for _ in range(2):
    torch.autograd.grad(fn(q, k, v, bool(causal)), leaves, grad)
torch.cuda.synchronize()
