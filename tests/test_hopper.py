"""The Hopper (sm_90a) kernels against float64 and against the mma.sync kernels they replace.

On an H100/H200 the Hopper kernels are the default for the calls they cover; the other tests run
through them too. These tests check what is particular to them: that they run at all (the kernel's
name in the profiler), every covered shape (ragged lengths against the 128-row tiles, Nq != Nk, both
causal alignments, GQA, padded head dims, sequence-major strides), every output element written
(outputs land on memory poisoned with NaN), dropout with the mma.sync kernels' random numbers,
attn_mask tiles staged beside K, and the calls they leave to the mma.sync kernels."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from torch.profiler import ProfilerActivity, profile

import flashattn_ext
from helpers import CUDA_REASON, ERROR_FLOOR, draw_rng_state, math_with_dropout_mask, naive_attention
from helpers import poison_cuda_allocator, relative_error
from helpers import dropout_bits  # noqa: F401  (a fixture)
from test_dropout import check_against_mask_reference

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_REASON),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU"
    ),
]

# (batch, heads_q, heads_kv, len_q, len_k, head_dim)
SHAPES = [
    (2, 4, 4, 128, 128, 128),
    (1, 2, 2, 1000, 1000, 128),
    (2, 4, 2, 200, 517, 64),
    (1, 3, 1, 517, 200, 64),
    (1, 2, 2, 1, 1000, 128),
    (1, 2, 2, 1000, 1, 64),
    (1, 8, 2, 384, 384, 96),
    (2, 2, 2, 129, 257, 72),
    (1, 2, 1, 300, 300, 32),
    (1, 1, 1, 4096, 4096, 128),
    # More tiles than an H100 or H200 has SMs (132): the persistent forward's blocks take several
    # each, with the K/V ring running on across them; in the second, tiles whose rows see no key.
    (4, 40, 8, 520, 520, 128),
    (2, 48, 48, 600, 100, 64),
    # Head dim 96 (padded to 128: the copy engine's output stores clip the columns), keyless tiles
    # among tiles whose output is still being stored from shared memory.
    (2, 40, 40, 600, 100, 96),
    # Causal calls take tiles heaviest first in chunks of (batch, head) pairs: here 602 pairs of
    # 2-block heads, in chunks of unequal sizes (on 132 SMs, the forward's three of 201, 201 and
    # 200 pairs, the backward's ten of 61 or 60).
    (2, 301, 301, 256, 256, 128),
    # The last 176-key tile of a non-causal row block runs its GEMMs over 48 or 112 keys where it holds
    # no more: 112 of 112 here (48 of 48 at 4096 keys above, masked ones at 384, 257 and 256 keys).
    (1, 4, 2, 333, 2048, 128),
    # Head dim 256 (the forward's 80-key tiles in two stages; the backward's 64-key blocks, both
    # consumers on the same keys): a ragged last key tile with GQA, head dims 160 and 192 padded to
    # it, one query, more tiles than SMs, a causal diagonal through ragged tiles, and a long ring of
    # key tiles.
    (2, 4, 2, 200, 517, 256),
    (2, 3, 3, 129, 257, 160),
    (1, 2, 1, 1, 1000, 192),
    (2, 40, 8, 300, 300, 256),
    (1, 2, 2, 1000, 1000, 256),
    (1, 1, 1, 4096, 4096, 256),
]
SHAPE_IDS = ["x".join(map(str, s)) for s in SHAPES]
MODES = ["full", "causal", "causal_lower_right"]


# NaN poison laid into the CUDA allocator's free memory before each call under test.
POISON_BYTES = 512 * 2**20


def forward(q, k, v, mode, scale=None):
    """flashattn_ext's (out, lse), its outputs allocated on poisoned memory."""
    poison_cuda_allocator(POISON_BYTES)
    return flashattn_ext.attention_with_lse(
        q, k, v, is_causal=mode != "full", causal_lower_right=mode == "causal_lower_right", scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )


def reference(q, k, v, mode, scale=None):
    return naive_attention(
        q.double(), k.double(), v.double(), is_causal=mode != "full",
        causal_lower_right=mode == "causal_lower_right", scale=scale, enable_gqa=q.shape[1] != k.shape[1],
    )


def random_inputs(shape, dtype, seq_major=False, seed=0):
    batch, heads_q, heads_kv, len_q, len_k, dim = shape
    gen = torch.Generator().manual_seed(seed)

    def draw(heads, length):
        if seq_major:  # (B, N, H, D) storage seen as (B, H, N, D)
            x = torch.randn(batch, length, heads, dim, generator=gen).transpose(1, 2)
        else:
            x = torch.randn(batch, heads, length, dim, generator=gen)
        return x.to("cuda", dtype)

    return draw(heads_q, len_q), draw(heads_kv, len_k), draw(heads_kv, len_k)


def sdpa_error(q, k, v, mode, want_out):
    """torch SDPA's own error in this dtype, against the same float64 reference (rows that see
    no key, NaN there, counted as the 0 we give)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if mode == "causal_lower_right":
        mask = causal_lower_right(q.shape[-2], k.shape[-2])
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    else:
        got = F.scaled_dot_product_attention(q, k, v, is_causal=mode == "causal")
    return relative_error(torch.nan_to_num(got), want_out)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_forward_matches_float64(shape, mode, dtype):
    """Out and lse within twice SDPA's own error of a float64 reference, every element written."""
    q, k, v = random_inputs(shape, dtype, seed=hash(shape) % 1000)
    out, lse = forward(q, k, v, mode)
    want_out, want_lse = reference(q, k, v, mode)
    assert torch.isfinite(out).all(), "an output element was not written (NaN poison) or overflowed"
    error = relative_error(out, want_out)
    assert error <= 2 * sdpa_error(q, k, v, mode, want_out) + ERROR_FLOOR[dtype], error
    visible = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), visible)
    assert (lse[visible].double() - want_lse[visible]).abs().max().item() < 1e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", ["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_forward_with_scores_climbing_along_the_keys(head_dim, mode, dtype):
    """Scores that climb (or fall) along the keys, by up to 200 (log2 units) over a row and at a rate
    that differs by row: the forward moves a row's running max only where a key tile's exceeds it by
    more than a margin, and takes the exps against the stale one otherwise. Out and lse must come out
    as with the exact max in every tile."""
    batch, heads, n = 1, 2, 2048
    gen = torch.Generator().manual_seed(head_dim)
    q, k, v = (torch.randn(batch, heads, n, head_dim, generator=gen) for _ in range(3))
    direction = torch.randn(head_dim, generator=gen)
    direction /= direction.norm()
    # Row i's scores gain slope_i * key / n * climb along the keys (log2 units), slope_i from -1 to 1.
    climb = 200 / (head_dim**-0.5 * math.log2(math.e))
    q += (torch.linspace(-1, 1, n) * climb)[:, None] * direction
    k += (torch.arange(n) / n)[:, None] * direction
    q, k, v = (x.to("cuda", dtype) for x in (q, k, v))
    out, lse = forward(q, k, v, mode)
    want_out, want_lse = reference(q, k, v, mode)
    assert torch.isfinite(out).all()
    error = relative_error(out, want_out)
    assert error <= 2 * sdpa_error(q, k, v, mode, want_out) + ERROR_FLOOR[dtype], error
    assert (lse.double() - want_lse).abs().max().item() < 1e-3


