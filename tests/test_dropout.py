"""Dropout: the random numbers, their statistics, and the forward and backward against a
reference built from the very mask that the kernels used.

The mask comes from the dropout_mask op, given the rng_state that a call drew; that op is
itself checked against Philox4x32-10 written out here in numpy (with the published
known-answer vectors), so a wrong counter layout or threshold cannot hide behind a kernel
and a mask op that share it.
"""
import math

import numpy as np
import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

import flashattn_ext
from helpers import ERROR_FLOOR, POISON_BYTES, cuda_test, deterministic_algorithms, draw_rng_state, kernel_names, math_with_dropout_mask
from helpers import on_paths, poison_cuda_allocator, random_attn_mask, random_inputs, relative_error
from helpers import dropout_bits  # noqa: F401  (a fixture)

ops = torch.ops.flashattn_ext


def philox4x32_10(counter, key):
    """Philox4x32-10 of uint32 arrays counter (..., 4) and key (..., 2): Salmon et al. 2011."""
    c = [counter[..., i].astype(np.uint64) for i in range(4)]
    k0, k1 = key[..., 0].astype(np.uint64), key[..., 1].astype(np.uint64)
    mask32 = np.uint64(0xFFFFFFFF)
    for _ in range(10):
        p0, p1 = np.uint64(0xD2511F53) * c[0], np.uint64(0xCD9E8D57) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & mask32, (p0 >> np.uint64(32)) ^ c[3] ^ k1, p0 & mask32]
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & mask32, (k1 + np.uint64(0xBB67AE85)) & mask32
    return np.stack(c, axis=-1).astype(np.uint32)


