"""Sliding-window attention, logit softcapping and ALiBi (attention_with_lse's window, softcap and
alibi_slopes): values, log-sum-exps and gradients against the naive attention in float64, within
twice the naive attention's own error in the inputs' dtype (plus a floor). Lengths above the CPU kernels' 128-row
tiles, so that whole tiles outside the window are skipped; on CUDA (an H100/H200) windows run the
Hopper kernels and softcap their forward (test_hopper checks those further), the rest the ATen
fallback, which the CPU runs too under FLASHATTN_EXT_KERNELS=aten."""
import math

import pytest
import torch
import torch.nn.functional as F

import flashattn_ext
from helpers import DEVICES, ERROR_FLOOR, device_dtype_params, naive_attention, relative_error

DEVICE_DTYPES = device_dtype_params({"cpu": (torch.float64, torch.float32, torch.bfloat16),
                                     "cuda": (torch.float32, torch.bfloat16)})


def check(device, dtype, len_q, len_k, options, heads=(4, 2), dim=32, mask=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    heads_q, heads_kv = heads
    # Scores of a few units (scale 0.5 on unit-variance dot products of 32 terms), so that a softcap
    # of 2 bends them well away from the identity.
    q = torch.randn(2, heads_q, len_q, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(2, heads_kv, len_k, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(2, heads_kv, len_k, dim, generator=gen, dtype=torch.float64)
    dout = torch.randn(2, heads_q, len_q, dim, generator=gen, dtype=torch.float64)
    options = dict(options, scale=0.5, enable_gqa=heads_q != heads_kv)
    mask_grad = mask is not None and mask.dtype != torch.bool

    def run(fn, cast):
        leaves = [t.to(device=device, dtype=cast).requires_grad_() for t in (q, k, v)]
        m = None
        if mask is not None:
            m = mask.to(device=device, dtype=torch.bool if mask.dtype == torch.bool else cast)
            m.requires_grad_(mask_grad)
        kwargs = dict(options)
        if "alibi_slopes" in kwargs:  # float32 for ours; the naive attention's in its own dtype
            slopes = kwargs["alibi_slopes"]
            kwargs["alibi_slopes"] = slopes.to(device, slopes.dtype if fn is flashattn_ext.attention_with_lse else cast)
        out, lse = fn(*leaves, attn_mask=m, **kwargs)
        wrt = leaves + ([m] if mask_grad else [])
        grads = torch.autograd.grad(out, wrt, dout.to(device=device, dtype=cast))
        return [out.detach(), lse.detach(), *grads]

    def naive(q_, k_, v_, attn_mask=None, **kw):
        return naive_attention(q_, k_, v_, attn_mask=attn_mask, **kw)

    got = run(flashattn_ext.attention_with_lse, dtype)
    want = run(naive, torch.float64)
    baseline = run(naive, dtype) if dtype != torch.float64 else None
    names = ("out", "lse", "dq", "dk", "dv", "dmask")
    for name, g, w, b in zip(names, got, want, baseline or want):
        if name == "lse":  # rows that see no key: -inf in both
            seen = torch.isfinite(w)
            assert torch.equal(torch.isfinite(g).cpu(), seen.cpu()), "lse: rows that see no key"
            g, w, b = g[seen], w[seen], b[seen]
        error = relative_error(g.cpu(), w.cpu())
        if dtype == torch.float64:
            assert error <= 1e-12, f"{name}: {error:.3g}"
        else:
            budget = 2 * relative_error(b.cpu(), w.cpu()) + ERROR_FLOOR[dtype]
            assert error <= budget, f"{name}: {error:.3g} > {budget:.3g}"


# ALiBi's geometric slopes for 4 heads (2^-2 .. 2^-8, as in the paper), and one set a batch element;
# float32, as the ops take them. Against scores of a few units they fade keys some tens away.
ALIBI_SLOPES = torch.tensor([2.0 ** (-2 * (h + 1)) for h in range(4)])
ALIBI_SLOPES_PER_BATCH = torch.stack([ALIBI_SLOPES, ALIBI_SLOPES.flip(0) * 0.5])


@pytest.fixture(params=["kernels", "aten"])
def implementation(request, monkeypatch):
    """The device's kernels, or the ATen fallback (read at each call)."""
    if request.param == "aten":
        monkeypatch.setenv("FLASHATTN_EXT_KERNELS", "aten")
    return request.param


@pytest.mark.parametrize("device, dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("len_q, len_k", [(300, 300), (150, 420), (420, 150)])
@pytest.mark.parametrize(
    "options",
    [
        dict(window=(40, 0), is_causal=True),  # Mistral's: 41 keys back, none ahead
        dict(window=(40, 7)),  # both sides
        dict(window=(None, 25), causal_lower_right=True),  # right side only, bottom-right diagonal
        dict(window=(130, None), causal_lower_right=True),  # left side only
        dict(softcap=2.0),
        dict(softcap=2.0, window=(33, 0), is_causal=True, causal_lower_right=True),  # Gemma 2's local layers
        dict(alibi_slopes=ALIBI_SLOPES),  # distances on both sides of the diagonal
        dict(alibi_slopes=ALIBI_SLOPES, is_causal=True, causal_lower_right=True),
        dict(alibi_slopes=ALIBI_SLOPES_PER_BATCH, is_causal=True),
        dict(alibi_slopes=ALIBI_SLOPES, softcap=2.0, window=(100, 30)),
    ],
    ids=["causal_window", "two_sided", "right_only", "left_only", "softcap", "softcap_causal_window", "alibi",
         "alibi_causal_lower_right", "alibi_per_batch_causal", "alibi_softcap_window"],
)
def test_matches_float64(options, len_q, len_k, device, dtype, implementation):
    check(device, dtype, len_q, len_k, options)


@pytest.mark.parametrize("device, dtype", DEVICE_DTYPES)
def test_softcap_with_float_mask_and_its_gradient(device, dtype, implementation):
    """The mask adds to the capped scores; its gradient is that of the capped scores."""
    mask = torch.randn(1, 4, 140, 170, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    check(device, dtype, 140, 170, dict(softcap=1.5, window=(60, 20)), mask=mask)


@pytest.mark.parametrize("device", DEVICES)
def test_window_equals_sdpa_with_the_window_as_a_mask(device):
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 200, 16, generator=gen).to(device) for _ in range(3))
    rows, cols = torch.arange(200)[:, None], torch.arange(200)[None, :]
    mask = ((cols <= rows) & (cols >= rows - 50)).to(device)
    out, _ = flashattn_ext.attention_with_lse(q, k, v, is_causal=True, window=(50, None))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(window=(-1, 0)), "window's left bound must be an int >= 0 or None"),
        (dict(window=(3, 2.5)), "window's right bound must be an int >= 0 or None"),
        (dict(window=4), "window must be a pair"),
        (dict(softcap=0.0), "softcap must be a finite number > 0"),
        (dict(softcap=math.inf), "softcap must be a finite number > 0"),
    ],
)
def test_bad_window_and_softcap(kwargs, message):
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match=None) as info:
        flashattn_ext.attention_with_lse(q, q, q, **kwargs)
    assert message in str(info.value)


