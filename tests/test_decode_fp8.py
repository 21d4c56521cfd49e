"""decode_attention on FP8 (float8_e4m3fn) caches with per-cache or per-head scales: the attention against
a float64 reference over the dequantized caches, the new keys and values quantized into the caches as
torch quantizes (round to nearest, saturated), and the arguments' checks."""
import math
import re

import pytest
import torch

import flashattn_ext
from helpers import POISON_BYTES, kernel_names, on_paths, on_paths_each, poison_cuda_allocator, relative_error
from test_decode import DECODE_CASES, fill_past_lengths, hopper_call_inputs, make_cache, reference

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# The queries' dtypes each path takes with an FP8 cache, and the error allowed relative to the output's
# scale: the cache is exact once dequantized (the reference reads the same values), so what is left is the
# queries' and output's own rounding (CUDA: also the dequantized copy's, in the queries' dtype).
QUERY_DTYPES = {"cpu": (torch.float32, torch.bfloat16, torch.float16), "cuda": (torch.bfloat16, torch.float16)}
TOLERANCE = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# Where CUDA reads a copy of the caches dequantized to the queries' dtype (head dims other than 128, GPUs
# before Hopper: decode_attention_cuda), each key is rounded to within this much of itself, so a score to
# within scale * sum_i |q_i k_i| times it, and the lse (a softmax-weighted mean of the scores) too.
UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def along_heads(scale, dims, heads_dim):
    """scale (one, or one a head) viewed to broadcast against a tensor of `dims` dims with heads at heads_dim."""
    shape = [1] * dims
    if scale.numel() > 1:
        shape[heads_dim] = -1
    return scale.view(shape)


def quantize(x, scale, heads_dim):
    """x as an FP8 cache holds it with these scales (one, or one a head along heads_dim): e4m3 of x / scale,
    saturated (torch's own conversion would make values past 480 NaN)."""
    return (x.float() / along_heads(scale, x.dim(), heads_dim)).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)


def dequantize(cache, scale, heads_dim):
    return cache.double() * along_heads(scale.double(), cache.dim(), heads_dim)


def fp8_problem(block_size, heads_kv, per_head, gen, capacity=40, dim=32, batch=3):
    """FP8 caches (values spread over e4m3's range) and their scales."""
    key_cache, value_cache, table = make_cache(batch, heads_kv, capacity, dim, dim, torch.float32, block_size, gen)
    heads_dim = 1 if block_size is None else 2
    scales = [torch.rand(heads_kv if per_head else 1, generator=gen) * 0.05 + 0.01 for _ in range(2)]
    if not per_head:
        scales = [s.reshape(()) for s in scales]
    # stored values of magnitude up to about 100 (of e4m3's 448), so that the scales matter
    key_cache, value_cache = (quantize(c * 30, s, heads_dim) for c, s in zip((key_cache, value_cache), scales))
    return key_cache, value_cache, table, scales, heads_dim


@pytest.mark.parametrize("block_size", [None, 16], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("per_head", [False, True], ids=["per_cache", "per_head"])
@pytest.mark.parametrize("len_q, is_causal, heads_q, heads_kv", [(1, False, 4, 4), (3, True, 8, 2)])
@on_paths_each("dtype", QUERY_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_matches_float64_over_the_dequantized_cache(block_size, per_head, len_q, is_causal, heads_q, heads_kv, dtype,
                                                     path):
    device = path.device
    gen = torch.Generator().manual_seed(3)
    key_cache, value_cache, table, (key_scale, value_scale), heads_dim = fp8_problem(block_size, heads_kv, per_head,
                                                                                     gen)
    lengths = [0, 21, 40]
    query = torch.randn(3, heads_q, len_q, 32, generator=gen, dtype=torch.float64).to(dtype)
    on = lambda t: None if t is None else t.to(device)  # noqa: E731
    out, lse = flashattn_ext.decode_attention(on(query), on(key_cache), on(value_cache), on(torch.tensor(lengths)),
                                              block_table=on(table), is_causal=is_causal, key_scale=on(key_scale),
                                              value_scale=on(value_scale), scale=0.02, return_lse=True)
    keys, values = dequantize(key_cache, key_scale, heads_dim), dequantize(value_cache, value_scale, heads_dim)
    want_out, want_lse = reference(query, keys, values, lengths, table, is_causal, 0.02)
    assert out.dtype == dtype and out.shape == want_out.shape
    assert relative_error(out.cpu(), want_out) <= TOLERANCE[dtype]
    seen = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), seen)
    copy_rounding = 0.0
    if device != "cpu":  # (head dim 32: the copy; any cached key bounds every row's sum)
        largest_sum = (query.double().abs().flatten(0, 2) @ keys.abs().flatten(0, -2).T).max().item()
        copy_rounding = 0.02 * largest_sum * UNIT_ROUNDOFF[dtype]
    assert (lse.cpu()[seen].double() - want_lse[seen]).abs().max().item() <= 1e-3 + copy_rounding


