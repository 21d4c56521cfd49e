"""flashattn_ext as torch's flash-attention implementation (flashattn_ext/torch_flash.py): registered on
import, activated and restored through torch.nn.attention, and, while active, what torch's SDPA flash
backend, torch.compile and torch's varlen_attn run, checked against a float64 reference."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import (SDPBackend, activate_flash_attention_impl, current_flash_attention_impl,
                                list_flash_attention_impls, restore_flash_attention_impl, sdpa_kernel)

import flashattn_ext
from helpers import cuda_test, forward_and_grads, kernel_names, naive_attention, relative_error

# Errors of bf16 results against float64, relative to the largest reference value (well above
# bf16's rounding of out and the gradients, far below what a wrong mask or scale gives).
TOLERANCE = 2e-2


@pytest.fixture
def active():
    """flashattn_ext activated as torch's flash-attention implementation for the test, then restored."""
    activate_flash_attention_impl("flashattn_ext")
    yield
    restore_flash_attention_impl()


def ours_ran(names):
    return any("flashattn_ext" in name for name in names)


def test_registered_on_import_and_activates_and_restores():
    assert "flashattn_ext" in list_flash_attention_impls()
    flashattn_ext.register_with_torch()  # again: harmless
    activate_flash_attention_impl("flashattn_ext")
    try:
        assert current_flash_attention_impl() == "flashattn_ext"
    finally:
        restore_flash_attention_impl()
    assert current_flash_attention_impl() is None


def inputs(batch=2, heads_q=4, heads_kv=4, len_q=256, len_k=256, dim=64, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, heads_q, len_q, dim, device="cuda", generator=gen).bfloat16()
    k = torch.randn(batch, heads_kv, len_k, dim, device="cuda", generator=gen).bfloat16()
    v = torch.randn(batch, heads_kv, len_k, dim, device="cuda", generator=gen).bfloat16()
    dout = torch.randn(batch, heads_q, len_q, dim, device="cuda", generator=gen).bfloat16()
    return q, k, v, dout


def assert_matches_float64(got, q, k, v, dout, **options):
    want = forward_and_grads(lambda *t: naive_attention(*t, **options)[0], (q.double(), k.double(), v.double()),
                             dout.double())
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert relative_error(g, w) < TOLERANCE, (name, relative_error(g, w))


@cuda_test
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("heads_kv", [4, 2])
def test_sdpa_flash_backend_runs_ours(active, is_causal, heads_kv):
    q, k, v, dout = inputs(heads_kv=heads_kv)
    gqa = heads_kv != q.size(1)

    def sdpa(*t):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(*t, is_causal=is_causal, enable_gqa=gqa)

    assert ours_ran(kernel_names(lambda: forward_and_grads(sdpa, (q, k, v), dout)))
    assert_matches_float64(forward_and_grads(sdpa, (q, k, v), dout), q, k, v, dout, is_causal=is_causal, enable_gqa=gqa)


@cuda_test
def test_restore_gives_torchs_kernels_back():
    q, k, v, dout = inputs()

    def sdpa(*t):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(*t)

    activate_flash_attention_impl("flashattn_ext")
    try:
        assert ours_ran(kernel_names(lambda: forward_and_grads(sdpa, (q, k, v), dout)))
    finally:
        restore_flash_attention_impl()
    assert not ours_ran(kernel_names(lambda: forward_and_grads(sdpa, (q, k, v), dout)))


@cuda_test
def test_dropout_matches_our_own_call(active):
    """The backward draws what its forward drew (the random state through aten's rng_state outputs):
    the same result and gradients as flashattn_ext's own SDPA on the same generator state."""
    q, k, v, dout = inputs()

    def torch_sdpa(*t):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(*t, dropout_p=0.2, is_causal=True)

    torch.manual_seed(1)
    got = forward_and_grads(torch_sdpa, (q, k, v), dout)
    torch.manual_seed(1)
    want = forward_and_grads(lambda *t: flashattn_ext.scaled_dot_product_attention(*t, dropout_p=0.2, is_causal=True),
                             (q, k, v), dout)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@cuda_test
def test_torch_compile_runs_ours(active):
    q, k, v, dout = inputs(len_q=128, len_k=384)

    @torch.compile(fullgraph=True)
    def compiled(*t):
        return F.scaled_dot_product_attention(*t, scale=0.3)

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        got = forward_and_grads(compiled, (q, k, v), dout)
        assert ours_ran(kernel_names(lambda: forward_and_grads(compiled, (q, k, v), dout)))
    assert_matches_float64(got, q, k, v, dout, scale=0.3)


