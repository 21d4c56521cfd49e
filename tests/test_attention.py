"""Values and gradients of flashattn_ext against a naive float64 reference and torch SDPA.

Each test runs on CPU, and on CUDA where a GPU is present."""
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention import bias as sdpa_bias

import flashattn_ext
from helpers import (
    DEVICES,
    ERROR_FLOOR,
    cuda_test,
    naive_attention,
    random_qkv,
    relative_error,
    seq_major_qkv,
)

# (batch, heads_q, heads_kv, len_q, len_k, head_dim, head_dim_v): ragged lengths,
# len_q != len_k, head dims that are not powers of two, GQA and MQA.
SHAPES = [
    (1, 2, 2, 1, 1, 16, 16),
    (2, 3, 3, 7, 7, 8, 8),
    (1, 2, 2, 63, 65, 24, 24),
    (1, 4, 2, 65, 63, 40, 40),
    (2, 2, 1, 7, 1000, 64, 64),
    (1, 2, 2, 1000, 1000, 64, 64),
    (1, 3, 1, 1000, 65, 72, 72),
    (1, 1, 1, 63, 1, 3, 5),
]
SHAPE_IDS = ["x".join(map(str, shape)) for shape in SHAPES]



def make_inputs(shape, dtype, device, seed=0):
    batch, heads_q, heads_kv, len_q, len_k, head_dim, head_dim_v = shape
    return random_qkv(
        (batch, heads_q, len_q, head_dim),
        (batch, heads_kv, len_k, head_dim),
        (batch, heads_kv, len_k, head_dim_v),
        dtype,
        device,
        seed,
    )


def random_grad_out(shape, device, seed=0):
    """A seeded random upstream gradient for the output of a SHAPES problem."""
    batch, heads_q, _, len_q, _, _, head_dim_v = shape
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads_q, len_q, head_dim_v, generator=gen, dtype=torch.float64).to(device)


def assert_within_twice_sdpa(got, baseline, want, dtype, names=("out", "dq", "dk", "dv")):
    """Each of got (ours: in dtype, finite) within twice baseline's error (torch SDPA's, in dtype) against want
    (float64), plus ERROR_FLOOR, errors measured against the problem's scale."""
    problem_scale = max(w.abs().max().item() for w in want)
    for name, g, b, w in zip(names, got, baseline, want):
        assert g.dtype == dtype and torch.isfinite(g).all(), name
        ours_error = relative_error(g, w, zero_scale=problem_scale)
        sdpa_error = relative_error(b, w, zero_scale=problem_scale)
        assert ours_error <= 2 * sdpa_error + ERROR_FLOOR[dtype], (
            f"{name}: error {ours_error:.3g} vs torch SDPA's {sdpa_error:.3g}"
        )