# The Hopper decode kernel's cases at head dim 128 (test_decode.py: up to 8 query rows a key/value head, where
# the keys are the mma's rows, but for paged blocks under 32 keys), 4 rows in blocks of 32 (two copies a stage),
# 12 rows (one row group) and 32 (two).
HOPPER_CASES = [case for case in DECODE_CASES if case[1] == 128] + [(32, 128, 2, 16, 4, 1, [700, 33], 768),
                                                                    (32, 128, 2, 8, 2, 3, [100, 500], 512),
                                                                    (16, 128, 2, 16, 4, 8, [900, 40], 1024)]


@on_paths("sm90")
@pytest.mark.parametrize("options", [{}, {"window": (100, 0)}, {"softcap": 20.0}, {"alibi": True}],
                         ids=["plain", "window", "softcap", "alibi"])
@pytest.mark.parametrize("case", HOPPER_CASES, ids=lambda c: f"paged{c[0]}-b{c[2]}-hq{c[3]}-lq{c[5]}")
@pytest.mark.parametrize("dtype, per_head", [(torch.bfloat16, True), (torch.float16, False)],
                         ids=["bfloat16-per_head", "float16-per_cache"])
def test_hopper_kernel_reads_fp8(path, case, options, dtype, per_head):
    """At head dim 128 the Hopper decode kernel reads the e4m3 caches itself (its FP8 tile config in
    the profiler, no dequantizing copy): against float64 over the dequantized caches, with the rows
    past each sequence's length NaN and the outputs on NaN-poisoned memory. The keys and values meet
    the tensor cores exactly (float16), so the lse is as close as the 16-bit caches' (test_decode.py)."""
    block_size, dim, batch, heads_q, heads_kv, len_q, lengths, capacity = case
    gen = torch.Generator().manual_seed(32)
    key_cache, value_cache, table, (key_scale, value_scale), heads_dim = fp8_problem(
        block_size, heads_kv, per_head, gen, capacity=capacity, dim=dim, batch=batch)
    for cache in (key_cache, value_cache):
        fill_past_lengths(cache.view(torch.uint8), lengths, table, 0x7F)  # e4m3 NaN
    query, options, on_cuda = hopper_call_inputs(batch, heads_q, len_q, dim, dtype, options, gen)

    def call():
        return flashattn_ext.decode_attention(query.cuda(), key_cache.cuda(), value_cache.cuda(),
                                              torch.tensor(lengths).cuda(), is_causal=len_q > 1,
                                              block_table=None if table is None else table.cuda(), scale=0.01,
                                              key_scale=key_scale.cuda(), value_scale=value_scale.cuda(),
                                              return_lse=True, **on_cuda)

    names = kernel_names(call)
    configs = [m.group(1) for n in names for m in [re.search(r"decode_kernel<.*DecodeTileConfig<128, \d, 1, (\w+)>", n)]
               if m]
    keys_as_rows = heads_q // heads_kv * len_q <= 8 and (block_size is None or block_size >= 32)
    assert configs == [str(keys_as_rows).lower()], names
    assert not any("elementwise" in n for n in names), names
    poison_cuda_allocator(POISON_BYTES)
    out, lse = call()
    want_out, want_lse = reference(query, dequantize(key_cache, key_scale, heads_dim),
                                   dequantize(value_cache, value_scale, heads_dim), lengths, table, len_q > 1, 0.01,
                                   **options)
    assert relative_error(out.cpu(), want_out) <= TOLERANCE[dtype]
    seen = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), seen)
    assert ((lse.cpu()[seen].double() - want_lse[seen]).abs() / (1 + want_lse[seen].abs())).max().item() <= 1e-4