@cuda_test
@pytest.mark.parametrize("window", [(-1, -1), (32, 0), (16, 8)])
def test_varlen_attn_runs_ours(active, window):
    """torch.nn.attention.varlen.varlen_attn (aten's _flash_attention_forward on a packed batch)."""
    from torch.nn.attention.varlen import varlen_attn

    lengths = [100, 1, 257]
    cu_seq = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device="cuda", dtype=torch.int32)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(sum(lengths), 4, 64, device="cuda", generator=gen).bfloat16() for _ in range(4))

    def call(*t):
        return varlen_attn(*t, cu_seq, cu_seq, max(lengths), max(lengths), window_size=window)

    got = forward_and_grads(call, (q, k, v), dout)
    assert ours_ran(kernel_names(lambda: call(q, k, v)))
    left, right = window
    for b, (start, end) in enumerate(zip(cu_seq[:-1].tolist(), cu_seq[1:].tolist())):
        rows = [t[start:end].transpose(0, 1) for t in (q, k, v, dout)]  # (heads, length, dim)
        sequence = [t[start:end].transpose(0, 1) for t in got]
        assert_matches_float64(sequence, *rows, causal_lower_right=True,
                               window=(None if left < 0 else left, None if right < 0 else right))


def test_the_aten_kernels_keep_atens_contract():
    """The kernels that activation registers, called directly (they take any device's tensors; on the
    CPU here): aten's layouts (BSHD, packed), bottom-right windows, and dropout's random state handed
    from forward to backward through aten's (rng_state, unused) outputs."""
    from flashattn_ext import torch_flash

    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 48, heads, 32, generator=gen) for heads in (4, 2, 2, 4))  # BSHD, GQA 4:2
    out, lse, rng_state, unused, _ = torch_flash._flash_forward(q, k, v, None, None, 48, 48, 0.0, True, False,
                                                                 window_size_left=8)
    assert lse.shape == (2, 4, 48) and rng_state.shape == (2,) and rng_state.dtype == torch.uint64
    grads = torch_flash._flash_backward(dout, q, k, v, out, lse, None, None, 48, 48, 0.0, True, rng_state, unused,
                                        window_size_left=8)
    heads_first = [t.transpose(1, 2) for t in (q, k, v, dout)]
    assert_matches_float64([t.transpose(1, 2) for t in (out, *grads)], *heads_first, is_causal=True,
                           enable_gqa=True, window=(8, None), causal_lower_right=True)

    # Dropout: the SDPA-level pair against flashattn_ext's own call on the same generator state.
    q, k, v, dout = heads_first
    torch.manual_seed(3)
    out, lse, _, _, max_q, max_k, seed, offset, _ = torch_flash._sdpa_flash_forward(q, k, v, 0.3, False)
    grads = torch_flash._sdpa_flash_backward(dout, q, k, v, out, lse, None, None, max_q, max_k, 0.3, False, seed,
                                             offset)
    torch.manual_seed(3)
    want = forward_and_grads(lambda *t: flashattn_ext.scaled_dot_product_attention(*t, dropout_p=0.3, enable_gqa=True),
                             (q, k, v), dout)
    for got, expected in zip((out, *grads), want):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # return_debug_mask: the sign of each score's entry says whether the forward kept it (torch's tests
    # read it so); the output equals float64 attention with those scores dropped.
    torch.manual_seed(3)
    out, *_, debug_mask = torch_flash._sdpa_flash_forward(q, k, v, 0.3, False, True)
    assert debug_mask.shape == (2, 4, 48, 48) and set(debug_mask.unique().tolist()) == {-1.0, 1.0}
    probs = torch.softmax(q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) / 32 ** 0.5, -1)
    want = (probs * (debug_mask > 0) / 0.7) @ v.double().repeat_interleave(2, 1)
    assert relative_error(out, want) < 1e-5

    # A packed batch: (total, heads, dim), lse (heads, total).
    cu_seq = torch.tensor([0, 5, 6, 30], dtype=torch.int32)
    q, k, v, dout = (torch.randn(30, 2, 16, generator=gen) for _ in range(4))
    out, lse, *_ = torch_flash._flash_forward(q, k, v, cu_seq, cu_seq, 24, 24, 0.0, True, False)
    assert lse.shape == (2, 30)
    grads = torch_flash._flash_backward(dout, q, k, v, out, lse, cu_seq, cu_seq, 24, 24, 0.0, True, None, None)
    for start, end in zip(cu_seq[:-1].tolist(), cu_seq[1:].tolist()):
        sequence = [t[start:end].transpose(0, 1) for t in (out, *grads)]
        assert_matches_float64(sequence, *(t[start:end].transpose(0, 1) for t in (q, k, v, dout)), is_causal=True)