def forward_and_grads(fn, inputs, grad_out):
    """Runs fn on fresh leaf copies of inputs; returns (out, dq, dk, dv)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out.to(out.dtype))
    return (out.detach(), *(t.grad for t in leaves))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["full", "causal", "causal_lower_right"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_float64_matches_naive_reference(shape, mode, device):
    """In float64 the kernel must agree with the naive formula to rounding."""
    inputs = make_inputs(shape, torch.float64, device)
    is_causal, lower_right = mode != "full", mode == "causal_lower_right"
    gqa = shape[1] != shape[2]

    def ours(q, k, v):
        out, _ = flashattn_ext.attention_with_lse(
            q, k, v, is_causal=is_causal, causal_lower_right=lower_right, enable_gqa=gqa
        )
        return out

    def reference(q, k, v):
        return naive_attention(q, k, v, is_causal, lower_right, enable_gqa=gqa)[0]

    grad_out = random_grad_out(shape, device)
    got, want = forward_and_grads(ours, inputs, grad_out), forward_and_grads(reference, inputs, grad_out)
    # Where every row sees one key, dq is exactly 0: measured against the problem's scale.
    problem_scale = max(w.abs().max().item() for w in want)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(g).all(), name
        assert relative_error(g, w, zero_scale=problem_scale) < 1e-12, name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_low_precision_error_within_twice_sdpa(shape, is_causal, dtype, device):
    """Error against a float64 reference: at most twice torch SDPA's own error in the same dtype, plus a floor."""
    inputs = make_inputs(shape, dtype, device)
    gqa = shape[1] != shape[2]
    grad_out = random_grad_out(shape, device)

    def ours(q, k, v):
        return flashattn_ext.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=gqa)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=gqa)

    inputs64 = [t.detach().double() for t in inputs]
    want = forward_and_grads(sdpa, inputs64, grad_out)
    got = forward_and_grads(ours, inputs, grad_out)
    baseline = forward_and_grads(sdpa, inputs, grad_out)
    assert_within_twice_sdpa(got, baseline, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("threads", [1, 3, 8])
@pytest.mark.parametrize("shape", [(1, 2, 1, 300, 300, 64, 64), (2, 4, 2, 200, 330, 48, 48)], ids=["mqa", "gqa"])
def test_cpu_any_thread_count(shape, threads, dtype):
    """The CPU forward splits its work by the thread count: with fewer key/value heads than threads, the
    threads share each head's key and value tiles, loaded in a pass of their own (here at 8 threads, and
    for MQA at 3). Every split: within twice torch SDPA's error against float64, causal and with GQA."""
    inputs = make_inputs(shape, dtype, "cpu")
    grad_out = random_grad_out(shape, "cpu")

    def run(fn, inputs):
        return forward_and_grads(lambda q, k, v: fn(q, k, v, is_causal=True, enable_gqa=True), inputs, grad_out)

    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = run(flashattn_ext.scaled_dot_product_attention, inputs)
    finally:
        torch.set_num_threads(saved_threads)
    want = run(F.scaled_dot_product_attention, [t.detach().double() for t in inputs])
    baseline = run(F.scaled_dot_product_attention, inputs)
    assert_within_twice_sdpa(got, baseline, want, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [-0.3, 0.0, 2.0], ids=["negative", "zero", "large"])
def test_any_scale_error_within_twice_sdpa(scale, device):
    """The forward's fast path folds a positive scale into the row max; zero and negative scales take
    the general path. With whole key tiles (200 keys) both paths run; each must give SDPA's answer."""
    dtype = torch.bfloat16
    shape = (2, 4, 2, 130, 200, 64, 64)
    inputs = make_inputs(shape, dtype, device)
    grad_out = random_grad_out(shape, device)

    def ours(q, k, v):
        return flashattn_ext.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

    want = forward_and_grads(sdpa, [t.detach().double() for t in inputs], grad_out)
    got = forward_and_grads(ours, inputs, grad_out)
    # The baseline error comes from SDPA's math backend: on an H100, torch's default CUDA backend
    # returned NaN here (2026-11-21), as a kernel would that assumes a positive scale.
    with sdpa_kernel(SDPBackend.MATH):
        baseline = forward_and_grads(sdpa, inputs, grad_out)
    assert_within_twice_sdpa(got, baseline, want, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["full", "causal", "causal_lower_right"])
def test_lse_is_logsumexp_of_scaled_scores(mode, device):
    q, k, v = make_inputs((2, 4, 2, 65, 130, 32, 32), torch.float32 if device == "cpu" else torch.bfloat16, device)
    is_causal, lower_right = mode != "full", mode == "causal_lower_right"
    _, lse = flashattn_ext.attention_with_lse(
        q, k, v, is_causal=is_causal, causal_lower_right=lower_right, scale=0.3, enable_gqa=True
    )
    _, want = naive_attention(q.double(), k.double(), v.double(), is_causal, lower_right, 0.3, enable_gqa=True)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 65)
    torch.testing.assert_close(lse.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_matches_torch_sdpa_lower_right_causal_bias(device):
    """Bottom-right alignment means what torch's causal_lower_right bias means."""
    q, k, v = make_inputs((1, 2, 2, 40, 100, 16, 16), torch.float64, device)
    ours, _ = flashattn_ext.attention_with_lse(q, k, v, is_causal=True, causal_lower_right=True)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_bias.causal_lower_right(40, 100))
    torch.testing.assert_close(ours, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_that_see_no_key_give_zero_and_finite_gradients(device):
    """Bottom-right causal with len_q > len_k: the first len_q - len_k rows see no key."""
    q, k, v = make_inputs((1, 2, 2, 9, 4, 8, 8), torch.float64, device)
    out, lse = flashattn_ext.attention_with_lse(q, k, v, is_causal=True, causal_lower_right=True)
    assert (out[:, :, :5] == 0).all() and torch.isneginf(lse[:, :, :5]).all()
    want, want_lse = naive_attention(q, k, v, is_causal=True, causal_lower_right=True)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse[:, :, 5:], want_lse[:, :, 5:])
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[:, :, :5] == 0).all()