def gradients(fn, q, k, v, mode, grad_out):
    """(out, dq, dk, dv) of fn on fresh leaves; fn takes SDPA's arguments."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if mode == "causal_lower_right":
        out = fn(*leaves, attn_mask=causal_lower_right(q.shape[-2], k.shape[-2]))
    else:
        out = fn(*leaves, is_causal=mode == "causal")
    return (out.detach(), *torch.autograd.grad(out, leaves, grad_out.to(out.dtype)))


def expanded(fn):
    """fn with key/value heads repeated to the query's (torch's math SDPA with a CausalBias takes no GQA)."""
    def run(q, k, v, **kwargs):
        group = q.shape[1] // k.shape[1]
        return fn(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), **kwargs)
    return run


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [s for s in SHAPES if s[3] * s[4] <= 1000 * 1000], ids=lambda s: "x".join(map(str, s)))
def test_backward_matches_float64(shape, mode, dtype):
    """dq, dk, dv within twice SDPA's own error of float64 (the atomic-dQ backward, the default)."""
    check_backward(shape, mode, dtype, seed=hash(shape) % 1000 + 1)


@pytest.mark.parametrize("mode", ["full", "causal_lower_right"])
def test_backward_at_head_dim_256_in_chunks_of_heads(mode):
    """Above head dim 128 the backward takes the (batch, key/value head) pairs a chunk at a time, over a
    float32 dQ workspace for one chunk: here, with 264 key blocks a pair, on 132 SMs, three chunks of two
    of the six pairs (the second spans both batch elements), each through the workspace the one before
    left."""
    check_backward((2, 6, 3, 1024, 16896, 256), mode, torch.bfloat16, seed=11)


def check_backward(shape, mode, dtype, seed):
    q, k, v = random_inputs(shape, dtype, seed=seed)
    gen = torch.Generator().manual_seed(7)
    grad_out = torch.randn(shape[0], shape[1], shape[3], shape[5], generator=gen).to("cuda")
    poison_cuda_allocator(POISON_BYTES)
    ours = lambda *args, **kwargs: flashattn_ext.scaled_dot_product_attention(*args, enable_gqa=True, **kwargs)  # noqa: E731
    got = gradients(ours, q, k, v, mode, grad_out)
    want = gradients(expanded(F.scaled_dot_product_attention), q.double(), k.double(), v.double(), mode, grad_out)
    base = gradients(expanded(F.scaled_dot_product_attention), q, k, v, mode, grad_out)
    scale = max(w.abs().max().item() for w in want[1:])
    for name, g, b, w in zip(("out", "dq", "dk", "dv"), got, base, want):
        assert torch.isfinite(g).all(), f"{name}: not every element written, or not finite"
        w, b = torch.nan_to_num(w), torch.nan_to_num(b)  # rows that see no key: SDPA's NaN, our 0
        ours, sdpa = relative_error(g, w, zero_scale=scale), relative_error(b, w, zero_scale=scale)
        assert ours <= 2 * sdpa + ERROR_FLOOR[dtype], f"{name}: {ours:.3g} vs SDPA's {sdpa:.3g}"


@pytest.mark.parametrize("mode", MODES)
def test_sequence_major_strides(mode):
    """(B, N, H, D) storage read in place through the tensor maps' strides."""
    shape = (2, 4, 2, 333, 700, 128)
    q, k, v = random_inputs(shape, torch.bfloat16, seq_major=True, seed=5)
    out, lse = forward(q, k, v, mode)
    want_out, _ = reference(q, k, v, mode)
    assert relative_error(out, want_out) <= 2 * sdpa_error(q, k, v, mode, want_out) + ERROR_FLOOR[torch.bfloat16]