def test_ops_check_their_window_and_softcap():
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="window bounds must be >= 0, or -1"):
        torch.ops.flashattn_ext.attention_forward(q, q, q, None, 0.0, False, False, 0.25, -2, -1, 0.0)
    with pytest.raises(ValueError, match="softcap must be finite and >= 0"):
        torch.ops.flashattn_ext.attention_forward(q, q, q, None, 0.0, False, False, 0.25, -1, -1, -1.0)


def test_double_backward_with_window_and_softcap():
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 9, 4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))

    def fn(q_, k_, v_):
        return flashattn_ext.attention_with_lse(q_, k_, v_, is_causal=True, window=(3, None), softcap=1.5)[0]

    assert torch.autograd.gradgradcheck(fn, (q, k, v))


@pytest.mark.parametrize("device", DEVICES)
def test_alibi_equals_sdpa_with_the_bias_as_a_float_mask(device):
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 3, 150, 16, generator=gen).to(device) for _ in range(3))
    slopes = torch.tensor([0.5, 0.125, 0.03125], device=device)
    rows, cols = torch.arange(150, device=device)[:, None], torch.arange(150, device=device)[None, :]
    bias = -slopes[:, None, None] * (rows - cols).abs()
    out, _ = flashattn_ext.attention_with_lse(q, k, v, alibi_slopes=slopes)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=bias.expand(2, 3, 150, 150)))


def test_alibi_slopes_are_checked():
    q = torch.randn(2, 4, 8, 16)
    with pytest.raises(RuntimeError, match=r"alibi_slopes must have shape \(4,\) or \(2, 4\)"):
        flashattn_ext.attention_with_lse(q, q, q, alibi_slopes=torch.ones(3))
    with pytest.raises(TypeError, match="alibi_slopes must be float32"):
        flashattn_ext.attention_with_lse(q, q, q, alibi_slopes=torch.ones(4, dtype=torch.float64))
    with pytest.raises(TypeError, match="alibi_slopes must be a torch.Tensor"):
        flashattn_ext.attention_with_lse(q, q, q, alibi_slopes=[1.0] * 4)
    with pytest.raises(RuntimeError, match=r"alibi_slopes must have shape \(batch, query heads\)"):
        torch.ops.flashattn_ext.attention_forward(q, q, q, None, 0.0, False, False, 0.25, -1, -1, 0.0, torch.ones(4))


def test_alibi_slopes_get_no_gradient_and_double_backward_works():
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 9, 4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    slopes = torch.tensor([0.3, 0.05], requires_grad=True)
    out, _ = flashattn_ext.attention_with_lse(q, k, v, is_causal=True, alibi_slopes=slopes)
    assert torch.autograd.grad(out.sum(), slopes, allow_unused=True)[0] is None

    def fn(q_, k_, v_):
        return flashattn_ext.attention_with_lse(q_, k_, v_, alibi_slopes=slopes.detach(), softcap=1.5)[0]

    assert torch.autograd.gradgradcheck(fn, (q, k, v))