@pytest.mark.parametrize("block_size", [None, 4], ids=["contiguous", "paged4"])
@pytest.mark.parametrize("per_head", [False, True], ids=["per_cache", "per_head"])
@on_paths_each("dtype", QUERY_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_new_keys_are_quantized_into_the_cache_then_seen(block_size, per_head, dtype, path):
    device = path.device
    gen = torch.Generator().manual_seed(4)
    key_cache, value_cache, table, (key_scale, value_scale), heads_dim = fp8_problem(block_size, 2, per_head, gen,
                                                                                     capacity=24, dim=16, batch=2)
    lengths, len_new = [5, 22], 2  # the second's new keys end at the cache's end
    key_new = torch.randn(2, 2, len_new, 16, generator=gen, dtype=torch.float64) * 3
    value_new = torch.randn(2, 2, len_new, 16, generator=gen, dtype=torch.float64) * 3
    key_new[0, 0, 0, :4] = torch.tensor([1e6, -1e6, math.inf, -math.inf])  # saturate to +-448, as .satfinite
    key_new, value_new = key_new.to(dtype), value_new.to(dtype)
    query = torch.randn(2, 4, 2, 16, generator=gen).to(dtype)
    want_key_cache, want_value_cache = key_cache.clone(), value_cache.clone()
    key_rows, value_rows = quantize(key_new, key_scale, 1), quantize(value_new, value_scale, 1)  # (B, H, new, D)
    for b, length in enumerate(lengths):
        for i in range(len_new):
            j = length + i
            k_row, v_row = key_rows[b, :, i], value_rows[b, :, i]
            if block_size is None:
                want_key_cache[b, :, j], want_value_cache[b, :, j] = k_row, v_row
            else:
                block, row = table[b, j // block_size].long(), j % block_size
                want_key_cache[block, row], want_value_cache[block, row] = k_row, v_row
    assert want_key_cache.view(torch.uint8).eq(0x7F).sum() == 0  # (no NaN: +-inf saturated too)

    on = lambda t: None if t is None else t.to(device)  # noqa: E731
    caches = on(key_cache), on(value_cache)
    out = flashattn_ext.decode_attention(on(query), *caches, on(torch.tensor(lengths, dtype=torch.int32)),
                                         block_table=on(table), key_new=on(key_new), value_new=on(value_new),
                                         is_causal=True, scale=0.01, key_scale=on(key_scale),
                                         value_scale=on(value_scale)).cpu()
    for got, want in zip(caches, (want_key_cache, want_value_cache)):
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
    want_out, _ = reference(query, dequantize(want_key_cache, key_scale, heads_dim),
                            dequantize(want_value_cache, value_scale, heads_dim),
                            [length + len_new for length in lengths], table, True, 0.01)
    assert relative_error(out, want_out) <= TOLERANCE[dtype]


def _fp8_call(**changes):
    gen = torch.Generator().manual_seed(5)
    key_cache, value_cache, _, (key_scale, value_scale), _ = fp8_problem(None, 2, True, gen, capacity=8, dim=8)
    arguments = {"query": torch.randn(3, 4, 1, 8), "key_cache": key_cache, "value_cache": value_cache,
                 "cache_seqlens": torch.tensor([1, 2, 8]), "key_scale": key_scale, "value_scale": value_scale}
    arguments.update(changes)
    return lambda: flashattn_ext.decode_attention(**arguments)


@pytest.mark.parametrize("call, exception, message", [
    (_fp8_call(key_scale=None), ValueError, "needs key_scale and value_scale"),
    (_fp8_call(key_scale=torch.ones(3)), RuntimeError, "one a key/value head"),
    (_fp8_call(key_scale=torch.ones(2, dtype=torch.float64)), TypeError, "key_scale must be float32"),
    (_fp8_call(key_scale=torch.ones(())), RuntimeError, "must both be one scale or both one a head"),
    (_fp8_call(value_cache=torch.zeros(3, 2, 8, 8)), TypeError, "value_cache must be too"),
    (_fp8_call(query=torch.randn(3, 4, 1, 8, dtype=torch.float64)), TypeError, "float64"),
    (_fp8_call(key_cache=torch.zeros(3, 2, 8, 8), value_cache=torch.zeros(3, 2, 8, 8)), ValueError,
     "key_scale is for FP8"),
])
def test_bad_arguments(call, exception, message):
    with pytest.raises(exception, match=message):
        call()


@on_paths("cpu", "cuda")
def test_opcheck(path):
    gen = torch.Generator().manual_seed(6)
    key_cache, value_cache, table, (key_scale, value_scale), _ = fp8_problem(4, 2, True, gen, capacity=8, dim=16)
    on = lambda t: t.to(path.device)  # noqa: E731
    args = (on(torch.randn(3, 4, 1, 16, generator=gen).to(torch.bfloat16)), on(key_cache), on(value_cache),
            on(torch.tensor([1, 5, 6])), on(table), on(torch.randn(3, 2, 2, 16).to(torch.bfloat16)),
            on(torch.randn(3, 2, 2, 16).to(torch.bfloat16)), True, 0.25)
    kwargs = {"key_scale": on(key_scale), "value_scale": on(value_scale)}
    # (not test_schema: torch's schema check compares the caches with a multiply, which float8 lacks)
    torch.library.opcheck(torch.ops.flashattn_ext.decode_attention.default, args, kwargs,
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