def kernel_names(fn):
    """The names of the CUDA kernels fn launches. fn runs once before it is profiled: in a fresh
    process the first profiled call could miss its kernels (seen with the first windowed call)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [event.name for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_hopper_kernels_run_by_default_and_can_be_turned_off(head_dim, monkeypatch):
    """On sm_90 the forward and the backward launch the sm90 kernels; FLASHATTN_EXT_KERNELS=sm80
    selects the mma.sync kernels, and both agree to rounding."""
    q, k, v = random_inputs((1, 4, 4, 512, 512, head_dim), torch.bfloat16, seed=2)
    q.requires_grad_()
    run = lambda: flashattn_ext.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    names = kernel_names(lambda: run().sum().backward())
    assert any("sm90" in n and "attention_forward_kernel" in n for n in names), names
    assert any("sm90" in n and "attention_backward" in n for n in names), names
    monkeypatch.setenv("FLASHATTN_EXT_KERNELS", "sm80")
    names_sm80 = kernel_names(lambda: run().sum().backward())
    assert not any("sm90" in n for n in names_sm80) and any("sm80" in n for n in names_sm80), names_sm80
    sm80_out = run().detach()
    monkeypatch.delenv("FLASHATTN_EXT_KERNELS")
    assert relative_error(run().detach(), sm80_out) < 1e-2


# (batch, heads_q, heads_kv, len_q, len_k, head_dim): the forward's 176-key tiles with a narrow
# last one (112 and 48 keys), 128-key tiles (causal), three consumers (head dim 64), GQA, more
# tiles than SMs, the backward's 128-query tiles (head dim 64), padded head dims (112 and 80 in
# the kernels of 128), head dim 256's 80-key tiles and its backward's split consumers (both draw
# the same numbers), 192 padded to it.
DROPOUT_SHAPES = [
    (1, 4, 2, 333, 2048, 128),
    (1, 2, 1, 64, 4096, 128),
    (2, 4, 2, 200, 517, 64),
    (2, 24, 8, 520, 520, 128),
    (1, 2, 2, 300, 300, 112),
    (2, 3, 1, 250, 333, 80),
    (1, 4, 2, 300, 700, 256),
    (1, 2, 2, 129, 200, 192),
]


@pytest.mark.parametrize("mode", ["full", "causal"])
@pytest.mark.parametrize("shape", DROPOUT_SHAPES, ids=["x".join(map(str, s)) for s in DROPOUT_SHAPES])
def test_dropout_matches_reference_built_from_its_mask(shape, mode, dropout_bits):
    """Dropout runs in the Hopper kernels, and drops what dropout_mask says (the sm80 kernels'
    numbers): out and gradients against float64 given that mask."""
    batch, heads_q, heads_kv, len_q, len_k, dim = shape
    q, k, v = random_inputs(shape, torch.bfloat16, seed=7)
    kwargs = {"is_causal": mode == "causal", "enable_gqa": heads_q != heads_kv}
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    names = kernel_names(
        lambda: flashattn_ext.scaled_dot_product_attention(*leaves, dropout_p=0.2, **kwargs).sum().backward())
    assert any("sm90" in n and "attention_forward_kernel" in n for n in names), names
    assert any("sm90" in n and "attention_backward" in n for n in names), names
    _, keep = check_against_mask_reference(q, k, v, 0.2, seed=11, **kwargs)
    assert 0.75 < keep.float().mean().item() < 0.85


def test_dropout_agrees_with_the_sm80_kernels(monkeypatch, dropout_bits):
    """Under one seed, the Hopper and the mma.sync kernels drop the same scores."""
    q, k, v = (t.requires_grad_() for t in random_inputs((2, 4, 4, 700, 700, 128), torch.bfloat16, seed=9))

    def run():
        torch.manual_seed(1)
        out = flashattn_ext.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
        return (out.detach(), *torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))

    hopper = run()
    monkeypatch.setenv("FLASHATTN_EXT_KERNELS", "sm80")
    for name, got, want in zip(("out", "dq", "dk", "dv"), hopper, run()):
        assert relative_error(got, want) < 1e-2, name


def attn_mask(case, shape, dtype, seed, empty_batch=True):
    """attn_mask of one kind (bool: True takes part; float: added), in the shape the case names:
    key padding (B, 1, 1, S), with (empty_batch) a batch that sees no key at all (its rows: out 0,
    lse -inf), or (L, S), (B, 1, L, S) and (B, H, L, S) masks that hide about a fifth of the pairs
    or add normal noise with some -inf."""
    batch, heads_q, _, len_q, len_k, _ = shape
    gen = torch.Generator().manual_seed(seed)
    if case.startswith("key_padding"):
        lengths = torch.randint(1, len_k + 1, (batch,), generator=gen)
        lengths[-1] = 0 if batch > 1 and empty_batch else lengths[-1]
        keep = (torch.arange(len_k)[None, :] < lengths[:, None])[:, None, None, :]
    else:
        sizes = {"2d": (len_q, len_k), "per_batch": (batch, 1, len_q, len_k), "per_head": (batch, heads_q, len_q, len_k)}
        keep = torch.rand(*sizes[case.split("_", 1)[1]], generator=gen) > 0.2
    if case.startswith("bool") or case == "key_padding_bool":
        return keep.cuda()
    bias = torch.zeros(keep.shape) if case.startswith("key_padding") else torch.randn(keep.shape, generator=gen)
    return bias.masked_fill(~keep, -float("inf")).to("cuda", dtype)


MASK_CASES = ["key_padding_bool", "key_padding_float", "bool_2d", "float_2d", "bool_per_batch", "float_per_head"]
# (batch, heads_q, heads_kv, len_q, len_k, head_dim): key lengths whose rows are whole 16-byte
# pieces of a bool mask (the copy engine's stride rule); 128-row tiles (head dim 128) and 192-row
# ones (64), a padded head dim, GQA, ragged query blocks, one query, more tiles than SMs.
MASK_SHAPES = [
    (2, 4, 2, 200, 512, 64),
    (1, 2, 2, 333, 1024, 128),
    (3, 2, 1, 130, 128, 96),
    (2, 4, 4, 1, 256, 128),
    (2, 40, 8, 300, 384, 128),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", MASK_CASES)
@pytest.mark.parametrize("shape", MASK_SHAPES, ids=["x".join(map(str, s)) for s in MASK_SHAPES])
def test_forward_with_attn_mask_matches_float64(shape, case, dtype, monkeypatch):
    """The Hopper forward takes bool and float masks of every broadcast form, read through the copy
    engine beside K: out and lse against float64, every element written. (FLASHATTN_EXT_KERNELS=dense:
    the one-query shape with a bool mask would run the decode kernels, tested in test_decode_route.py.)"""
    monkeypatch.setenv("FLASHATTN_EXT_KERNELS", "dense")
    q, k, v = random_inputs(shape, dtype, seed=hash(shape) % 1000 + 2)
    mask = attn_mask(case, shape, dtype, seed=len(case))
    gqa = shape[1] != shape[2]
    call = lambda: flashattn_ext.attention_with_lse(q, k, v, attn_mask=mask, enable_gqa=gqa)  # noqa: E731
    names = kernel_names(call)
    assert any("sm90" in n and "attention_forward_kernel" in n for n in names), names
    poison_cuda_allocator(POISON_BYTES)
    out, lse = call()
    want_out, want_lse = naive_attention(q.double(), k.double(), v.double(), enable_gqa=gqa,
                                         attn_mask=mask if mask.dtype == torch.bool else mask.double())
    group = shape[1] // shape[2]
    sdpa = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                          attn_mask=mask)
    assert torch.isfinite(out).all(), "an output element was not written (NaN poison) or overflowed"
    error = relative_error(out, want_out)
    assert error <= 2 * relative_error(torch.nan_to_num(sdpa), want_out) + ERROR_FLOOR[dtype], error
    visible = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), visible)
    assert (lse[visible].double() - want_lse[visible]).abs().max().item() < 1e-3


# Dropout with a mask runs in the Hopper kernels: head dims 64 (the backward's 128-query tiles) and
# 128, GQA, ragged blocks.
MASKED_DROPOUT_SHAPES = [(2, 4, 2, 200, 512, 64), (1, 4, 2, 333, 640, 128)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ["key_padding_bool", "bool_per_batch", "float_per_head"])
@pytest.mark.parametrize("shape", MASKED_DROPOUT_SHAPES, ids=["x".join(map(str, s)) for s in MASKED_DROPOUT_SHAPES])
def test_dropout_with_attn_mask_matches_reference_built_from_its_mask(shape, case, dtype):
    """Dropout and an attn_mask together run in the Hopper forward and backward, and drop what
    dropout_mask says: out and gradients within twice torch's math SDPA's error (the same mask and
    drops, in the inputs' dtype) of float64."""
    q, k, v = random_inputs(shape, dtype, seed=hash(shape) % 1000 + 4)
    mask = attn_mask(case, shape, dtype, seed=len(case) + 2, empty_batch=False)
    kwargs = {"enable_gqa": shape[1] != shape[2]}
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    names = kernel_names(lambda: flashattn_ext.scaled_dot_product_attention(
        *leaves, attn_mask=mask, dropout_p=0.2, **kwargs).sum().backward())
    assert any("sm90" in n and "attention_forward_kernel" in n for n in names), names
    assert any("sm90" in n and "attention_backward_kernel" in n for n in names), names
    poison_cuda_allocator(POISON_BYTES)
    check_against_mask_reference(q, k, v, 0.2, seed=13, attn_mask=mask, **kwargs)


# The Hopper backward with a mask: head dims 128 and 64 (64-query tiles and 128-query ones), 112
# and 40 (padded), GQA, ragged query and key blocks.
MASK_BACKWARD_SHAPES = [
    (1, 2, 2, 333, 1024, 128),
    (2, 4, 2, 200, 512, 112),
    (2, 24, 8, 130, 384, 128),
    (2, 4, 2, 200, 512, 64),
    (1, 6, 2, 259, 640, 40),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", MASK_CASES)
@pytest.mark.parametrize("shape", MASK_BACKWARD_SHAPES, ids=["x".join(map(str, s)) for s in MASK_BACKWARD_SHAPES])
def test_backward_with_attn_mask_matches_float64(shape, case, dtype):
    """dq, dk, dv with a mask of every broadcast form within twice SDPA's own error of float64, the
    Hopper backward running where it takes the mask."""
    q, k, v = random_inputs(shape, dtype, seed=hash(shape) % 1000 + 3)
    mask = attn_mask(case, shape, dtype, seed=len(case) + 1, empty_batch=False)
    gen = torch.Generator().manual_seed(8)
    grad_out = torch.randn(shape[0], shape[1], shape[3], shape[5], generator=gen).to("cuda", dtype)
    gqa = shape[1] != shape[2]

    def grads(fn, q, k, v, mask):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, attn_mask=mask)
        return (out.detach(), *torch.autograd.grad(out, leaves, grad_out.to(out.dtype)))

    ours = lambda *args, **kwargs: flashattn_ext.scaled_dot_product_attention(*args, enable_gqa=gqa, **kwargs)  # noqa: E731
    names = kernel_names(lambda: grads(ours, q, k, v, mask))
    assert any("sm90" in n and "attention_backward_kernel" in n for n in names), names
    poison_cuda_allocator(POISON_BYTES)
    got = grads(ours, q, k, v, mask)
    sdpa = expanded(F.scaled_dot_product_attention)
    want = grads(sdpa, q.double(), k.double(), v.double(), mask if mask.dtype == torch.bool else mask.double())
    base = grads(sdpa, q, k, v, mask)
    scale = max(w.abs().max().item() for w in want[1:])
    for name, g, b, w in zip(("out", "dq", "dk", "dv"), got, base, want):
        assert torch.isfinite(g).all(), f"{name}: not every element written, or not finite"
        ours_error, sdpa_error = relative_error(g, w, zero_scale=scale), relative_error(b, w, zero_scale=scale)
        assert ours_error <= 2 * sdpa_error + ERROR_FLOOR[dtype], f"{name}: {ours_error:.3g} vs SDPA's {sdpa_error:.3g}"


def block_mask(kind, mask_shape, shape, dtype, seed):
    """A mask whose blocks of 64 queries x 128 keys (the block map's) each hide every pair, none, or
    some, drawn per block: shaped (B, H, 1, S), (B, 1, 1, S) or (1, 1, 1, S) (repeating over queries,
    as a key-padding mask does), or (B, 1, L, S) with rows of its own ("batch_rows"). The mask of the
    first (batch, head) hides every key where there are others. bool: True takes part; float: -inf
    where hidden, 0 in the blocks that hide none, normal noise in the others."""
    batch, heads_q, _, len_q, len_k, _ = shape
    rows = {"batch_head": (batch, heads_q), "batch": (batch, 1), "shared": (1, 1), "batch_rows": (batch, 1)}[mask_shape]
    gen = torch.Generator().manual_seed(seed)
    query_blocks = -(-len_q // 64) if mask_shape == "batch_rows" else 1
    visibility = torch.randint(0, 3, (*rows, query_blocks, -(-len_k // 128)), generator=gen)  # 0 hidden, 1 whole
    if rows != (1, 1):
        visibility[0, 0] = 0
    per_pair = visibility.repeat_interleave(128, dim=-1)[..., :len_k]
    if query_blocks > 1:
        per_pair = per_pair.repeat_interleave(64, dim=-2)[..., :len_q, :]
    keep = (per_pair == 1) | ((per_pair == 2) & (torch.rand(per_pair.shape, generator=gen) > 0.5))
    if kind == "bool":
        return keep.cuda()
    bias = torch.where(per_pair == 2, torch.randn(keep.shape, generator=gen), torch.zeros(keep.shape))
    return bias.masked_fill(~keep, -float("inf")).to("cuda", dtype)


# Head dims 128 and 64 (128- and 192-query tiles), GQA, a ragged last key block (key lengths whose
# mask rows are whole 16-byte pieces, as the copy engine takes them).
KEY_BLOCK_SHAPES = [(2, 4, 2, 300, 1008, 128), (3, 2, 1, 500, 1280, 64)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mask_shape", ["batch_head", "batch", "shared", "batch_rows"])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape", KEY_BLOCK_SHAPES, ids=["x".join(map(str, s)) for s in KEY_BLOCK_SHAPES])
def test_forward_skips_the_tiles_a_mask_hides(shape, kind, mask_shape, causal, dtype):
    """A mask is classified by blocks of 64 queries x 128 keys before the forward, which skips the
    tiles it hides and runs the unmasked code on those it hides none of: blocks of all three kinds
    in any order, per (batch, head), batch, or shared by all, with rows of their own or repeating
    over queries, with the causal diagonal through them (the op takes both), and a (batch, head)
    whose mask hides every key (out 0, lse -inf)."""
    q, k, v = random_inputs(shape, dtype, seed=11)
    mask = block_mask(kind, mask_shape, shape, dtype, seed=len(kind) + len(mask_shape) + causal)
    gqa = shape[1] != shape[2]
    mask_view = mask.expand(shape[0], shape[1], shape[3], shape[4])  # as the Python call passes it
    call = lambda: torch.ops.flashattn_ext.attention_forward(q, k, v, mask_view, 0.0, causal, False,  # noqa: E731
                                                             shape[5] ** -0.5)
    names = kernel_names(call)
    assert any("sm90" in n and "attention_forward_kernel" in n for n in names), names
    assert any("classify_mask_blocks" in n for n in names), names
    poison_cuda_allocator(POISON_BYTES)
    out, lse, _ = call()
    want_out, want_lse = naive_attention(q.double(), k.double(), v.double(), is_causal=causal, enable_gqa=gqa,
                                         attn_mask=mask if mask.dtype == torch.bool else mask.double())
    assert torch.isfinite(out).all(), "an output element was not written (NaN poison) or overflowed"
    assert relative_error(out, want_out) < 1e-2
    visible = torch.isfinite(want_lse)
    if mask_shape != "shared":
        assert not visible[0, 0].any(), "the mask's first row hides every key"
    assert torch.equal(torch.isfinite(lse), visible)
    if visible.any():  # (a shared mask may hide all that the causal rows see)
        assert (lse[visible].double() - want_lse[visible]).abs().max().item() < 1e-3
    assert (out[~visible] == 0).all()


# GQA and a ragged last key block, padded head dims, 64-query tiles (head dims 97 to 128) and
# 128-query ones (up to 64).
KEY_BLOCK_BACKWARD_SHAPES = [(2, 4, 2, 300, 1008, 128), (2, 3, 3, 257, 1280, 112), (2, 4, 2, 300, 1008, 64)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mask_shape", ["batch_head", "batch", "shared", "batch_rows"])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape", KEY_BLOCK_BACKWARD_SHAPES,
                         ids=["x".join(map(str, s)) for s in KEY_BLOCK_BACKWARD_SHAPES])
def test_backward_skips_the_tiles_a_mask_hides(shape, kind, mask_shape, causal, dtype):
    """The backward reads the same map: a query tile that the mask hides from a block of 128 keys
    is not streamed (dk = dv = 0 exactly where it hides them all); one it hides none of runs
    unmasked; the others apply the mask. dq, dk, dv within twice SDPA's error (with the mask and
    the causal diagonal as one mask) of float64."""
    q, k, v = random_inputs(shape, dtype, seed=12)
    mask = block_mask(kind, mask_shape, shape, dtype, seed=len(kind) + len(mask_shape) + causal + 3)
    batch, heads_q, heads_kv, len_q, len_k, head_dim = shape
    gen = torch.Generator().manual_seed(9)
    grad_out = torch.randn(batch, heads_q, len_q, head_dim, generator=gen).to("cuda", dtype)
    mask_view = mask.expand(batch, heads_q, len_q, len_k)  # as the Python call passes it
    scale = head_dim ** -0.5

    def call():
        out, lse, rng_state = torch.ops.flashattn_ext.attention_forward(q, k, v, mask_view, 0.0, causal, False, scale)
        grads = torch.ops.flashattn_ext.attention_backward(grad_out, q, k, v, out, lse, rng_state, mask_view, 0.0,
                                                           causal, False, scale, False)
        return (out, *grads[:3])

    names = kernel_names(call)
    assert any("sm90" in n and "attention_backward_kernel" in n for n in names), names
    assert sum("classify_mask_blocks" in n for n in names) == 2, names  # the forward's and the backward's
    poison_cuda_allocator(POISON_BYTES)
    got = call()
    # SDPA takes no mask with is_causal: the causal diagonal joins the mask. Rows that see no key (NaN in
    # SDPA, 0 here) see every key there, with grad_out 0: the gradients are then those of rows that see none.
    tril = torch.ones(len_q, len_k, dtype=torch.bool, device="cuda").tril()
    seen = mask if kind == "bool" else mask > -math.inf
    empty = ~(seen & tril if causal else seen).any(dim=-1, keepdim=True).expand(batch, heads_q, len_q, 1)
    if kind == "bool":
        full = (mask & tril if causal else mask) | empty
    else:
        full = (mask.masked_fill(~tril, -math.inf) if causal else mask).masked_fill(empty, 0.0)
    sdpa = expanded(F.scaled_dot_product_attention)

    def grads(q, k, v, full):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = sdpa(*leaves, attn_mask=full)
        dq, dk, dv = torch.autograd.grad(out, leaves, grad_out.masked_fill(empty, 0).to(out.dtype))
        return out.detach().masked_fill(empty, 0), dq, dk, dv

    want = grads(q.double(), k.double(), v.double(), full if kind == "bool" else full.double())
    base = grads(q, k, v, full)
    scale_of_grads = max(w.abs().max().item() for w in want[1:])
    for name, g, b, w in zip(("out", "dq", "dk", "dv"), got, base, want):
        assert torch.isfinite(g).all(), f"{name}: not every element written, or not finite"
        ours_error = relative_error(g, w, zero_scale=scale_of_grads)
        sdpa_error = relative_error(b, w, zero_scale=scale_of_grads)
        assert ours_error <= 2 * sdpa_error + ERROR_FLOOR[dtype], f"{name}: {ours_error:.3g} vs SDPA's {sdpa_error:.3g}"
    # Keys that no query row of their key/value head's group sees, by the mask or the diagonal. (Not
    # the reference's zero rows of dk: those also hold keys seen only by rows that see nothing else.)
    seen_by = ((seen & tril) if causal else seen).expand(batch, heads_q, len_q, len_k).any(dim=-2)
    unseen = ~seen_by.view(batch, heads_kv, heads_q // heads_kv, len_k).any(dim=2)
    assert unseen.any(), "the masks hide some keys from every query"
    for name, g in zip(("dk", "dv"), got[2:]):
        assert (g[unseen] == 0).all(), f"{name}: not exactly 0 at keys no query sees"


@pytest.mark.parametrize("head_dim", [64, 128])
def test_bfloat16_lowest_hides_as_minus_infinity(head_dim):
    """An additive bf16 mask that hides with torch.finfo(torch.bfloat16).min (as some transformers
    versions build it) is the same mask as with -inf: the block map skips its tiles as it skips
    -inf's, and out, lse, dk and dv are bitwise those of the -inf mask. Both are SDPA's result on
    the GPU: a row of the lowest value alone gives 0 there too (float64 would average its values).
    (dq, added up by atomics, within rounding.)"""
    shape = (2, 4, 2, 300, 1008, head_dim)
    q, k, v = random_inputs(shape, torch.bfloat16, seed=21)
    gen = torch.Generator().manual_seed(22)
    keep = torch.rand(2, 1, 300, 1008, generator=gen) > 0.3
    keep[..., 512:] = False  # whole key blocks hidden
    keep[:, :, 5] = False  # a row that sees no key
    bias = torch.randn(keep.shape, generator=gen)
    lowest = torch.finfo(torch.bfloat16).min
    masks = [torch.where(keep, bias, hide).to("cuda", torch.bfloat16) for hide in (lowest, -math.inf)]
    grad_out = torch.randn(2, 4, 300, head_dim, generator=gen).to("cuda", torch.bfloat16)

    def run(mask, attention=flashattn_ext.attention_with_lse, dtype=torch.bfloat16):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out, lse = attention(*leaves, attn_mask=mask, enable_gqa=True)
        return (out.detach(), lse.detach(), *torch.autograd.grad(out, leaves, grad_out.to(out.dtype)))

    poison_cuda_allocator(POISON_BYTES)
    with_lowest, with_inf = run(masks[0]), run(masks[1])
    for name, a, b in zip(("out", "lse", "dk", "dv"), with_lowest[:2] + with_lowest[3:], with_inf[:2] + with_inf[3:]):
        assert torch.equal(a, b), name
    # (dq is added up by float32 atomics, in no fixed order.)
    assert relative_error(with_lowest[2], with_inf[2]) < 1e-3
    assert (with_lowest[0][:, :, 5] == 0).all() and (with_lowest[1][:, :, 5] == -math.inf).all()
    sdpa = expanded(F.scaled_dot_product_attention)
    assert relative_error(sdpa(q, k, v, attn_mask=masks[0]), with_lowest[0]) < 1e-2
    want = run(masks[1].double(), naive_attention, torch.float64)
    for name, got, w in zip(("out", "lse", "dq", "dk", "dv"), with_lowest, want):
        finite = torch.isfinite(w)
        assert torch.equal(torch.isfinite(got), finite), name
        assert relative_error(got[finite], w[finite]) < 2e-2, name


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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape, options", WINDOW_CASES, ids=[str(o) for _, o in WINDOW_CASES])
def test_sliding_window(shape, options, dtype):
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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape, options", SOFTCAP_CASES, ids=[f"{s[-1]}-{o}" for s, o in SOFTCAP_CASES])
def test_softcap(shape, options, dtype):
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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape, options", ALIBI_CASES, ids=[f"{s[-1]}-{o}" for s, o in ALIBI_CASES])
def test_alibi(shape, options, dtype):
    """The Hopper kernels add ALiBi's bias themselves, forward and backward: out, lse and gradients
    within twice the naive attention's error in the same dtype."""
    q, k, v = random_inputs(shape, dtype, seed=10)
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / shape[1]) for h in range(shape[1])], device="cuda")
    if options.get("is_causal"):
        slopes = torch.stack([slopes, slopes.flip(0)])[: shape[0]]
    kwargs = dict(options, enable_gqa=shape[1] != shape[2], alibi_slopes=slopes)
    out = check_hopper_forward(q, k, v, **kwargs)
    check_hopper_gradients(q, k, v, out, **kwargs)


def test_sliding_window_with_attn_mask_or_dropout():
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


@pytest.mark.parametrize("lower_right", [False, True])
def test_forward_with_attn_mask_and_causal(lower_right):
    """The op itself takes a mask together with is_causal (the Python call, as SDPA, refuses both):
    the kernel hides what either hides."""
    shape = (2, 4, 4, 300, 512, 128)
    q, k, v = random_inputs(shape, torch.bfloat16, seed=4)
    mask = attn_mask("float_per_batch", shape, torch.bfloat16, seed=5).expand(2, 4, 300, 512)
    scale = 128 ** -0.5
    call = lambda: torch.ops.flashattn_ext.attention_forward(q, k, v, mask, 0.0, True, lower_right, scale)  # noqa: E731
    assert any("sm90" in n and "attention_forward_kernel" in n for n in kernel_names(call)), "sm90 not run"
    out, lse, _ = call()
    want_out, want_lse = naive_attention(q.double(), k.double(), v.double(), is_causal=True,
                                         causal_lower_right=lower_right, attn_mask=mask.double())
    assert relative_error(out, want_out) < 1e-2
    visible = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), visible)
    assert (lse[visible].double() - want_lse[visible]).abs().max().item() < 1e-3


@pytest.mark.parametrize(
    "case",
    ["mask_rows_unaligned", "mask_head_dim_256", "negative_scale", "stride_zero_batch"],
)
def test_calls_the_hopper_kernel_leaves_to_sm80(case):
    """What the Hopper forward does not cover still runs, on the mma.sync kernels, correctly."""
    q, k, v = random_inputs((2, 2, 2, 200, 300, 256 if case == "mask_head_dim_256" else 64), torch.bfloat16, seed=3)
    kwargs = {}
    if case == "mask_rows_unaligned":  # rows of 300 bools: not whole 16-byte pieces
        kwargs["attn_mask"] = torch.rand(200, 300, device="cuda") > 0.2
    if case == "mask_head_dim_256":  # rows of 304 bools: whole 16-byte pieces
        kwargs["attn_mask"] = torch.rand(200, 304, device="cuda") > 0.2
        k, v = torch.cat([k, k[:, :, :4]], dim=2), torch.cat([v, v[:, :, :4]], dim=2)
    if case == "negative_scale":
        kwargs["scale"] = -0.1
    if case == "stride_zero_batch":
        k = k[:1].expand(2, -1, -1, -1)
        v = v[:1].expand(2, -1, -1, -1)
    names = kernel_names(lambda: flashattn_ext.scaled_dot_product_attention(q, k, v, **kwargs))
    assert not any("sm90" in n for n in names), names
    out = flashattn_ext.scaled_dot_product_attention(q, k, v, **kwargs)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kwargs)
    assert relative_error(out, want) < 2e-2


