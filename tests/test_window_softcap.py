"""Sliding-window attention, logit softcapping and ALiBi (attention_with_lse's window, softcap and
alibi_slopes): values, log-sum-exps and gradients against the naive attention in float64, within
twice the naive attention's own error in the inputs' dtype (plus a floor). Lengths above the CPU kernels' 128-row
tiles, so that whole tiles outside the window are skipped; on CUDA (an H100/H200) windows run the
Hopper kernels and softcap their forward (the sm90 tests at the end check those further), the rest the ATen
fallback, which the CPU runs too under FLASHATTN_EXT_KERNELS=aten."""
import math

import pytest
import torch
import torch.nn.functional as F

import flashattn_ext
from helpers import ERROR_FLOOR, POISON_BYTES, draw_rng_state, kernel_names
from helpers import math_with_dropout_mask, naive_attention, on_paths, poison_cuda_allocator, random_inputs
from helpers import deterministic_algorithms, dtype_name, on_paths_each, relative_error

DTYPES_BY_PATH = {"cpu": (torch.float64, torch.float32, torch.bfloat16), "cuda": (torch.float32, torch.bfloat16),
                  "deterministic": (torch.bfloat16,)}


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


@on_paths_each("dtype", DTYPES_BY_PATH, ids=dtype_name)
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
def test_matches_float64(options, len_q, len_k, path, dtype, implementation):
    with deterministic_algorithms(path.name == "deterministic"):
        check(path.device, dtype, len_q, len_k, options)


