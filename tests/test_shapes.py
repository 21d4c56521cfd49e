"""Shapes and layouts: empty dimensions, no heads, SDPA's leading dims and broadcasting, views and
strides, storage offsets, explicit scales and partial requires_grad, and a module swapped onto the
shim, against torch SDPA. Each test runs on the cpu path, and on the cuda path (the GPU's default kernels)
where a GPU is present."""
import math

import pytest
import torch
import torch.nn.functional as F

import flashattn_ext
from helpers import make_inputs, on_paths, random_qkv, seq_major_qkv


@on_paths("cpu", "cuda")
@pytest.mark.parametrize("len_q,len_k,batch", [(5, 0, 2), (0, 7, 2), (5, 7, 0)])
def test_empty_dimensions_match_sdpa(len_q, len_k, batch, path):
    device = path.device
    q, k, v = make_inputs((batch, 2, 2, len_q, len_k, 8, 8), torch.float32 if device == "cpu" else torch.bfloat16, device)
    out = flashattn_ext.scaled_dot_product_attention(q, k, v)
    # torch's SDPA on CUDA returns None for batch 0, so the expectation comes from the CPU.
    want = F.scaled_dot_product_attention(*(t.detach().cpu().double() for t in (q, k, v)))
    assert out.shape == want.shape
    torch.testing.assert_close(out.cpu().double(), want)
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and (t.grad == 0).all()


@on_paths("cpu", "cuda")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_zero_heads(dtype, path):
    """No heads at all, through the kernels (bfloat16 on CUDA) and the ATen fallback (float32 on
    CUDA, whose query-head grouping divided 0 by 0 before)."""
    q = torch.randn(2, 0, 5, 8, dtype=dtype, device=path.device, requires_grad=True)
    out = flashattn_ext.scaled_dot_product_attention(q, q, q, dropout_p=0.2)
    assert out.shape == (2, 0, 5, 8)
    out.sum().backward()
    assert q.grad.shape == q.shape