# (len_q, len_k, causal alignment, head dim): query 0 of a causal call sees key 0 alone; bottom-right
# with more queries than keys, query len_q - len_k does; with one key, every query does (and every
# query of a long causal call but the first sees more).
ONE_KEY_CASES = [(1, 9, "top_left", 40), (300, 300, "top_left", 128), (70, 20, "bottom_right", 64),
                 (33, 1, None, 128), (200, 1, "top_left", 64)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", ONE_KEY_CASES, ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}-d{c[3]}")
@pytest.mark.parametrize("kernels", ["default", "sm80", "deterministic"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_row_that_sees_one_key_gets_exact_zero_gradients(device, kernels, case, dtype, monkeypatch):
    """A query row that sees one key has probability 1 there: its dq is 0 and it adds 0 to dk,
    exactly, as SDPA gives, in every backward (the CPU's delta summed from P and dP; the CUDA
    kernels' from the rounded output, zeroed for these rows), and its output is that key's value."""
    if kernels != "default" and device == "cpu":
        pytest.skip("the CUDA kernel families")
    if kernels == "sm80":
        monkeypatch.setenv("FLASHATTN_EXT_KERNELS", "sm80")
    len_q, len_k, causal, dim = case
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, n, dim, generator=gen, dtype=torch.float64).to(dtype).to(device).requires_grad_()
               for n in (len_q, len_k, len_k))
    dout = torch.randn(2, 3, len_q, dim, generator=gen, dtype=torch.float64).to(dtype).to(device)
    first = len_q - len_k if causal == "bottom_right" else 0  # the first row that sees key 0 alone
    alone = slice(None) if len_k == 1 else slice(first, first + 1)  # the rows that do
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(kernels == "deterministic")
    try:
        out, _ = flashattn_ext.attention_with_lse(q, k, v, is_causal=causal is not None,
                                                  causal_lower_right=causal == "bottom_right")
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert (dq[:, :, alone] == 0).all()
    if len_k == 1 or len_q == 1:  # every row that sees key 0 sees it alone
        assert (dk == 0).all()
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all()
    assert torch.equal(out[:, :, alone], v[:, :, :1].expand_as(out[:, :, alone]))


def one_key_mask(kind, batch, len_q, len_k, dtype, gen):
    """An attn_mask that leaves some query rows exactly one key, and (bool) which rows those are.

    "bool": (batch, 1, len_q, len_k), every third row sees one key drawn at random, the others about
    half the keys, none of keys 250 on, which only rows that see one key see. "additive": the same
    pattern (L, S) for every batch, 0 or a random value where visible, -inf elsewhere. "key_padding":
    (batch, 1, 1, len_k), batch 0 sees key 137 alone (all its rows see one key), batch 1 half the keys."""
    if kind == "key_padding":
        visible = torch.rand(batch, 1, 1, len_k, generator=gen) < 0.5
        visible[0] = False
        visible[0, ..., 137] = True
        lone = torch.zeros(batch, 1, len_q, 1, dtype=torch.bool)
        lone[0] = True
        return visible, lone
    mask_batch = batch if kind == "bool" else 1
    visible = torch.rand(mask_batch, 1, len_q, len_k, generator=gen) < 0.5
    visible[..., 250:] = False
    lone = torch.zeros(mask_batch, 1, len_q, 1, dtype=torch.bool)
    lone[..., ::3, :] = True
    keys = torch.randint(len_k, (mask_batch, 1, len_q, 1), generator=gen)
    visible = torch.where(lone, torch.arange(len_k) == keys, visible)
    if kind == "bool":
        return visible, lone
    values = torch.randn(visible.shape, generator=gen, dtype=torch.float64)
    values = values * (torch.rand(visible.shape, generator=gen) < 0.5)  # half of them 0
    return torch.where(visible, values, -math.inf).to(dtype)[0, 0], lone.expand(batch, -1, -1, -1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["bool", "additive", "key_padding"])
