"""One shape's forward + backward, twice, by ours or FlashAttention-4 (compiled ahead of time), for ncu to
profile the second backward kernel (ncu_backward.sh):
    python3 benchmarks/fa4/ncu_backward_call.py {ours|fa4} B H N D {0|1}
"""
import sys

import torch

who, b, h, n, d, causal = sys.argv[1], *map(int, sys.argv[2:7])
gen = torch.Generator(device="cuda").manual_seed(0)
leaves = [torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_() for _ in range(3)]
q, k, v = (x.transpose(1, 2) for x in leaves)
grad = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
if who == "ours":
    import flashattn_ext
    fn = lambda: flashattn_ext.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))  # noqa: E731
else:
    from bench_attention import fa4_attention
    fn = lambda: fa4_attention(q, k, v, is_causal=bool(causal))  # noqa: E731
for _ in range(2):
    torch.autograd.grad(fn(), leaves, grad)
torch.cuda.synchronize()