@on_paths_each("dtype", DTYPES_BY_PATH, ids=dtype_name)
def test_softcap_with_float_mask_and_its_gradient(path, dtype, implementation):
    """The mask adds to the capped scores; its gradient is that of the capped scores."""
    mask = torch.randn(1, 4, 140, 170, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    with deterministic_algorithms(path.name == "deterministic"):
        check(path.device, dtype, 140, 170, dict(softcap=1.5, window=(60, 20)), mask=mask)


@on_paths("cpu", "cuda")
def test_window_equals_sdpa_with_the_window_as_a_mask(path):
    device = path.device
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


@on_paths("cpu", "cuda")
def test_alibi_equals_sdpa_with_the_bias_as_a_float_mask(path):
    device = path.device
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


# The Hopper kernels' windows, softcap and ALiBi (path sm90): forward and backward in the kernels.
# (batch, heads_q, heads_kv, len_q, len_k, head_dim), attention_with_lse's window options
WINDOW_CASES = [
    ((2, 4, 2, 1000, 1000, 128), dict(window=(300, 0), is_causal=True)),  # Mistral's: whole tiles skipped on the left
    ((1, 4, 4, 700, 900, 128), dict(window=(200, 150))),  # two-sided, not causal
    ((1, 2, 1, 333, 1000, 64), dict(window=(None, 40), causal_lower_right=True)),  # right side only
    ((1, 2, 2, 1000, 333, 64), dict(window=(90, None), causal_lower_right=True)),  # left only; rows seeing no key
    ((2, 2, 2, 600, 600, 256), dict(window=(130, 0), is_causal=True)),  # head dim 256's 80-key tiles
    # Each query its own key alone: dq and dk exactly 0, as SDPA gives (a padded head dim).
    ((1, 2, 2, 300, 300, 112), dict(window=(0, 0))),
]


@on_paths("sm90")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape, options", WINDOW_CASES, ids=[str(o) for _, o in WINDOW_CASES])
def test_sliding_window(path, shape, options, dtype):
    """The Hopper kernels run a sliding window themselves (the forward's key tiles and the
    backward's query tiles from the window's first on, edges masked): out, lse and gradients within
    twice the naive attention's error in the same dtype, every output element written."""
    q, k, v = random_inputs(shape, dtype, seed=7)
    kwargs = dict(options, enable_gqa=shape[1] != shape[2])
    out = check_hopper_forward(q, k, v, **kwargs)
    check_hopper_gradients(q, k, v, out, **kwargs)


def forward_with(q, k, v, **kwargs):
    """attention_with_lse(**kwargs), its outputs allocated on poisoned memory."""
    poison_cuda_allocator(POISON_BYTES)
    return flashattn_ext.attention_with_lse(q, k, v, **kwargs)


def check_hopper_gradients(q, k, v, out, sm90=True, **kwargs):
    """attention_with_lse(**kwargs)'s gradients run the Hopper backward (where sm90; else not),
    each within twice the naive attention's error in the inputs' dtype, every element written
    (NaN poison). out: the call's, for the incoming gradient's shape."""
    dtype = q.dtype
    dout = torch.randn_like(out)

    def grads(fn, cast):
        leaves = [t.detach().to(cast).requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(fn(*leaves, **kwargs)[0], leaves, dout.to(cast))

    backward = lambda: grads(flashattn_ext.attention_with_lse, dtype)  # noqa: E731
    ran = any("sm90" in n and "attention_backward" in n for n in kernel_names(backward))
    assert ran == sm90, "the Hopper backward ran" if ran else "sm90 not run"
    poison_cuda_allocator(POISON_BYTES)
    got, want, base = backward(), grads(naive_attention, torch.float64), grads(naive_attention, dtype)
    for name, g, w, b in zip(("dq", "dk", "dv"), got, want, base):
        assert torch.isfinite(g).all(), f"{name}: an element was not written (NaN poison)"
        error, budget = relative_error(g, w), 2 * relative_error(b, w) + ERROR_FLOOR[dtype]
        assert error <= budget, f"{name}: {error:.3g} > {budget:.3g}"


def check_hopper_forward(q, k, v, **kwargs):
    """attention_with_lse(**kwargs) runs the Hopper forward, its out within twice the naive
    attention's error in the inputs' dtype, every element written, its lse to 1e-3 (-inf where
    no key is seen). Returns out."""
    call = lambda: forward_with(q, k, v, **kwargs)  # noqa: E731
    assert any("sm90" in n and "attention_forward_kernel" in n for n in kernel_names(call)), "sm90 not run"
    out, lse = call()
    want_out, want_lse = naive_attention(q.double(), k.double(), v.double(), **kwargs)
    baseline, _ = naive_attention(q, k, v, **kwargs)
    assert torch.isfinite(out).all(), "an output element was not written (NaN poison)"
    assert relative_error(out, want_out) <= 2 * relative_error(baseline, want_out) + ERROR_FLOOR[q.dtype]
    visible = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), visible)
    assert (lse[visible].double() - want_lse[visible]).abs().max().item() < 1e-3
    return out


# (batch, heads_q, heads_kv, len_q, len_k, head_dim), attention_with_lse's softcap options
SOFTCAP_CASES = [
    ((2, 4, 2, 700, 900, 128), dict(softcap=1.0)),  # scores of about 1: the cap bends them all
    ((1, 4, 4, 600, 600, 128), dict(softcap=30.0, scale=1.0, is_causal=True)),  # Gemma 2's cap, scores of about 11
    ((1, 4, 4, 600, 600, 64), dict(softcap=30.0, scale=1.0, is_causal=True)),
    # Head dim 64's 128-query tiles: the cap's derivative from the rounded P^T, where the cap bends hardest.
    ((2, 4, 2, 700, 900, 64), dict(softcap=1.0)),
    ((1, 2, 1, 500, 500, 256), dict(softcap=20.0, scale=0.25, window=(100, 0), is_causal=True)),  # with a window
]


@on_paths("sm90")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape, options", SOFTCAP_CASES, ids=[f"{s[-1]}-{o}" for s, o in SOFTCAP_CASES])
def test_softcap(path, shape, options, dtype):
    """The Hopper kernels cap the scores themselves (softcap * tanh(s / softcap) of the scaled
    scores), forward and backward (the cap's derivative from P^T: in float at head dims 97 to 128,
    rounded at 64 and 256): gradients within twice the naive attention's error."""
    q, k, v = random_inputs(shape, dtype, seed=9)
    kwargs = dict(options, enable_gqa=shape[1] != shape[2])
    out = check_hopper_forward(q, k, v, **kwargs)
    check_hopper_gradients(q, k, v, out, sm90=True, **kwargs)