@pytest.mark.parametrize("kernels", ["default", "sm80", "deterministic"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_row_that_a_mask_leaves_one_key_gets_exact_zero_gradients(device, kernels, kind, dtype, monkeypatch):
    """As above where an attn_mask leaves a row one key, any key (the CUDA kernels know these rows from
    a pass over the mask): its dq is exactly 0, and a key that only such rows see gets dk exactly 0;
    the rest matches the float64 reference. Head dim 128 with 16-bit inputs: the Hopper kernels'
    masked backward, where the GPU has them."""
    if kernels != "default" and device == "cpu":
        pytest.skip("the CUDA kernel families")
    if kernels == "sm80":
        monkeypatch.setenv("FLASHATTN_EXT_KERNELS", "sm80")
    batch, heads_q, heads_kv, len_q, len_k, dim = 2, 4, 2, 200, 300, 128
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(batch, heads, n, dim, generator=gen, dtype=torch.float64)
               for heads, n in ((heads_q, len_q), (heads_kv, len_k), (heads_kv, len_k)))
    dout = torch.randn(batch, heads_q, len_q, dim, generator=gen, dtype=torch.float64)
    mask, lone = one_key_mask(kind, batch, len_q, len_k, dtype, gen)
    leaves = [t.to(dtype).to(device).requires_grad_() for t in (q, k, v)]
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(kernels == "deterministic")
    try:
        out = flashattn_ext.scaled_dot_product_attention(*leaves, attn_mask=mask.to(device), enable_gqa=True)
        dq, dk, dv = torch.autograd.grad(out, leaves, dout.to(dtype).to(device))
    finally:
        torch.use_deterministic_algorithms(deterministic)
    lone = lone.to(device).expand(batch, heads_q, len_q, dim)
    assert (dq[lone] == 0).all()
    if kind == "key_padding":
        assert (dk[0] == 0).all()
    else:
        assert (dk[..., 250:, :] == 0).all()
    # The rest against the float64 reference (the CPU's error bar: these are small sums).
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    want_out, _ = naive_attention(*exact, attn_mask=mask.double() if mask.is_floating_point() else mask,
                                  enable_gqa=True)
    want = torch.autograd.grad(want_out, exact, dout)
    tolerance = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}[dtype]
    for name, got, expected in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), (want_out, *want)):
        assert torch.isfinite(got).all(), name
        assert relative_error(got.cpu(), expected.detach()) < tolerance, name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("len_q,len_k,batch", [(5, 0, 2), (0, 7, 2), (5, 7, 0)])
