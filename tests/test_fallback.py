"""The ATen fallback that CUDA runs for the calls its kernels do not take (and every device under
FLASHATTN_EXT_KERNELS=aten, as .ci/run's second run): its chunks of query rows, and its warning."""
import subprocess
import sys

import torch
import torch.nn.functional as F

import flashattn_ext
from helpers import cuda_test, forward_and_grads, naive_attention, random_qkv, relative_error


@cuda_test
def test_fallback_chunks_match_reference():
    """Calls the CUDA kernels do not cover (here float64) run the ATen fallback, which takes
    query rows in chunks of about 128 MiB of scores: with 2**20 keys, 2 rows per chunk, so 5
    rows make 3 chunks, causal lower-right and a float mask crossing their boundaries."""
    shapes = (2, 4, 5, 8), (2, 2, 2**20, 8), (2, 2, 2**20, 8)
    q, k, v = random_qkv(*shapes, torch.float64, "cuda")
    grad_out = torch.randn(2, 4, 5, 8, dtype=torch.float64, device="cuda")

    def ours(q, k, v):
        lower_right, _ = flashattn_ext.attention_with_lse(q, k, v, is_causal=True, causal_lower_right=True, enable_gqa=True)
        return flashattn_ext.scaled_dot_product_attention(q, k, v, enable_gqa=True) + lower_right

    def reference(q, k, v):
        return naive_attention(q, k, v, enable_gqa=True)[0] + naive_attention(q, k, v, True, True, enable_gqa=True)[0]

    got, want = forward_and_grads(ours, (q, k, v), grad_out), forward_and_grads(reference, (q, k, v), grad_out)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert relative_error(g, w) < 1e-12, name

    mask = torch.randn(5, 2**20, dtype=torch.float64, device="cuda", requires_grad=True)
    out = flashattn_ext.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out, want)
    for g, w in zip(torch.autograd.grad(out, (q, mask), grad_out), torch.autograd.grad(want, (q, mask), grad_out)):
        torch.testing.assert_close(g, w)


@cuda_test
def test_fallback_warns_once():
    """The first call the CUDA kernels do not cover warns, once, that it falls back. The warning is
    torch's C++ TORCH_WARN_ONCE: custom ops called through torch.ops print it to stderr."""
    script = (
        "import torch, flashattn_ext\n"
        "q = torch.randn(1, 2, 9, 8, device='cuda', requires_grad=True)\n"
        "for _ in range(3):\n"
        "    flashattn_ext.scaled_dot_product_attention(q, q, q).sum().backward()\n"
        "torch.cuda.synchronize()\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    warnings = [line for line in result.stderr.splitlines() if "fallback" in line]
    assert len(warnings) == 1 and "not Float" in warnings[0], result.stderr[-2000:]