def test_numpy_philox_matches_the_published_known_answers():
    cases = [  # (counter, key, output) from Random123's kat_vectors
        ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
        ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
        ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
         [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
    ]
    for counter, key, output in cases:
        got = philox4x32_10(np.array(counter, dtype=np.uint32), np.array(key, dtype=np.uint32))
        assert got.tolist() == output


def numpy_dropout_mask(seed, offset, bits, dropout_p, batch, heads, len_q, len_k):
    """The keep mask as csrc/dropout.h defines it, computed independently."""
    bh, q, k = np.meshgrid(np.arange(batch * heads), np.arange(len_q), np.arange(len_k), indexing="ij")
    quads_q, quads_k = (len_q + 15) // 16 * 4, (len_k + 15) // 16 * 4
    group = ((bh * quads_q + q // 16 * 4 + q % 8 // 2) * quads_k + k // 16 * 4 + k % 8 // 2).astype(np.uint64)
    qp, kp, qh, kh = q % 2, k % 2, (q % 16 >= 8).astype(np.int64), (k % 16 >= 8).astype(np.int64)
    if bits == 8:
        call, output, shift = group, qp * 2 + kp, 8 * (qh * 2 + kh)
    else:
        call, output, shift = group * np.uint64(2) + qp.astype(np.uint64), kp * 2 + qh, 16 * kh
    low = np.uint64(offset // 4)
    counter = np.stack([np.full_like(call, low & 0xFFFFFFFF), np.full_like(call, low >> 32),
                        call & np.uint64(0xFFFFFFFF), call >> np.uint64(32)], axis=-1).astype(np.uint32)
    key = np.broadcast_to(np.array([seed & 0xFFFFFFFF, seed >> 32], dtype=np.uint32), counter.shape[:-1] + (2,))
    words = philox4x32_10(counter, key)
    word = np.take_along_axis(words, output[..., None], axis=-1)[..., 0]
    number = (word >> shift.astype(np.uint32)) & np.uint32(2**bits - 1)
    return (number >= dropped_below(dropout_p, bits)).reshape(batch, heads, len_q, len_k)


def dropped_below(dropout_p, bits):
    """The threshold: numbers below round(p * 2^bits) are dropped."""
    return min(2**bits, int(dropout_p * 2**bits + 0.5))


def test_dropout_bits_setting():
    assert flashattn_ext.get_dropout_bits() == 8  # the default
    with pytest.raises(ValueError, match="8 or 16"):
        flashattn_ext.set_dropout_bits(12)
    assert flashattn_ext.get_dropout_bits() == 8


@on_paths("cpu", "cuda")
def test_mask_op_matches_numpy_philox(path, dropout_bits):
    device = path.device
    torch.manual_seed(11)
    for dropout_p, shape in ((0.3, (2, 3, 37, 29)), (0.875, (1, 2, 16, 70)), (0.6, (1, 1, 50, 40)), (1.0, (1, 1, 5, 6))):
        rng_state = draw_rng_state(device, dropout_p)
        seed, offset, bits = (int(x) % 2**64 for x in rng_state.tolist())
        assert bits == dropout_bits
        want = numpy_dropout_mask(seed, offset, bits, dropout_p, *shape)
        got = ops.dropout_mask(rng_state, dropout_p, *shape, 0, shape[2])
        assert np.array_equal(got.cpu().numpy(), want), (device, dropout_p, shape)
        # Row ranges that start and end inside a group, across groups and across blocks of 16 queries.
        for begin, end in ((3, 11), (7, 9), (8, 24), (15, 33), (17, shape[2])):
            begin, end = min(begin, shape[2]), min(end, shape[2])
            assert torch.equal(ops.dropout_mask(rng_state, dropout_p, *shape, begin, end), got[:, :, begin:end])


@on_paths("cpu", "cuda")
def test_kept_fraction_and_independence(path, dropout_bits):
    device = path.device
    torch.manual_seed(0)
    for dropout_p in (0.1, 0.5, 0.9):
        mask = ops.dropout_mask(draw_rng_state(device, dropout_p), dropout_p, 2, 4, 128, 256, 0, 128).double()
        n = mask.numel()
        # The kept fraction within 5 standard deviations of 1 - p, p as the numbers' bits round it.
        dropped = dropped_below(dropout_p, dropout_bits) / 2**dropout_bits
        assert abs(dropped - dropout_p) <= 2**-(dropout_bits + 1)
        assert abs(mask.mean().item() - (1 - dropped)) < 5 * math.sqrt(dropped * (1 - dropped) / n)
        # Neighbours (the same Philox call, or the next one) are uncorrelated.
        for a, b in ((mask[..., :-1], mask[..., 1:]), (mask[..., :-8, :], mask[..., 8:, :]),
                     (mask[..., :-1, :], mask[..., 1:, :])):
            covariance = ((a - a.mean()) * (b - b.mean())).mean().item()
            assert abs(covariance) < 5 * dropout_p * (1 - dropout_p) / math.sqrt(a.numel())
    # Two calls draw different masks; the same seed draws the same one again.
    first, second = draw_rng_state(device, 0.5), draw_rng_state(device, 0.5)
    masks = [ops.dropout_mask(s, 0.5, 1, 2, 64, 64, 0, 64) for s in (first, second)]
    assert not torch.equal(*masks)
    torch.manual_seed(5)
    again = ops.dropout_mask(draw_rng_state(device, 0.5), 0.5, 1, 2, 64, 64, 0, 64)
    torch.manual_seed(5)
    assert torch.equal(again, ops.dropout_mask(draw_rng_state(device, 0.5), 0.5, 1, 2, 64, 64, 0, 64))


@on_paths("cpu", "cuda")
def test_backward_draws_what_its_forward_drew(path):
    """A forward with 16-bit numbers, the setting changed to 8 before its backward: the backward
    still drops what the forward dropped (its rng_state records the bits)."""
    device = path.device
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    q, k, v = (torch.randn(1, 2, 48, 64, device=device, dtype=dtype) for _ in range(3))
    grad_out = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    before = flashattn_ext.get_dropout_bits()
    flashattn_ext.set_dropout_bits(16)
    try:
        torch.manual_seed(2)
        out = flashattn_ext.scaled_dot_product_attention(*leaves, dropout_p=0.3)
        torch.manual_seed(2)
        rng_state = draw_rng_state(device, 0.3)
    finally:
        flashattn_ext.set_dropout_bits(before)
    assert flashattn_ext.get_dropout_bits() != 16
    got = (out.detach(), *torch.autograd.grad(out, leaves, grad_out))
    keep = ops.dropout_mask(rng_state, 0.3, 1, 2, 48, 48, 0, 48)
    want = reference_with_mask(q, k, v, keep, 0.3, grad_out)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert relative_error(g, w) < (1e-12 if dtype == torch.float64 else 2e-2), name


def reference_with_mask(q, k, v, keep, dropout_p, grad_out, attn_mask=None, **kwargs):
    """torch's math SDPA in float64 given the dropout mask (its testing hook): out and gradients
    (a float attn_mask in float64 too)."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    if isinstance(attn_mask, torch.Tensor) and attn_mask.is_floating_point():
        attn_mask = attn_mask.double()
    out = math_with_dropout_mask(*leaves, keep, dropout_p, attn_mask=attn_mask, **kwargs)
    return (out.detach(), *torch.autograd.grad(out, leaves, grad_out.double()))


def ours_and_mask(q, k, v, dropout_p, grad_out, seed, **kwargs):
    """Our out and gradients under torch.manual_seed(seed), and the keep mask that call used."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(seed)
    out = flashattn_ext.scaled_dot_product_attention(*leaves, dropout_p=dropout_p, **kwargs)
    got = (out.detach(), *torch.autograd.grad(out, leaves, grad_out))
    torch.manual_seed(seed)
    batch, heads, len_q, len_k = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    keep = ops.dropout_mask(draw_rng_state(q.device, dropout_p), dropout_p, batch, heads, len_q, len_k, 0, len_q)
    return got, keep


def check_against_mask_reference(q, k, v, dropout_p, seed=0, **kwargs):
    grad_out = torch.randn(q.shape[:-1] + v.shape[-1:], device=q.device, dtype=q.dtype)
    got, keep = ours_and_mask(q, k, v, dropout_p, grad_out, seed, **kwargs)
    want = reference_with_mask(q, k, v, keep, dropout_p, grad_out, **kwargs)
    # The budget: torch's math SDPA in the inputs' dtype with the same mask, twice, plus a floor.
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    baseline_out = math_with_dropout_mask(*leaves, keep, dropout_p, **kwargs)
    baseline = (baseline_out.detach(), *torch.autograd.grad(baseline_out, leaves, grad_out))
    scale = max(w.abs().max().item() for w in want)
    floor = 1e-12 if q.dtype == torch.float64 else ERROR_FLOOR[q.dtype]
    for name, g, b, w in zip(("out", "dq", "dk", "dv"), got, baseline, want):
        assert torch.isfinite(g).all(), name
        error, sdpa_error = relative_error(g, w, zero_scale=scale), relative_error(b, w, zero_scale=scale)
        assert error <= 2 * sdpa_error + floor, f"{name}: {error:.3g} vs torch's {sdpa_error:.3g} ({q.shape}, {kwargs})"
    return got, keep


CPU_CASES = [
    # (dtype, (batch, heads_q, heads_kv, len_q, len_k, head_dim), dropout_p, kwargs)
    (torch.float64, (2, 2, 2, 19, 33, 8), 0.3, {}),
    (torch.float32, (1, 4, 2, 40, 17, 16), 0.5, {"is_causal": True, "enable_gqa": True}),
    (torch.bfloat16, (1, 2, 2, 70, 70, 32), 0.2, {}),
    (torch.float16, (2, 1, 1, 33, 65, 24), 0.7, {"scale": 0.3}),
]


@pytest.mark.parametrize("dtype,shape,dropout_p,kwargs", CPU_CASES, ids=lambda x: str(x))
def test_cpu_matches_reference_built_from_its_mask(dtype, shape, dropout_p, kwargs, dropout_bits):
    batch, heads_q, heads_kv, len_q, len_k, dim = shape
    q = torch.randn(batch, heads_q, len_q, dim, dtype=dtype)
    k, v = (torch.randn(batch, heads_kv, len_k, dim, dtype=dtype) for _ in range(2))
    _, keep = check_against_mask_reference(q, k, v, dropout_p, **kwargs)
    assert 0 < keep.float().mean().item() < 1


@on_paths("cpu", "cuda")
def test_dropout_one_gives_zeros_and_zero_gradients(path):
    q, k, v = (torch.randn(1, 2, 20, 16, device=path.device, requires_grad=True) for _ in range(3))
    out = flashattn_ext.scaled_dot_product_attention(q, k, v, dropout_p=1.0)
    assert torch.equal(out, torch.zeros_like(out))
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


@on_paths("cpu", "cuda")
def test_dropout_with_a_mask_and_causal_bias(path):
    """Dropout composes with attn_mask (tensor and CausalBias), compared with the math backend."""
    device = path.device
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 2, 24, 8, device=device, dtype=torch.float64) for _ in range(3))
    bool_mask = torch.rand(24, 24, device=device) > 0.3
    bool_mask[:, 0] = True
    check_against_mask_reference(q, k, v, 0.4, attn_mask=bool_mask)
    got, keep = ours_and_mask(q, k, v, 0.4, torch.ones_like(q), 1, attn_mask=causal_lower_right(24, 24))
    want = reference_with_mask(q, k, v, keep, 0.4, torch.ones_like(q), is_causal=True)
    for g, w in zip(got, want):
        assert relative_error(g, w) < 1e-12


CUDA_CASES = [
    # The fast kernels: several key and query tiles, ragged ends, GQA, causal, both dtypes, every
    # specialized head dim; the fallback (float32, odd head dim).
    (torch.bfloat16, (2, 4, 2, 300, 257, 128), 0.2, {"enable_gqa": True}),
    (torch.float16, (1, 2, 2, 200, 200, 64), 0.5, {"is_causal": True}),
    (torch.bfloat16, (1, 2, 2, 129, 333, 96), 0.1, {}),
    (torch.float16, (1, 2, 1, 150, 90, 256), 0.3, {"enable_gqa": True, "is_causal": True}),
    (torch.bfloat16, (1, 2, 2, 77, 77, 40), 0.6, {"scale": 0.2}),
    (torch.float32, (1, 2, 2, 70, 65, 20), 0.3, {}),
]


@on_paths("cuda", "deterministic")
@pytest.mark.parametrize("dtype,shape,dropout_p,kwargs", CUDA_CASES, ids=lambda x: str(x))
def test_cuda_matches_reference_built_from_its_mask(dtype, shape, dropout_p, kwargs, path, dropout_bits):
    batch, heads_q, heads_kv, len_q, len_k, dim = shape
    q = torch.randn(batch, heads_q, len_q, dim, dtype=dtype, device="cuda")
    k, v = (torch.randn(batch, heads_kv, len_k, dim, dtype=dtype, device="cuda") for _ in range(2))
    with deterministic_algorithms(path.name == "deterministic"):
        _, keep = check_against_mask_reference(q, k, v, dropout_p, **kwargs)
    kept, dropped = keep.float().mean().item(), dropped_below(dropout_p, dropout_bits) / 2**dropout_bits
    assert abs(kept - (1 - dropped)) < 5 * math.sqrt(dropped * (1 - dropped) / keep.numel())


@cuda_test
def test_cuda_dropout_under_graph_capture():
    """Replays of a captured graph draw fresh masks (the generator's offset advances in device
    memory), and each replay's backward regenerates that replay's mask."""
    q, k, v = (torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def step():
        out = flashattn_ext.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
        return (out, *torch.autograd.grad(out.sum(), (q, k, v)))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    outs = []
    for _ in range(2):
        graph.replay()
        outs.append([t.clone() for t in static])
    assert not torch.equal(outs[0][0], outs[1][0])
    for out, dq, dk, dv in outs:
        assert torch.isfinite(out).all() and torch.isfinite(dq).all()
        # With dO = 1, dV = (P * Z)^T 1, so sum(dV * V) = sum((P * Z) V) = sum(out): true only
        # if the backward dropped what this replay's forward dropped.
        torch.testing.assert_close((dv.double() * v.double()).sum(), out.double().sum(), rtol=2e-2, atol=1e-1)


# Dropout in the Hopper kernels (path sm90), with the mma.sync kernels' random numbers.
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


@on_paths("sm90")
@pytest.mark.parametrize("mode", ["full", "causal"])
@pytest.mark.parametrize("shape", DROPOUT_SHAPES, ids=["x".join(map(str, s)) for s in DROPOUT_SHAPES])
def test_dropout_matches_reference_built_from_its_mask(path, shape, mode, dropout_bits):
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


@on_paths("sm90")
def test_dropout_agrees_with_the_sm80_kernels(path, monkeypatch, dropout_bits):
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


# Dropout with a mask runs in the Hopper kernels: head dims 64 (the backward's 128-query tiles) and
# 128, GQA, ragged blocks.
MASKED_DROPOUT_SHAPES = [(2, 4, 2, 200, 512, 64), (1, 4, 2, 333, 640, 128)]


@on_paths("sm90")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ["key_padding_bool", "bool_per_batch", "float_per_head"])
@pytest.mark.parametrize("shape", MASKED_DROPOUT_SHAPES, ids=["x".join(map(str, s)) for s in MASKED_DROPOUT_SHAPES])
def test_dropout_with_attn_mask_matches_reference_built_from_its_mask(path, shape, case, dtype):
    """Dropout and an attn_mask together run in the Hopper forward and backward, and drop what
    dropout_mask says: out and gradients within twice torch's math SDPA's error (the same mask and
    drops, in the inputs' dtype) of float64."""
    q, k, v = random_inputs(shape, dtype, seed=hash(shape) % 1000 + 4)
    mask = random_attn_mask(case, shape, dtype, seed=len(case) + 2, empty_batch=False)
    kwargs = {"enable_gqa": shape[1] != shape[2]}
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    names = kernel_names(lambda: flashattn_ext.scaled_dot_product_attention(
        *leaves, attn_mask=mask, dropout_p=0.2, **kwargs).sum().backward())
    assert any("sm90" in n and "attention_forward_kernel" in n for n in names), names
    assert any("sm90" in n and "attention_backward_kernel" in n for n in names), names
    poison_cuda_allocator(POISON_BYTES)
    check_against_mask_reference(q, k, v, 0.2, seed=13, attn_mask=mask, **kwargs)