def test_empty_dimensions_match_sdpa(len_q, len_k, batch, device):
    q, k, v = make_inputs((batch, 2, 2, len_q, len_k, 8, 8), torch.float32 if device == "cpu" else torch.bfloat16, device)
    out = flashattn_ext.scaled_dot_product_attention(q, k, v)
    # torch's SDPA on CUDA returns None for batch 0, so the expectation comes from the CPU.
    want = F.scaled_dot_product_attention(*(t.detach().cpu().double() for t in (q, k, v)))
    assert out.shape == want.shape
    torch.testing.assert_close(out.cpu().double(), want)
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and (t.grad == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_zero_heads(dtype, device):
    """No heads at all, through the kernels (bfloat16 on CUDA) and the ATen fallback (float32 on
    CUDA, whose query-head grouping divided 0 by 0 before)."""
    q = torch.randn(2, 0, 5, 8, dtype=dtype, device=device, requires_grad=True)
    out = flashattn_ext.scaled_dot_product_attention(q, q, q, dropout_p=0.2)
    assert out.shape == (2, 0, 5, 8)
    out.sum().backward()
    assert q.grad.shape == q.shape


@pytest.mark.parametrize("device", DEVICES)
def test_inputs_at_odd_storage_offsets(device):
    """q, k, v and grad_out that start 2 bytes into their storage, so no row is 16-byte aligned: the CUDA
    glue copies them to aligned rows first. Results match those of aligned copies of the same values."""
    shape = (2, 3, 70, 64)

    def at_odd_offset(seed):
        values = torch.randn(1 + math.prod(shape), generator=torch.Generator().manual_seed(seed))
        return values.to(device=device, dtype=torch.bfloat16)[1:].view(shape)

    q, k, v, grad_out = (at_odd_offset(seed) for seed in range(4))
    results = []
    for inputs, upstream in (((q, k, v), grad_out), ([t.clone() for t in (q, k, v)], grad_out.clone())):
        assert all((t.data_ptr() % 16 == 0) == (upstream is not grad_out) for t in (*inputs, upstream))
        inputs = [t.requires_grad_() for t in inputs]
        out = flashattn_ext.scaled_dot_product_attention(*inputs, is_causal=True)
        results.append((out, *torch.autograd.grad(out, inputs, upstream)))
    for name, got, want in zip(("out", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(got, want, msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_views_and_non_contiguous_grad_out(device):
    """(B, N, H, D) memory transposed to (B, H, N, D), and the stride-0 grad of out.sum()."""
    q, k, v = seq_major_qkv(2, 33, 3, 16, device, seed=1)
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


@pytest.mark.parametrize("device", DEVICES)
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
def test_sdpa_shapes_and_broadcasting(shape_q, shape_k, shape_v, enable_gqa, device):
    q, k, v = random_qkv(shape_q, shape_k, shape_v, torch.float64, device)
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
@pytest.mark.parametrize("device", DEVICES)
def test_four_dim_inputs_reach_the_op_as_they_are(enable_gqa, device):
    """(B, H, L, E) inputs, the usual call, go to the op without views of them: each would add an
    autograd node to every forward and backward (host time that small calls notice); the gradients
    still match SDPA's."""
    heads_kv = 2 if enable_gqa else 4
    q, k, v = random_qkv((2, 4, 5, 8), (2, heads_kv, 6, 8), (2, heads_kv, 6, 8), torch.float64, device)
    out = flashattn_ext.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
    assert "FlashAttentionFunction" in out.grad_fn.name()
    assert [type(fn).__name__ for fn, _ in out.grad_fn.next_functions[:3]] == ["AccumulateGrad"] * 3
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    want_grads = torch.autograd.grad(want, (q, k, v), torch.ones_like(want))
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_explicit_scale_and_partial_requires_grad(device):
    q, k, v = make_inputs((1, 2, 2, 20, 30, 16, 16), torch.float64, device)
    k.requires_grad_(False)
    out = flashattn_ext.scaled_dot_product_attention(q, k, v, scale=0.7)
    want = F.scaled_dot_product_attention(q, k, v, scale=0.7)
    torch.testing.assert_close(out, want)
    dq, dv = torch.autograd.grad(out.square().sum(), (q, v))
    want_dq, want_dv = torch.autograd.grad(want.square().sum(), (q, v))
    torch.testing.assert_close(dq, want_dq)
    torch.testing.assert_close(dv, want_dv)


@pytest.mark.parametrize("device", DEVICES)
def test_swaps_into_a_model(device):
    """A module written for F.scaled_dot_product_attention runs unchanged on the shim."""

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


MASKS = {
    # name: (shape, dtype); shapes broadcast to (batch=2, heads=3, L=70, S=90)
    "bool (L, S)": ((70, 90), torch.bool),
    "bool (B, 1, 1, S) padding": ((2, 1, 1, 90), torch.bool),
    "float (L, S)": ((70, 90), torch.float64),
    "float (B, H, L, S)": ((2, 3, 70, 90), torch.float64),
    "float (1, H, 1, S)": ((1, 3, 1, 90), torch.float64),
}


def random_mask(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.3
    return torch.randn(shape, generator=gen, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask_name", list(MASKS))
def test_attn_mask_matches_sdpa(mask_name, device):
    """Bool and float masks of broadcast shapes, read in place; the float mask's gradient too."""
    shape, dtype = MASKS[mask_name]
    q, k, v = random_qkv((2, 3, 70, 16), (2, 3, 90, 16), (2, 3, 90, 16), torch.float64, device)
    mask = random_mask(shape, dtype, seed=1).to(device)
    if dtype != torch.bool:
        mask.requires_grad_()
    leaves = (q, k, v, mask) if mask.requires_grad else (q, k, v)
    grad_out = torch.randn(2, 3, 70, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).to(device)
    out = flashattn_ext.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    grads = torch.autograd.grad(out, leaves, grad_out)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    want_grads = torch.autograd.grad(want, leaves, grad_out)
    torch.testing.assert_close(out, want)
    for got, expected in zip(grads, want_grads):
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected)


# Masks for the CUDA kernels: broadcast shapes over (batch=2, heads=4, L=150, S=200), with
# tiles of keys and queries cut by the ends; the key-padding mask hides whole tiles.
KERNEL_MASKS = {
    "bool (L, S)": (150, 200),
    "bool (B, 1, 1, S) padding": (2, 1, 1, 200),
    "float (L, S)": (150, 200),
    "float (B, H, L, S)": (2, 4, 150, 200),
    "float (1, H, 1, S) transposed": (1, 4, 1, 200),
}


@cuda_test
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mask_name", list(KERNEL_MASKS))
def test_cuda_kernels_read_masks(mask_name, dtype, head_dim, deterministic):
    """The CUDA kernels read bool and float masks in place and give a float mask's gradient:
    within twice torch SDPA's own error in the same dtype, against float64, in both dQ modes."""
    shape = KERNEL_MASKS[mask_name]
    q, k, v = random_qkv((2, 4, 150, head_dim), (2, 2, 200, head_dim), (2, 2, 200, head_dim), dtype, "cuda")
    if mask_name.startswith("bool"):
        mask = random_mask(shape, torch.bool, seed=1)
        mask[..., 0] = True  # every row sees a key (SDPA gives NaN where none does)
        mask = mask.cuda()
    else:
        mask = random_mask(shape, torch.float64, seed=1).to("cuda", dtype)
        if "transposed" in mask_name:  # a last dim that is not contiguous
            mask = mask.transpose(-1, -2).contiguous().transpose(-1, -2)
        mask.requires_grad_()
    grad_out = torch.randn(2, 4, 150, head_dim, device="cuda", dtype=dtype)

    def run(fn, q, k, v, mask):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        mask_leaf = mask.detach().clone().requires_grad_() if mask.requires_grad else mask
        out = fn(*leaves, attn_mask=mask_leaf, enable_gqa=True)
        wrt = leaves + ([mask_leaf] if mask.requires_grad else [])
        return (out.detach(), *torch.autograd.grad(out, wrt, grad_out.to(out.dtype)))

    torch.use_deterministic_algorithms(deterministic)
    try:
        got = run(flashattn_ext.scaled_dot_product_attention, q, k, v, mask)
    finally:
        torch.use_deterministic_algorithms(False)
    upcast = [t.detach().double() for t in (q, k, v)]
    mask64 = mask if mask.dtype == torch.bool else mask.detach().double().requires_grad_()
    want = run(F.scaled_dot_product_attention, *upcast, mask64)
    baseline = run(F.scaled_dot_product_attention, q, k, v, mask)
    assert_within_twice_sdpa(got, baseline, want, dtype, names=("out", "dq", "dk", "dv", "dmask"))


@cuda_test
def test_cuda_kernels_rows_a_mask_hides_entirely():
    """In the kernels too, rows whose mask hides every key give 0, lse -inf and finite gradients."""
    q, k, v = random_qkv((1, 2, 100, 64), (1, 2, 130, 64), (1, 2, 130, 64), torch.bfloat16, "cuda")
    mask = random_mask((100, 130), torch.bool, seed=3).cuda()
    mask[[0, 7, 99]] = False
    out, lse = flashattn_ext.attention_with_lse(q, k, v, attn_mask=mask)
    assert (out[:, :, [0, 7, 99]] == 0).all() and torch.isneginf(lse[:, :, [0, 7, 99]]).all()
    want = F.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), attn_mask=mask)
    rows = [i for i in range(100) if i not in (0, 7, 99)]
    assert relative_error(out[:, :, rows], want[:, :, rows]) < 2e-2
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ["upper_left", "lower_right"])
def test_causal_bias_objects_match_sdpa(variant, device):
    q, k, v = random_qkv((1, 2, 40, 16), (1, 2, 100, 16), (1, 2, 100, 16), torch.float64, device)
    causal = getattr(sdpa_bias, f"causal_{variant}")(40, 100)
    out = flashattn_ext.scaled_dot_product_attention(q, k, v, attn_mask=causal)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
    torch.testing.assert_close(out, want)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_a_mask_hides_entirely_give_zero(device):
    """A bool mask that hides every key of some rows: those rows get 0, as in torch SDPA, and finite gradients."""
    q, k, v = random_qkv((1, 2, 20, 8), (1, 2, 30, 8), (1, 2, 30, 8), torch.float64, device)
    mask = random_mask((20, 30), torch.bool, seed=3).to(device)
    mask[[0, 7, 19]] = False
    out, lse = flashattn_ext.attention_with_lse(q, k, v, attn_mask=mask)
    assert (out[:, :, [0, 7, 19]] == 0).all() and torch.isneginf(lse[:, :, [0, 7, 19]]).all()
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


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
