"""A minute's check that the Hopper kernels run and finish (a hang shows as a timeout, not a lost device call).

Forward and backward of a few shapes (causal and not, head dims 64, 128 and 256, a ragged length, GQA)
against SDPA's math backend in float32, printing the largest error of each.
    timeout -s KILL 120 python3 benchmarks/smoke_sm90.py   (SIGKILL: a process waiting on a hung kernel ignores SIGTERM)
"""
import torch
import torch.nn.functional as F

import flashattn_ext

SHAPES = [  # batch, heads_q, heads_kv, len_q, len_k, head_dim, causal
    (2, 4, 4, 1024, 1024, 128, False), (2, 4, 4, 1024, 1024, 128, True), (1, 8, 2, 777, 777, 64, True),
    (1, 4, 4, 4096, 4096, 64, False), (3, 2, 1, 300, 1000, 128, True), (2, 4, 2, 1000, 1000, 256, True),
    (1, 2, 2, 517, 2000, 192, False),
]

for b, hq, hkv, nq, nk, d, causal in SHAPES:
    torch.manual_seed(0)
    q = torch.randn(b, hq, nq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, hkv, nk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, hkv, nk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = flashattn_ext.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    ref_inputs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_inputs, is_causal=causal, enable_gqa=hq != hkv)
    ref_grads = torch.autograd.grad(ref, ref_inputs, torch.ones_like(ref))
    errors = [(out.float() - ref).abs().max().item()] + [(g.float() - r).abs().max().item()
                                                          for g, r in zip(grads, ref_grads)]
    torch.cuda.synchronize()
    print((b, hq, hkv, nq, nk, d, causal), "max |error| out, dq, dk, dv:", " ".join(f"{e:.3g}" for e in errors),
          flush=True)
