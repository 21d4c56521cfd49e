"""FP8 attention (scaled_dot_product_attention_fp8, and aten's flash `.quantized` overloads with flashattn_ext
active): float8_e4m3fn query, key and value with descales a (sequence, key/value head), against a float64
reference on the dequantized tensors; 16-bit inputs quantized inside, and their gradients; the arguments'
checks."""
import math

import pytest
import torch

import flashattn_ext
from flashattn_ext.fp8 import hadamard_rotation, quantize_fp8, scaled_dot_product_attention_fp8
from helpers import (POISON_BYTES, dtype_name, kernel_names, naive_attention, on_paths, on_paths_each,
                     poison_cuda_allocator, relative_error)

FP8 = torch.float8_e4m3fn
# The error allowed relative to the output's scale: the output's bfloat16 rounding (CUDA: also the
# dequantized operands', each rounded once to bfloat16 until the kernels take e4m3 themselves).
OUT_TOLERANCE = {"cpu": 8e-3, "cuda": 1.6e-2}


def fp8_inputs(batch, heads_q, heads_kv, len_q, len_k, dim, gen, device):
    """e4m3 tensors of values spread over e4m3's range, and random descales (batch, heads_kv)."""
    def e4m3(*shape):
        return (torch.randn(*shape, generator=gen) * 40).clamp(-448, 448).to(FP8).to(device)

    q, k, v = e4m3(batch, heads_q, len_q, dim), e4m3(batch, heads_kv, len_k, dim), e4m3(batch, heads_kv, len_k, dim)
    descales = [(torch.rand(batch, heads_kv, generator=gen) * 0.02 + 0.005).to(device) for _ in range(3)]
    return q, k, v, descales


def dequantize(x, descale):
    """x (B, H, L, E) in float64 times descale (B, H_kv), each head by its key/value head's."""
    group = x.shape[1] // descale.shape[1]
    return x.double().cpu() * descale.double().cpu().repeat_interleave(group, dim=1)[:, :, None, None]