# (batch, heads_q, heads_kv, len_q, len_k, head_dim), attention_with_lse's options; ALiBi's slopes
# are the paper's geometric ones for the heads (per batch element in the second case).
ALIBI_CASES = [
    ((2, 4, 2, 700, 900, 128), dict()),  # distances on both sides of the diagonal
    ((2, 4, 4, 600, 600, 64), dict(is_causal=True, causal_lower_right=True)),
    ((1, 2, 1, 500, 520, 256), dict(window=(100, 30))),
]


@on_paths("sm90")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape, options", ALIBI_CASES, ids=[f"{s[-1]}-{o}" for s, o in ALIBI_CASES])
def test_alibi(path, shape, options, dtype):
    """The Hopper kernels add ALiBi's bias themselves, forward and backward: out, lse and gradients
    within twice the naive attention's error in the same dtype."""
    q, k, v = random_inputs(shape, dtype, seed=10)
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / shape[1]) for h in range(shape[1])], device="cuda")
    if options.get("is_causal"):
        slopes = torch.stack([slopes, slopes.flip(0)])[: shape[0]]
    kwargs = dict(options, enable_gqa=shape[1] != shape[2], alibi_slopes=slopes)
    out = check_hopper_forward(q, k, v, **kwargs)
    check_hopper_gradients(q, k, v, out, **kwargs)


@on_paths("sm90")
def test_sliding_window_with_attn_mask_or_dropout(path):
    """The window with the kernels' other paths: a float mask's tiles (classified key blocks), and
    dropout, whose numbers depend on each tile's place (the first is the window's)."""
    shape = (1, 4, 4, 600, 704, 128)  # mask rows of whole 16-byte pieces, as the copy engine needs
    q, k, v = random_inputs(shape, torch.bfloat16, seed=8)
    mask = torch.randn(600, 704, device="cuda", dtype=torch.bfloat16)
    kwargs = dict(window=(200, 50))
    call = lambda: forward_with(q, k, v, attn_mask=mask, **kwargs)  # noqa: E731
    assert any("sm90" in n and "attention_forward_kernel" in n for n in kernel_names(call)), "sm90 not run"
    out, _ = call()
    want, _ = naive_attention(q.double(), k.double(), v.double(), attn_mask=mask.double(), **kwargs)
    assert relative_error(out, want) < 1e-2
    # Dropout: ours drops the pairs dropout_mask gives for the same seed (the backward draws them
    # again), checked against torch's math SDPA with that mask and the window as a bool mask.
    dropout_p = 0.2
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    call = lambda: flashattn_ext.attention_with_lse(*leaves, dropout_p=dropout_p, **kwargs)[0]  # noqa: E731
    assert any("sm90" in n and "attention_forward_kernel" in n for n in kernel_names(call)), "sm90 not run"
    dout = torch.randn_like(q)
    torch.manual_seed(1)
    out = call()
    got = (out.detach(), *torch.autograd.grad(out, leaves, dout))
    torch.manual_seed(1)
    keep = torch.ops.flashattn_ext.dropout_mask(draw_rng_state("cuda", dropout_p), dropout_p, 1, 4, 600, 704, 0, 600)
    rows, cols = torch.arange(600, device="cuda")[:, None], torch.arange(704, device="cuda")[None, :]
    window = (cols >= rows - 200) & (cols <= rows + 50)
    wants = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want_out = math_with_dropout_mask(*wants, keep, dropout_p, attn_mask=window)
    want = (want_out.detach(), *torch.autograd.grad(want_out, wants, dout.double()))
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert relative_error(g, w) < 2e-2, name