@on_paths("cpu", "cuda")
def test_inputs_at_odd_storage_offsets(path):
    """q, k, v and grad_out that start 2 bytes into their storage, so no row is 16-byte aligned: the CUDA
    glue copies them to aligned rows first. Results match those of aligned copies of the same values."""
    shape = (2, 3, 70, 64)

    def at_odd_offset(seed):
        values = torch.randn(1 + math.prod(shape), generator=torch.Generator().manual_seed(seed))
        return values.to(device=path.device, dtype=torch.bfloat16)[1:].view(shape)

    q, k, v, grad_out = (at_odd_offset(seed) for seed in range(4))
    results = []
    for inputs, upstream in (((q, k, v), grad_out), ([t.clone() for t in (q, k, v)], grad_out.clone())):
        assert all((t.data_ptr() % 16 == 0) == (upstream is not grad_out) for t in (*inputs, upstream))
        inputs = [t.requires_grad_() for t in inputs]
        out = flashattn_ext.scaled_dot_product_attention(*inputs, is_causal=True)
        results.append((out, *torch.autograd.grad(out, inputs, upstream)))
    for name, got, want in zip(("out", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(got, want, msg=name)


@on_paths("cpu", "cuda")
def test_views_and_non_contiguous_grad_out(path):
    """(B, N, H, D) memory transposed to (B, H, N, D), and the stride-0 grad of out.sum()."""
    q, k, v = seq_major_qkv(2, 33, 3, 16, path.device, seed=1)
    assert not q.is_contiguous()
    out = flashattn_ext.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.sum().backward()
    grads = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    want.sum().backward()
    torch.testing.assert_close(out, want)
    for got, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(got, t.grad)


@on_paths("cpu", "cuda")
@pytest.mark.parametrize(
    "shape_q,shape_k,shape_v,enable_gqa",
    [
        ((5, 8), (6, 8), (6, 8), False),  # no batch, no heads
        ((3, 5, 8), (3, 6, 8), (3, 6, 4), False),  # no heads
        ((2, 3, 4, 5, 8), (2, 3, 4, 6, 8), (2, 3, 4, 6, 8), False),  # two batch dims
        ((2, 4, 5, 8), (1, 4, 6, 8), (1, 4, 6, 8), False),  # broadcast batch
        ((2, 4, 5, 8), (2, 1, 6, 8), (2, 1, 6, 8), False),  # broadcast heads
        ((2, 3, 4, 5, 8), (2, 1, 2, 6, 8), (2, 1, 2, 6, 8), True),  # GQA with a broadcast batch dim
    ],
)
def test_sdpa_shapes_and_broadcasting(shape_q, shape_k, shape_v, enable_gqa, path):
    q, k, v = random_qkv(shape_q, shape_k, shape_v, torch.float64, path.device)
    out = flashattn_ext.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
    assert out.shape == want.shape
    torch.testing.assert_close(out, want)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    want_grads = torch.autograd.grad(want, (q, k, v), torch.ones_like(want))
    for got, expected in zip(grads, want_grads):
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("enable_gqa", [False, True])
@on_paths("cpu", "cuda")
def test_four_dim_inputs_reach_the_op_as_they_are(enable_gqa, path):
    """(B, H, L, E) inputs, the usual call, go to the op without views of them: each would add an
    autograd node to every forward and backward (host time that small calls notice); the gradients
    still match SDPA's."""
    heads_kv = 2 if enable_gqa else 4
    q, k, v = random_qkv((2, 4, 5, 8), (2, heads_kv, 6, 8), (2, heads_kv, 6, 8), torch.float64, path.device)
    out = flashattn_ext.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
    assert "FlashAttentionFunction" in out.grad_fn.name()
    assert [type(fn).__name__ for fn, _ in out.grad_fn.next_functions[:3]] == ["AccumulateGrad"] * 3
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    want_grads = torch.autograd.grad(want, (q, k, v), torch.ones_like(want))
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected)


@on_paths("cpu", "cuda")
def test_explicit_scale_and_partial_requires_grad(path):
    q, k, v = make_inputs((1, 2, 2, 20, 30, 16, 16), torch.float64, path.device)
    k.requires_grad_(False)
    out = flashattn_ext.scaled_dot_product_attention(q, k, v, scale=0.7)
    want = F.scaled_dot_product_attention(q, k, v, scale=0.7)
    torch.testing.assert_close(out, want)
    dq, dv = torch.autograd.grad(out.square().sum(), (q, v))
    want_dq, want_dv = torch.autograd.grad(want.square().sum(), (q, v))
    torch.testing.assert_close(dq, want_dq)
    torch.testing.assert_close(dv, want_dv)


@on_paths("cpu", "cuda")
def test_swaps_into_a_model(path):
    """A module written for F.scaled_dot_product_attention runs unchanged on the shim."""
    device = path.device

    class SelfAttention(torch.nn.Module):
        def __init__(self, attention):
            super().__init__()
            torch.manual_seed(0)
            self.qkv = torch.nn.Linear(32, 96, dtype=torch.float64)
            self.attention = attention

        def forward(self, x):
            batch, length, _ = x.shape
            q, k, v = self.qkv(x).view(batch, length, 3, 4, 8).permute(2, 0, 3, 1, 4)
            return self.attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, length, 32)

    x = torch.randn(2, 17, 32, dtype=torch.float64, device=device)
    ours, theirs = SelfAttention(flashattn_ext.scaled_dot_product_attention).to(device), SelfAttention(
        F.scaled_dot_product_attention
    ).to(device)
    ours(x).square().sum().backward()
    theirs(x).square().sum().backward()
    torch.testing.assert_close(ours(x), theirs(x))
    torch.testing.assert_close(ours.qkv.weight.grad, theirs.qkv.weight.grad)