# Query and key lengths of a packed batch: empty sequences, one token, lengths on and off the tiles'
# multiples, keys fewer and more than queries.
VARLEN_LENGTHS_Q = [300, 0, 1, 129, 700, 64, 5]
VARLEN_LENGTHS_K = [300, 7, 1, 400, 690, 0, 260]
VARLEN_OPTIONS = [dict(), dict(is_causal=True), dict(is_causal=True, causal_lower_right=True),
                  dict(window=(50, 10)), dict(window=(30, 0), is_causal=True, causal_lower_right=True)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("options", VARLEN_OPTIONS, ids=[str(o) for o in VARLEN_OPTIONS])
def test_varlen_forward_in_one_launch(options, head_dim, dtype):
    """A packed batch runs as one launch of the Hopper forward (tiles over every sequence's query
    blocks, rows past a sequence's end neither read as keys nor written): each sequence's out and
    lse within twice its naive attention's error in dtype, every element written (NaN poison);
    the gradients (the Hopper backward's one launch up to head dim 128, one call a sequence at
    256) within the same budget, every element written."""
    gen = torch.Generator().manual_seed(11)
    heads_q, heads_kv = 4, 2
    q, k, v = (torch.randn(sum(lengths), heads, head_dim, generator=gen).to("cuda", dtype)
               for lengths, heads in ((VARLEN_LENGTHS_Q, heads_q), (VARLEN_LENGTHS_K, heads_kv),
                                      (VARLEN_LENGTHS_K, heads_kv)))
    cu_q, cu_k = (torch.tensor([0] + lengths, device="cuda").cumsum(0, dtype=torch.int32)
                  for lengths in (VARLEN_LENGTHS_Q, VARLEN_LENGTHS_K))
    longest_q = max(VARLEN_LENGTHS_Q) + 3  # (max_seqlen may exceed the longest)

    def call(*leaves):
        poison_cuda_allocator(POISON_BYTES)
        return flashattn_ext.varlen_attention(*leaves, cu_q, cu_k, longest_q, max(VARLEN_LENGTHS_K),
                                              return_lse=True, **options)

    names = kernel_names(lambda: call(q, k, v))
    assert sum("sm90" in n and "attention_forward_kernel" in n for n in names) == 1, names
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = call(*leaves)
    assert torch.isfinite(out).all(), "an output element was not written (NaN poison)"
    dout = torch.randn_like(out)
    if head_dim <= 128:  # the Hopper backward's one launch (head dim 256: one call a sequence)
        names = kernel_names(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True))
        assert sum("sm90" in n and "attention_backward_kernel" in n for n in names) == 1, names
    poison_cuda_allocator(POISON_BYTES)
    got_grads = torch.autograd.grad(out, leaves, dout)
    for name, g in zip(("dq", "dk", "dv"), got_grads):
        assert torch.isfinite(g).all(), f"{name}: an element was not written (NaN poison)"
    bq = bk = 0
    for lq, lk in zip(VARLEN_LENGTHS_Q, VARLEN_LENGTHS_K):
        def sequence(t, begin, length):
            return t[begin:begin + length].transpose(0, 1)[None]
        seq = [sequence(t, bq, lq) for t in (q,)] + [sequence(t, bk, lk) for t in (k, v)]
        got_out, got_lse = sequence(out, bq, lq), lse[:, bq:bq + lq][None]
        if lk == 0 or lq == 0:  # out 0 and lse -inf; no gradient reaches the sequence
            assert torch.equal(got_out, torch.zeros_like(got_out)) and bool((got_lse == -math.inf).all())
            for g, begin, length in zip(got_grads, (bq, bk, bk), (lq, lk, lk)):
                assert not g[begin:begin + length].any()
        else:
            def grads(cast):
                ref = [t.to(cast).requires_grad_() for t in seq]
                o, l = naive_attention(*ref, enable_gqa=True, **options)
                return (o, l), torch.autograd.grad(o, ref, sequence(dout, bq, lq).to(cast))
            (want_out, want_lse), want_grads = grads(torch.float64)
            (base_out, _), base_grads = grads(dtype)
            assert relative_error(got_out, want_out) <= 2 * relative_error(base_out, want_out) + ERROR_FLOOR[dtype]
            visible = torch.isfinite(want_lse)
            assert torch.equal(torch.isfinite(got_lse), visible)
            assert (got_lse[visible].double() - want_lse[visible]).abs().max().item() < 1e-3
            got = [sequence(got_grads[0], bq, lq)] + [sequence(g, bk, lk) for g in got_grads[1:]]
            for name, g, w, b in zip(("dq", "dk", "dv"), got, want_grads, base_grads):
                error, budget = relative_error(g, w), 2 * relative_error(b, w) + ERROR_FLOOR[dtype]
                assert error <= budget, f"{name} of the sequence at {bq}: {error:.3g} > {budget:.3g}"
        bq, bk = bq + lq, bk + lk


