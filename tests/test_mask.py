"""attn_mask: bool and float masks of every broadcast shape, a float mask's gradient, CausalBias
objects, rows a mask hides entirely or leaves one key, against torch SDPA and a naive float64
reference; then the Hopper kernels' masks (path sm90): tiles of the mask staged beside K by the copy
engine, and the block map that skips the tiles a mask hides."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import bias as sdpa_bias

import flashattn_ext
from helpers import (
    ERROR_FLOOR,
    POISON_BYTES,
    assert_within_twice_sdpa,
    cuda_test,
    deterministic_algorithms,
    expanded,
    kernel_names,
    naive_attention,
    on_paths,
    poison_cuda_allocator,
    random_attn_mask,
    random_inputs,
    random_qkv,
    relative_error,
)


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
@on_paths("cpu", "cuda", "sm80", "deterministic")
def test_a_row_that_a_mask_leaves_one_key_gets_exact_zero_gradients(path, kind, dtype):
    """As above where an attn_mask leaves a row one key, any key (the CUDA kernels know these rows from
    a pass over the mask): its dq is exactly 0, and a key that only such rows see gets dk exactly 0;
    the rest matches the float64 reference. Head dim 128 with 16-bit inputs: the Hopper kernels'
    masked backward, where the GPU has them."""
    device = path.device
    batch, heads_q, heads_kv, len_q, len_k, dim = 2, 4, 2, 200, 300, 128
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(batch, heads, n, dim, generator=gen, dtype=torch.float64)
               for heads, n in ((heads_q, len_q), (heads_kv, len_k), (heads_kv, len_k)))
    dout = torch.randn(batch, heads_q, len_q, dim, generator=gen, dtype=torch.float64)
    mask, lone = one_key_mask(kind, batch, len_q, len_k, dtype, gen)
    leaves = [t.to(dtype).to(device).requires_grad_() for t in (q, k, v)]
    with deterministic_algorithms(path.name == "deterministic"):
        out = flashattn_ext.scaled_dot_product_attention(*leaves, attn_mask=mask.to(device), enable_gqa=True)
        dq, dk, dv = torch.autograd.grad(out, leaves, dout.to(dtype).to(device))
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


@on_paths("cpu", "cuda")
@pytest.mark.parametrize("mask_name", list(MASKS))
def test_attn_mask_matches_sdpa(mask_name, path):
    """Bool and float masks of broadcast shapes, read in place; the float mask's gradient too."""
    device = path.device
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


@on_paths("cuda", "deterministic")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mask_name", list(KERNEL_MASKS))
def test_cuda_kernels_read_masks(mask_name, dtype, head_dim, path):
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

    with deterministic_algorithms(path.name == "deterministic"):
        got = run(flashattn_ext.scaled_dot_product_attention, q, k, v, mask)
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


@on_paths("cpu", "cuda")
@pytest.mark.parametrize("variant", ["upper_left", "lower_right"])
def test_causal_bias_objects_match_sdpa(variant, path):
    q, k, v = random_qkv((1, 2, 40, 16), (1, 2, 100, 16), (1, 2, 100, 16), torch.float64, path.device)
    causal = getattr(sdpa_bias, f"causal_{variant}")(40, 100)
    out = flashattn_ext.scaled_dot_product_attention(q, k, v, attn_mask=causal)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
    torch.testing.assert_close(out, want)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected)


@on_paths("cpu", "cuda")
def test_rows_a_mask_hides_entirely_give_zero(path):
    """A bool mask that hides every key of some rows: those rows get 0, as in torch SDPA, and finite gradients."""
    device = path.device
    q, k, v = random_qkv((1, 2, 20, 8), (1, 2, 30, 8), (1, 2, 30, 8), torch.float64, device)
    mask = random_mask((20, 30), torch.bool, seed=3).to(device)
    mask[[0, 7, 19]] = False
    out, lse = flashattn_ext.attention_with_lse(q, k, v, attn_mask=mask)
    assert (out[:, :, [0, 7, 19]] == 0).all() and torch.isneginf(lse[:, :, [0, 7, 19]]).all()
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


# The Hopper kernels with a mask (path sm90): attn_mask tiles staged beside K (forward) or Q (backward);
# helpers.random_attn_mask draws the masks of MASK_CASES.
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


@on_paths("sm90")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", MASK_CASES)
@pytest.mark.parametrize("shape", MASK_SHAPES, ids=["x".join(map(str, s)) for s in MASK_SHAPES])
def test_forward_with_attn_mask_matches_float64(path, shape, case, dtype, monkeypatch):
    """The Hopper forward takes bool and float masks of every broadcast form, read through the copy
    engine beside K: out and lse against float64, every element written. (FLASHATTN_EXT_KERNELS=dense:
    the one-query shape with a bool mask would run the decode kernels, tested in test_decode_route.py.)"""
    monkeypatch.setenv("FLASHATTN_EXT_KERNELS", "dense")
    q, k, v = random_inputs(shape, dtype, seed=hash(shape) % 1000 + 2)
    mask = random_attn_mask(case, shape, dtype, seed=len(case))
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


# The Hopper backward with a mask: head dims 128 and 64 (64-query tiles and 128-query ones), 112
# and 40 (padded), GQA, ragged query and key blocks.
MASK_BACKWARD_SHAPES = [
    (1, 2, 2, 333, 1024, 128),
    (2, 4, 2, 200, 512, 112),
    (2, 24, 8, 130, 384, 128),
    (2, 4, 2, 200, 512, 64),
    (1, 6, 2, 259, 640, 40),
]


@on_paths("sm90")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", MASK_CASES)
@pytest.mark.parametrize("shape", MASK_BACKWARD_SHAPES, ids=["x".join(map(str, s)) for s in MASK_BACKWARD_SHAPES])
def test_backward_with_attn_mask_matches_float64(path, shape, case, dtype):
    """dq, dk, dv with a mask of every broadcast form within twice SDPA's own error of float64, the
    Hopper backward running where it takes the mask."""
    q, k, v = random_inputs(shape, dtype, seed=hash(shape) % 1000 + 3)
    mask = random_attn_mask(case, shape, dtype, seed=len(case) + 1, empty_batch=False)
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


@on_paths("sm90")
@pytest.mark.parametrize("lower_right", [False, True])
def test_forward_with_attn_mask_and_causal(path, lower_right):
    """The op itself takes a mask together with is_causal (the Python call, as SDPA, refuses both):
    the kernel hides what either hides."""
    shape = (2, 4, 4, 300, 512, 128)
    q, k, v = random_inputs(shape, torch.bfloat16, seed=4)
    mask = random_attn_mask("float_per_batch", shape, torch.bfloat16, seed=5).expand(2, 4, 300, 512)
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


@on_paths("sm90")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bfloat16_lowest_hides_as_minus_infinity(path, head_dim):
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


@on_paths("sm90")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mask_shape", ["batch_head", "batch", "shared", "batch_rows"])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape", KEY_BLOCK_SHAPES, ids=["x".join(map(str, s)) for s in KEY_BLOCK_SHAPES])
def test_forward_skips_the_tiles_a_mask_hides(path, shape, kind, mask_shape, causal, dtype):
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


@on_paths("sm90")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mask_shape", ["batch_head", "batch", "shared", "batch_rows"])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape", KEY_BLOCK_BACKWARD_SHAPES,
                         ids=["x".join(map(str, s)) for s in KEY_BLOCK_BACKWARD_SHAPES])
def test_backward_skips_the_tiles_a_mask_hides(path, shape, kind, mask_shape, causal, dtype):
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