@on_paths("cpu", "cuda")
@pytest.mark.parametrize("heads_q, heads_kv", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("len_q, len_k, is_causal, window", [(33, 33, False, None), (17, 40, True, None),
                                                             (40, 40, True, (8, 0))],
                         ids=["plain", "causal", "window"])
def test_matches_float64_over_the_dequantized_inputs(path, heads_q, heads_kv, len_q, len_k, is_causal, window):
    gen = torch.Generator().manual_seed(11)
    q, k, v, (qd, kd, vd) = fp8_inputs(2, heads_q, heads_kv, len_q, len_k, 32, gen, path.device)
    out = flashattn_ext.scaled_dot_product_attention_fp8(q, k, v, is_causal=is_causal, q_descale=qd,
                                                         k_descale=kd, v_descale=vd, window=window)
    want, _ = naive_attention(dequantize(q, qd), dequantize(k, kd), dequantize(v, vd), is_causal=is_causal,
                              enable_gqa=True, window=window)
    assert out.dtype == torch.bfloat16 and out.shape == want.shape and out.device.type == path.device
    assert relative_error(out.cpu(), want) <= OUT_TOLERANCE[path.name]


def test_lse_and_default_descales():
    """The op's lse is the float64 one to float32's precision (the CPU computes in float32); no descale means
    1."""
    gen = torch.Generator().manual_seed(12)
    q, k, v, _ = fp8_inputs(1, 2, 2, 9, 12, 16, gen, "cpu")
    scale = 0.01
    out, lse = torch.ops.flashattn_ext.attention_forward_fp8(q, k, v, None, None, None, False, False, scale)
    want_out, want_lse = naive_attention(q.double(), k.double(), v.double(), scale=scale)
    assert relative_error(out, want_out) <= OUT_TOLERANCE["cpu"]
    assert lse.dtype == torch.float32
    assert ((lse.double() - want_lse).abs() / (1 + want_lse.abs())).max().item() <= 1e-6


@on_paths("cpu", "cuda")
@pytest.mark.parametrize("rotate", [False, True], ids=["plain", "hadamard"])
def test_quantize_per_block_and_rotated(path, rotate):
    """quantize_fp8's block descales (one a 128 rows: lengths of 1 block, 2 ragged ones) through the op, with
    queries and keys rotated alike by hadamard_rotation or not: exactly (to the output's rounding) the
    attention of what the e4m3 values times their blocks' descales stand for. (How close that is to the
    unquantized inputs' attention, method by method: benchmarks/fp8_accuracy.py.)"""
    gen = torch.Generator().manual_seed(16)
    q, k, v = (torch.randn(1, 4, length, 64, generator=gen, dtype=torch.float64) for length in (100, 300, 300))
    k, v = k[:, :2], v[:, :2]
    if rotate:
        rotation = hadamard_rotation(64, generator=gen).double()
        q_in, k_in = q @ rotation, k @ rotation
    else:
        q_in, k_in = q, k
    quantized = [quantize_fp8(x.to(path.device), heads_kv=2, per_block=True) for x in (q_in, k_in, v)]
    assert [tuple(d.shape) for _, d in quantized] == [(1, 2, 1), (1, 2, 3), (1, 2, 3)]
    (q8, qd), (k8, kd), (v8, vd) = quantized
    out = scaled_dot_product_attention_fp8(q8, k8, v8, is_causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    rows = lambda d, n: d.double().cpu().repeat_interleave(128, dim=2)[:, :, None, :n, None]  # noqa: E731
    exact, _ = naive_attention(*((x8.double().cpu().view(1, 2, -1, n, 64) * rows(d, n)).view(x8.shape)
                                 for x8, d, n in ((q8, qd, 100), (k8, kd, 300), (v8, vd, 300))),
                               is_causal=True, enable_gqa=True)
    assert relative_error(out.cpu(), exact) <= OUT_TOLERANCE[path.name]


def test_hadamard_rotation_is_orthogonal():
    rotation = hadamard_rotation(128, generator=torch.Generator().manual_seed(17)).double()
    assert torch.allclose(rotation @ rotation.T, torch.eye(128, dtype=torch.float64), atol=1e-6)
    with pytest.raises(ValueError, match="power-of-two dim"):
        hadamard_rotation(96)


def test_quantize_saturates_to_the_largest_value():
    """Each block's largest magnitude becomes e4m3's 448 (so the descale is exactly largest / 448), and every
    other value is within half an e4m3 step (a relative 2^-4) of x / descale."""
    gen = torch.Generator().manual_seed(18)
    x = torch.randn(2, 3, 200, 16, generator=gen) * torch.rand(2, 3, 1, 1, generator=gen) * 50
    x8, descale = quantize_fp8(x, per_block=True)
    assert descale.shape == (2, 3, 2)
    largest = torch.stack([x[:, :, :128].abs().amax(dim=(2, 3)), x[:, :, 128:].abs().amax(dim=(2, 3))], dim=2)
    assert torch.allclose(descale, largest / 448)
    scaled = x / descale.repeat_interleave(128, dim=2)[:, :, :200, None]
    assert (x8.float() - scaled).abs().le(scaled.abs() * 2**-4 + 2**-10).all()
    assert x8.float().abs().amax() == 448
    empty = torch.zeros(1, 2, 0, 8)
    assert [tuple(t.shape) for t in quantize_fp8(empty, per_block=True)] == [(1, 2, 0, 8), (1, 2, 0)]


def _call(**changes):
    gen = torch.Generator().manual_seed(13)
    q, k, v, (qd, kd, vd) = fp8_inputs(2, 4, 2, 5, 6, 8, gen, "cpu")
    arguments = {"query": q, "key": k, "value": v, "q_descale": qd, "k_descale": kd, "v_descale": vd}
    arguments.update(changes)
    return lambda: flashattn_ext.scaled_dot_product_attention_fp8(**arguments)


@on_paths("cuda")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_name)
@pytest.mark.parametrize("dim", [72, 36], ids=["vectors", "elements"])
def test_quantize_kernels_match_aten(path, dtype, dim):
    """CUDA's quantize_fp8 and dequantize_fp8 kernels (16-bit, one descale a (sequence, key/value head)) give
    the ATen path's bits (the CPU's), on a sequence-major view, GQA groups, ragged rows and a zero head; head
    dim 72 in vectors of 8 elements, 36 element by element."""
    gen = torch.Generator().manual_seed(24)
    x = torch.randn(2, 45, 6, dim, generator=gen) * torch.rand(2, 1, 6, 1, generator=gen) * 30
    x[1, :, 2:4] = 0  # key/value head (1, 1): all zeros, its descale the smallest normal
    x = x.to(dtype)
    seq_major = x.to(path.device).transpose(1, 2)  # (2, 6, 45, 72), strides of a (B, L, H, E) tensor
    got, got_descale = quantize_fp8(seq_major, heads_kv=3)
    want, want_descale = quantize_fp8(seq_major.cpu(), heads_kv=3)
    assert got.dtype == FP8 and got_descale.shape == (2, 3)
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(got_descale.cpu(), want_descale)
    for out_dtype in (torch.bfloat16, torch.float16):
        back = torch.ops.flashattn_ext.dequantize_fp8(got.transpose(1, 2), got_descale, out_dtype)
        want_back = torch.ops.flashattn_ext.dequantize_fp8(want.transpose(1, 2), want_descale, out_dtype)
        assert back.dtype == out_dtype and torch.equal(back.cpu(), want_back)


def _op_call(query):
    gen = torch.Generator().manual_seed(13)
    _, k, v, _ = fp8_inputs(2, 4, 2, 5, 6, 8, gen, "cpu")
    return lambda: torch.ops.flashattn_ext.attention_forward_fp8(query, k, v, None, None, None, False, False, 0.5)


@pytest.mark.parametrize("call, exception, message", [
    (_op_call(torch.zeros(2, 4, 5, 8, dtype=torch.bfloat16)), TypeError, "query as float8_e4m3fn"),
    (_call(value=torch.zeros(2, 2, 6, 8)), TypeError, "all in float8_e4m3fn, or all in one of bfloat16"),
    (_call(query=torch.zeros(2, 4, 5, 8, dtype=torch.int8), key=torch.zeros(2, 2, 6, 8, dtype=torch.int8),
           value=torch.zeros(2, 2, 6, 8, dtype=torch.int8)), TypeError, "got torch.int8"),
    (_call(query=torch.zeros(2, 4, 5, 8), key=torch.zeros(2, 2, 6, 8), value=torch.zeros(2, 2, 6, 8)), ValueError,
     "quantizes 16-bit inputs itself"),
    (_call(k_descale=torch.ones(2, 4)), RuntimeError, r"k_descale must be \(batch, key/value heads\)"),
    (_call(q_descale=torch.ones(2, 2, 2)), RuntimeError, r"one a block of 128 rows \(2, 2, 1\)"),
    (_call(v_descale=torch.ones(2, 2, dtype=torch.float64)), TypeError, "v_descale must be float32"),
    (_call(key=torch.zeros(2, 3, 6, 8).to(FP8), value=torch.zeros(2, 3, 6, 8).to(FP8)), RuntimeError,
     "must divide the 4 query heads"),
    (_call(window=(1,)), ValueError, "window must be a pair"),
    (_call(value=torch.zeros(1, 2, 6, 8).to(FP8)), RuntimeError, r"must have query's batch \(2\)"),
], ids=["query-dtype", "mixed-dtypes", "int-dtype", "descales-with-16-bit", "descale-shape", "block-descale-shape", "descale-dtype", "heads", "window",
        "batch"])
def test_bad_arguments(call, exception, message):
    with pytest.raises(exception, match=message):
        call()


@on_paths("cpu", "cuda")
def test_opcheck(path):
    gen = torch.Generator().manual_seed(14)
    q, k, v, (qd, kd, vd) = fp8_inputs(2, 4, 2, 5, 7, 16, gen, path.device)
    # (not test_schema: torch's schema check compares the inputs with a multiply, which float8 lacks)
    torch.library.opcheck(torch.ops.flashattn_ext.attention_forward_fp8.default,
                          (q, k, v, qd, kd, vd, True, True, 0.25), test_utils=("test_faketensor",))
    torch.library.opcheck(torch.ops.flashattn_ext.dequantize_fp8.default, (q, qd, torch.bfloat16),
                          test_utils=("test_faketensor",))
    x = torch.randn(2, 4, 5, 16, generator=gen).to(torch.bfloat16).to(path.device)
    for per_block in (False, True):
        torch.library.opcheck(torch.ops.flashattn_ext.quantize_fp8.default, (x, 2, per_block),
                              test_utils=("test_faketensor",))
    wide = [torch.randn(2, h, 9, 16, generator=gen).to(torch.bfloat16).to(path.device).requires_grad_()
            for h in (4, 2, 2)]
    # (test_schema compares the inputs with a multiply, which the float8 tensors inside lack)
    torch.library.opcheck(torch.ops.flashattn_ext.attention_forward_quantized.default, (*wide, True, False, 0.25),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    out, lse = torch.ops.flashattn_ext.attention_forward_fp8(q, k, v, qd, kd, vd, True, True, 0.25)
    grad_out = torch.randn(out.shape, generator=gen).to(out)
    torch.library.opcheck(torch.ops.flashattn_ext.attention_backward_fp8.default,
                          (grad_out, q, k, v, out, lse, qd, kd, vd, True, True, 0.25), test_utils=("test_faketensor",))


def gradients_through_quantization(q, k, v, grad_out, delta_from=None, **options):
    """float64 (dq, dk, dv) of attention over quantize_fp8's dequantized q, k, v (one descale a (sequence,
    key/value head)). With delta_from, the tensors are the backward's on CUDA, rounded to bfloat16, and its
    delta = rowsum(grad_out * O) takes delta_from for O, as the GPU backwards take the forward's out (the
    CPU's backward computes in float32 and sums delta from P and dP, the exact one): since
    d lse_i / d s_ij = p_ij, that is the gradient of sum(grad_out * O) - sum_i c_i lse_i, with
    c_i = rowsum(grad_out * (delta_from - O))_i held constant, O the exact output."""
    heads_kv = k.shape[1]
    leaves = []
    for x in (q, k, v):
        dequantized = dequantize(*quantize_fp8(x.detach().cpu().float(), heads_kv))
        if delta_from is not None:
            dequantized = dequantized.to(torch.bfloat16).double()
        leaves.append(dequantized.requires_grad_())
    exact, lse = naive_attention(*leaves, enable_gqa=True, **options)
    grad_out = grad_out.detach().cpu().double()
    loss = (exact * grad_out).sum()
    if delta_from is not None:
        loss = loss - (lse * (grad_out * (delta_from.detach().cpu().double() - exact.detach())).sum(-1)).sum()
    loss.backward()
    return [x.grad for x in leaves]


@on_paths_each("dim", {"cpu": [32], "cuda": [32], "sm90": [128]})
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_name)
@pytest.mark.parametrize("heads_q, heads_kv, len_q, len_k, is_causal, window", [
    (4, 4, 33, 33, False, None), (8, 2, 150, 200, True, None), (4, 2, 40, 40, True, (8, 0))],
    ids=["mha", "gqa-causal", "window"])
def test_trainable_16_bit_inputs(path, dim, dtype, heads_q, heads_kv, len_q, len_k, is_causal, window):
    """16-bit inputs: quantized per (sequence, key/value head) (the same bits as quantize_fp8), the output in
    their dtype, and their gradients those of attention over the dequantized tensors (straight through the
    quantization) against float64, within the 16-bit output's tolerance. sm90 at head dim 128 and no window:
    the e4m3 forward kernel."""
    gen = torch.Generator().manual_seed(23)
    q, k, v = (torch.randn(2, h, n, dim, generator=gen).to(dtype).to(path.device).requires_grad_()
               for h, n in ((heads_q, len_q), (heads_kv, len_k), (heads_kv, len_k)))
    grad_out = torch.randn(2, heads_q, len_q, dim, generator=gen).to(dtype).to(path.device)
    run = lambda: flashattn_ext.scaled_dot_product_attention_fp8(q, k, v, is_causal=is_causal, window=window)
    if path.name == "sm90" and window is None:  # (a window goes through the dequantize path)
        assert any("FwdFp8TileConfig" in n for n in kernel_names(run))
    out = run()
    out.backward(grad_out)
    assert out.dtype == dtype and all(x.grad.dtype == dtype for x in (q, k, v))
    options = {"is_causal": is_causal, "window": window}
    want_out, _ = naive_attention(*(dequantize(*quantize_fp8(x.detach().cpu().float(), heads_kv))
                                    for x in (q, k, v)), enable_gqa=True, **options)
    tolerance = OUT_TOLERANCE[path.name if path.name == "cpu" else "cuda"]
    if path.name != "sm90":  # (the e4m3 kernel's out error: test_native_kernel_matches_float64)
        assert relative_error(out.cpu(), want_out) <= tolerance
    wants = gradients_through_quantization(q, k, v, grad_out, None if path.name == "cpu" else out, **options)
    for name, x, want in zip(("dq", "dk", "dv"), (q, k, v), wants):
        assert relative_error(x.grad.cpu(), want) <= tolerance, name


@on_paths("cpu", "cuda")
def test_trainable_compiles_without_graph_breaks(path):
    """16-bit inputs under torch.compile(fullgraph=True): eager's out and gradients, bit for bit."""
    gen = torch.Generator().manual_seed(25)
    q, k, v = (torch.randn(2, h, 40, 32, generator=gen).to(torch.bfloat16).to(path.device).requires_grad_()
               for h in (4, 2, 2))

    def attention(q, k, v):
        return flashattn_ext.scaled_dot_product_attention_fp8(q, k, v, is_causal=True)

    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")
    grad_out = torch.randn(2, 4, 40, 32, generator=gen).to(torch.bfloat16).to(path.device)
    got = compiled(q, k, v)
    want = attention(q, k, v)
    assert torch.equal(got, want)
    for got_grad, want_grad in zip(torch.autograd.grad(got, (q, k, v), grad_out),
                                   torch.autograd.grad(want, (q, k, v), grad_out)):
        assert torch.equal(got_grad, want_grad)


@on_paths("cuda")
def test_torch_quantized_sdpa_runs_ours(path):
    """torch's experimental FP8 SDPA (aten's flash `.quantized` overload) with flashattn_ext active as torch's
    flash-attention implementation: our op's result, bottom-right causal as aten's flash ops align it."""
    from torch.nn.attention import activate_flash_attention_impl, restore_flash_attention_impl
    from torch.nn.attention.experimental._scaled_dot_product_attention_quantized import (
        _scaled_dot_product_attention_quantized)

    gen = torch.Generator().manual_seed(15)
    q, k, v, (qd, kd, vd) = fp8_inputs(2, 8, 2, 24, 40, 64, gen, "cuda")
    activate_flash_attention_impl("flashattn_ext")
    try:
        got = _scaled_dot_product_attention_quantized(q, k, v, is_causal=True, q_descale=qd, k_descale=kd,
                                                      v_descale=vd)
    finally:
        restore_flash_attention_impl()
    want, _ = naive_attention(dequantize(q, qd), dequantize(k, kd), dequantize(v, vd), is_causal=True,
                              causal_lower_right=True, enable_gqa=True, scale=1 / math.sqrt(64))
    assert got.dtype == torch.bfloat16 and relative_error(got.cpu(), want) <= OUT_TOLERANCE["cuda"]


# The Hopper forward's e4m3 kernel (head dim 128, descales a (batch, key/value head)): S = Q K^T and O = P V
# in e4m3 wgmma, P rounded to e4m3 (exp(s - max) times 256, against each row's running max). That rounding
# alone costs 1-3e-2 of the output's scale on these inputs (flat rows: every probability rounded by up to
# 2^-4). float64 attention that rounds P the same way against the rows' final max measures it; the kernel
# rounds against running maxima, so its roundings differ but are as large. Its error against float64 may
# exceed that rounding's by a quarter, plus twice bfloat16's rounding of the output (2^-8 of its scale): a
# wrong layout or lost keys cost O(1). Its lse (float32 sums of the unrounded P) is held to float64's within
# twice the dequantize path's error plus a floor, in natural-log units.
NATIVE_ROUNDING_SLACK, NATIVE_OUT_FLOOR, NATIVE_LSE_FLOOR = 1.25, 2.0 ** -8, 1e-3


def attention_with_e4m3_probabilities(q, k, v, is_causal, lower_right, scale):
    """float64 softmax(q k^T scale) v with exp(s - max) rounded to e4m3 at 256 in P V, each row's final max
    (rows that see no key: 0)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) * scale
    if is_causal:
        len_q, len_k = scores.shape[-2:]
        diagonal = len_k - len_q if lower_right else 0
        above = torch.arange(len_k)[None, :] > torch.arange(len_q)[:, None] + diagonal
        scores = scores.masked_fill(above, -math.inf)
    row_max = scores.amax(dim=-1, keepdim=True)
    p = torch.exp(scores - row_max.masked_fill(row_max.isinf(), 0))
    rounded = (p * 256).to(FP8).double() / 256
    return torch.nan_to_num((rounded @ v) / p.sum(dim=-1, keepdim=True))


def fp8_native_call(q, k, v, descales, is_causal, causal_lower_right):
    return lambda: torch.ops.flashattn_ext.attention_forward_fp8(q, k, v, *descales, is_causal, causal_lower_right,
                                                                 1 / math.sqrt(q.shape[-1]))


def block_descales(descale, length):
    """A (batch, heads_kv) descale as the same value on each block of 128 rows: the op's dequantize path."""
    return descale[:, :, None].expand(-1, -1, (length + 127) // 128).contiguous()


@on_paths("sm90")
@pytest.mark.parametrize("batch, heads_q, heads_kv, len_q, len_k, is_causal, lower_right", [
    (2, 4, 4, 256, 256, False, False), (1, 8, 2, 333, 700, False, False), (1, 8, 2, 333, 700, True, False),
    (1, 8, 2, 333, 700, True, True), (2, 2, 1, 700, 333, True, True), (1, 2, 2, 1, 129, False, False),
], ids=["mha", "gqa-ragged", "gqa-causal", "gqa-causal-lower-right", "causal-lower-right-unseen-rows", "one-row"])
def test_native_kernel_matches_float64(path, batch, heads_q, heads_kv, len_q, len_k, is_causal, lower_right):
    """The e4m3 kernel runs (profiler) and writes every element (NaN-poisoned memory beforehand); its out and
    lse against float64 attention over the dequantized inputs, within what rounding P to e4m3 costs. With
    lower-right alignment and more queries than keys, the first rows see no key: out 0, lse -inf."""
    gen = torch.Generator().manual_seed(21)
    q, k, v, descales = fp8_inputs(batch, heads_q, heads_kv, len_q, len_k, 128, gen, "cuda")
    native = fp8_native_call(q, k, v, descales, is_causal, lower_right)
    names = kernel_names(native)
    assert any("FwdFp8TileConfig" in n for n in names) and any("fp8_transpose_values" in n for n in names), names
    poison_cuda_allocator(POISON_BYTES)
    out, lse = native()
    qd, kd, vd = descales
    dequantized = fp8_native_call(q, k, v, (block_descales(qd, len_q), block_descales(kd, len_k),
                                            block_descales(vd, len_k)), is_causal, lower_right)
    assert not any("FwdFp8TileConfig" in n for n in kernel_names(dequantized))
    out_deq, lse_deq = dequantized()
    want, want_lse = naive_attention(dequantize(q, qd), dequantize(k, kd), dequantize(v, vd), is_causal=is_causal,
                                     causal_lower_right=lower_right, enable_gqa=True, scale=1 / math.sqrt(128))
    assert out.dtype == torch.bfloat16 and out.shape == want.shape and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    seen = want_lse.isfinite()
    assert torch.equal(lse.cpu().isfinite(), seen) and out.cpu()[~seen].eq(0).all()
    rounding_error = relative_error(attention_with_e4m3_probabilities(
        dequantize(q, qd), dequantize(k, kd), dequantize(v, vd), is_causal, lower_right, 1 / math.sqrt(128)), want)
    out_error = relative_error(out.cpu(), want)
    lse_error = (lse.cpu().double() - want_lse)[seen].abs().max().item()
    lse_error_deq = (lse_deq.cpu().double() - want_lse)[seen].abs().max().item()
    print(f"out error {out_error:.3e} (P's rounding alone {rounding_error:.3e}, the dequantize path "
          f"{relative_error(out_deq.cpu(), want):.3e}), lse error {lse_error:.3e} ({lse_error_deq:.3e})")
    assert out_error <= NATIVE_ROUNDING_SLACK * rounding_error + NATIVE_OUT_FLOOR
    assert lse_error <= 2 * lse_error_deq + NATIVE_LSE_FLOOR


@on_paths("sm90")
def test_native_kernel_leaves_what_it_does_not_take(path):
    """Head dim 64, block descales and a window go through the dequantize path."""
    gen = torch.Generator().manual_seed(22)
    q, k, v, (qd, kd, vd) = fp8_inputs(1, 2, 2, 64, 64, 64, gen, "cuda")
    assert not any("FwdFp8TileConfig" in n for n in kernel_names(fp8_native_call(q, k, v, (qd, kd, vd), True, False)))
    q, k, v, (qd, kd, vd) = fp8_inputs(1, 2, 2, 64, 64, 128, gen, "cuda")
    def windowed():
        return torch.ops.flashattn_ext.attention_forward_fp8(q, k, v, qd, kd, vd, True, False, 0.1, 8, 0)
    assert not any("FwdFp8TileConfig" in n for n in kernel_names(windowed))