def packed_pair(lengths, heads=(4, 2), dim=128, dtype=torch.bfloat16):
    """Leaves q, k, v of a packed self-attention batch, its cu_seqlens, and an incoming gradient."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(sum(lengths), h, dim, generator=gen).to("cuda", dtype).requires_grad_()
               for h in (heads[0], heads[1], heads[1]))
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0, dtype=torch.int32)
    return [q, k, v], cu, torch.randn(sum(lengths), heads[0], dim, generator=gen).to("cuda", dtype)


def test_varlen_in_one_launch_does_not_wait_for_the_device():
    """The one-launch forward and backward read cu_seqlens on the device only: no call waits for
    it (torch's sync debug mode raises on one that does, as the path of one call a sequence shows),
    nor does SDPA on jagged nested tensors whose longest sequence is known."""
    leaves, cu, dout = packed_pair([300, 5, 129])
    # Jagged nested tensors sharing those offsets, their longest sequence known (as SDPA reads it).
    nested = [torch.nested.nested_tensor_from_jagged(t.detach(), cu, max_seqlen=300).transpose(1, 2) for t in leaves]
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = flashattn_ext.varlen_attention(*leaves, cu, cu, 300, 300, is_causal=True)
        torch.autograd.grad(out, leaves, dout)
        nested_out = flashattn_ext.scaled_dot_product_attention(*nested, is_causal=True, enable_gqa=True)
        with pytest.raises(RuntimeError, match="synchroniz"):  # (dropout: one call a sequence)
            flashattn_ext.varlen_attention(*leaves, cu, cu, 300, 300, dropout_p=0.1)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert torch.equal(nested_out.transpose(1, 2).values(), out.detach())


@pytest.mark.parametrize("case", ["decreasing", "past_the_end", "longer_than_max_seqlen", "not_from_zero"])
def test_varlen_bad_bounds_in_one_launch_give_nan(case):
    """Bounds that are not a packed batch's, which the one-launch paths cannot refuse (they do not
    read cu_seqlens back), make every output, log-sum-exp and gradient NaN; no kernel leaves its
    tensors (sanitizer_workload.run_varlen_bad_bounds). One call a sequence still raises."""
    leaves, cu, dout = packed_pair([100, 200])
    longest = 200
    if case == "decreasing":
        cu = torch.tensor([0, 250, 100, 300], device="cuda", dtype=torch.int32)
    elif case == "past_the_end":
        cu = torch.tensor([0, 100, 1000], device="cuda", dtype=torch.int32)
    elif case == "longer_than_max_seqlen":
        longest = 150
    else:
        cu = torch.tensor([20, 100, 300], device="cuda", dtype=torch.int32)
    names = kernel_names(lambda: flashattn_ext.varlen_attention(*leaves, cu, cu, longest, longest))
    assert sum("sm90" in n and "attention_forward_kernel" in n for n in names) == 1, names
    out, lse = flashattn_ext.varlen_attention(*leaves, cu, cu, longest, longest, return_lse=True)
    assert torch.isnan(out).all() and torch.isnan(lse).all()
    # (The backward op itself, with an incoming gradient that is not NaN.)
    grads = torch.ops.flashattn_ext.varlen_backward(dout, *leaves, out.nan_to_num(), lse.nan_to_num(), cu, cu,
                                                    longest, longest, False, False, 128 ** -0.5, -1, -1, 0.0, None)
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert torch.isnan(g).all(), name
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        flashattn_ext.varlen_attention(*leaves, cu, cu, longest, longest, dropout_p=0.1)


# The Hopper decode kernel (sm90/decode_sm90.cu): tiles of 64 (key, key/value head) pairs through the
# copy engine, an item taking as many key/value heads (1, 2, 4, 8, ...) as their query rows fit 16,
# a paged cache's blocks looked up once a box, persistent blocks taking (chunk, head group,
# sequence) items in turn, four partial results a chunk.
# (block_size, head_dim, batch, heads_q, heads_kv, len_q, lengths or None for random ones, capacity)
DECODE_CASES = [
    # A sequence with no key, ragged ends inside a tile, a full cache; 4 key heads an item (16 keys a tile).
    (None, 128, 4, 32, 8, 1, [0, 21, 1000, 4096], 4096),
    # Paged 16 (one block a tile), the capacity not a multiple of 64: boxes past the block table are not loaded.
    (16, 128, 3, 32, 8, 1, [1000, 7, 4000], 4000),
    # Two key heads an item (6 of them), 32 keys a tile in two blocks of 16.
    (16, 64, 2, 12, 6, 1, [500, 77], 512),
    # The smallest box (8 rows of one head: the swizzle's period), 16 query rows a key head (MQA).
    (8, 64, 2, 16, 1, 1, [300, 513], 520),
    # Causal with 3 query tokens (12 rows: one key head an item), blocks of 32; a sequence of one key.
    (32, 64, 3, 8, 2, 3, [100, 64, 1], 128),
    # Eight key heads an item (8 keys a tile) from inside blocks of 128.
    (128, 128, 2, 8, 8, 2, [129, 1000], 1024),
    # One sequence of 30000 keys on one key head: dozens of chunks, merged by their lse.
    (None, 128, 1, 4, 1, 1, [30000], 30000),
    # 48 x 4 = 192 items on at most 132 SMs: the ring runs on from one item into the next.
    (256, 64, 48, 8, 4, 1, None, 1024),
]


@pytest.mark.parametrize("options", [{}, {"window": (100, 0)}, {"softcap": 20.0}, {"alibi": True}],
                         ids=["plain", "window", "softcap", "alibi"])
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"paged{c[0]}-d{c[1]}-b{c[2]}-lq{c[5]}")
def test_decode_kernel(case, options):
    """decode_attention through the Hopper decode kernel (its name in the profiler) against float64,
    with the cache's rows past each sequence's length NaN (rows a tile reads but no query sees must
    not reach the output) and the outputs on NaN-poisoned memory."""
    from test_decode import TOLERANCE, make_cache, reference

    block_size, dim, batch, heads_q, heads_kv, len_q, lengths, capacity = case
    gen = torch.Generator().manual_seed(31)
    dtype = torch.bfloat16
    if lengths is None:
        lengths = torch.randint(0, capacity + 1, (batch,), generator=gen).tolist()
    key_cache, value_cache, table = make_cache(batch, heads_kv, capacity, dim, dim, dtype, block_size, gen)
    for cache in (key_cache, value_cache):
        for b, length in enumerate(lengths):
            if block_size is None:
                cache[b, :, length:] = math.nan
            else:
                positions = torch.arange(length, table.shape[1] * block_size)
                cache[table[b, positions // block_size].long(), positions % block_size] = math.nan
    query = torch.randn(batch, heads_q, len_q, dim, generator=gen).to(dtype)
    options = dict(options)
    if options.pop("alibi", False):
        options["alibi_slopes"] = torch.rand(heads_q, generator=gen, dtype=torch.float64) * 0.1
    on_cuda = {name: value.float().cuda() if isinstance(value, torch.Tensor) else value
               for name, value in options.items()}

    def call():
        return flashattn_ext.decode_attention(query.cuda(), key_cache.cuda(), value_cache.cuda(),
                                              torch.tensor(lengths).cuda(), is_causal=len_q > 1,
                                              block_table=None if table is None else table.cuda(), return_lse=True,
                                              **on_cuda)

    names = kernel_names(call)
    assert any("sm90" in n and "decode_kernel" in n for n in names), names
    poison_cuda_allocator(POISON_BYTES)
    out, lse = call()
    want_out, want_lse = reference(query, key_cache, value_cache, lengths, table, len_q > 1, 1 / math.sqrt(dim),
                                   **options)
    assert relative_error(out.cpu(), want_out) <= TOLERANCE[dtype]
    seen = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), seen)
    assert (lse.cpu()[seen].double() - want_lse[seen]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("block_size", [None, 4])
def test_decode_kernel_cache_layouts(block_size):
    """The Hopper decode kernel's copies walk the nearer of heads and rows in memory first: each cache
    also in the other order (a contiguous cache's heads side by side in each row; a paged cache's
    heads apart in each block, 4 blocks a tile): the same results against float64."""
    from test_decode import TOLERANCE, make_cache, reference

    gen = torch.Generator().manual_seed(7)
    dtype, lengths = torch.bfloat16, [77, 256]
    key_cache, value_cache, table = make_cache(2, 4, 256, 128, 128, dtype, block_size, gen)
    query = torch.randn(2, 8, 1, 128, generator=gen).to(dtype)
    want, _ = reference(query, key_cache, value_cache, lengths, table, False, 1 / math.sqrt(128))
    for reorder in (False, True):
        caches = [c.cuda() for c in (key_cache, value_cache)]
        if reorder:  # the same values with heads and rows swapped in memory
            caches = [c.transpose(1, 2).contiguous().transpose(1, 2) for c in caches]

        def call():
            return flashattn_ext.decode_attention(query.cuda(), *caches, torch.tensor(lengths).cuda(),
                                                  block_table=None if table is None else table.cuda())

        names = kernel_names(call)
        assert any("sm90" in n and "decode_kernel" in n for n in names), names
        assert relative_error(call().cpu(), want) <= TOLERANCE[dtype], f"heads and rows swapped: {reorder}"


@pytest.mark.parametrize("block_size, dim, heads_q, heads_kv, len_q, hopper", [
    (None, 128, 16, 4, 1, True),
    (16, 64, 16, 4, 1, True),
    (4, 128, 16, 4, 1, True),  # blocks of 4 keys of 4 key heads: boxes of 4 x 4 rows of 256 bytes
    (4, 128, 4, 1, 1, True),  # blocks of 4 keys of one key head: boxes of 4 rows, the swizzle's 1024 bytes
    (None, 32, 16, 4, 1, False),  # head dim 32
    (4, 64, 4, 1, 1, False),  # blocks of 4 keys of one key head at head dim 64: boxes of 512 bytes
    (24, 128, 16, 4, 1, False),  # blocks that neither divide the tile's 16 keys nor are a multiple of them
    (None, 128, 16, 4, 5, True),  # 4 query heads x 5 tokens: 20 rows a key head, two row groups
    (None, 128, 16, 4, 9, False),  # 4 query heads x 9 tokens: 36 rows a key head
])
def test_decode_kernel_choice(block_size, dim, heads_q, heads_kv, len_q, hopper, monkeypatch):
    """The Hopper decode kernel runs where it takes the call, the mma.sync one elsewhere and under
    FLASHATTN_EXT_KERNELS=sm80; both agree with float64."""
    from test_decode import TOLERANCE, make_cache, reference

    gen = torch.Generator().manual_seed(3)
    dtype, lengths = torch.bfloat16, [77, 128]
    key_cache, value_cache, table = make_cache(2, heads_kv, 128, dim, dim, dtype, block_size, gen)
    query = torch.randn(2, heads_q, len_q, dim, generator=gen).to(dtype)
    want_out, _ = reference(query, key_cache, value_cache, lengths, table, len_q > 1, 1 / math.sqrt(dim))

    def call():
        return flashattn_ext.decode_attention(query.cuda(), key_cache.cuda(), value_cache.cuda(),
                                              torch.tensor(lengths).cuda(), is_causal=len_q > 1,
                                              block_table=None if table is None else table.cuda())

    for kernels, expect_hopper in ((None, hopper), ("sm80", False)):
        if kernels is not None:
            monkeypatch.setenv("FLASHATTN_EXT_KERNELS", kernels)
        names = kernel_names(call)
        assert any("sm90" in n and "decode_kernel" in n for n in names) == expect_hopper, names
        assert any("decode_chunks_kernel" in n for n in names) == (not expect_hopper), names
        assert relative_error(call().cpu(), want_out) <= TOLERANCE[dtype]
