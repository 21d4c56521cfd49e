"""decode_attention: a few query tokens per sequence against a key/value cache, contiguous or paged,
with new keys and values appended in place, against a float64 reference that gathers each sequence's
keys and runs the naive attention on them."""
import math

import pytest
import torch

import flashattn_ext
from helpers import POISON_BYTES, cuda_test, kernel_names, naive_attention, on_paths, poison_cuda_allocator
from helpers import relative_error

# Largest error relative to the output's scale: the kernels accumulate 16-bit inputs in float32 (and
# the CPU's float32 inputs in float64), so about the output's rounding.
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
CUDA_DTYPES = (torch.float16, torch.bfloat16)


def skip_unless_covered(device, dtype):
    if device == "cuda" and dtype not in CUDA_DTYPES:
        pytest.skip("decode_attention on CUDA takes float16 and bfloat16")


def make_cache(batch, heads, capacity, dim, dim_v, dtype, block_size, gen):
    """Random caches (never zeros), contiguous (block_size None) or paged with the blocks of each
    sequence shuffled over a pool with spare blocks; returns (key_cache, value_cache, block_table)."""
    if block_size is None:
        shape_k, shape_v, table = (batch, heads, capacity, dim), (batch, heads, capacity, dim_v), None
    else:
        per_sequence = math.ceil(capacity / block_size)
        num_blocks = batch * per_sequence + 3
        table = torch.randperm(num_blocks, generator=gen)[: batch * per_sequence].view(batch, per_sequence)
        table = table.to(torch.int32)
        shape_k, shape_v = (num_blocks, block_size, heads, dim), (num_blocks, block_size, heads, dim_v)
    key_cache = torch.randn(shape_k, generator=gen, dtype=torch.float64).to(dtype)
    value_cache = torch.randn(shape_v, generator=gen, dtype=torch.float64).to(dtype)
    return key_cache, value_cache, table


def sequence_rows(cache, b, length, block_table):
    """Sequence b's first `length` rows of a cache, as (heads, length, dim)."""
    if block_table is None:
        return cache[b, :, :length]
    block_size = cache.shape[1]
    positions = torch.arange(length)
    rows = cache[block_table[b, positions // block_size].long(), positions % block_size]  # (length, heads, dim)
    return rows.transpose(0, 1)


def fill_past_lengths(cache, lengths, block_table, value):
    """Sets each sequence's rows of a cache (or of a uint8 view of it) from its length on to `value`: rows a
    kernel may read but no query sees."""
    for b, length in enumerate(lengths):
        if block_table is None:
            cache[b, :, length:] = value
        else:
            block_size = cache.shape[1]
            positions = torch.arange(length, block_table.shape[1] * block_size)
            cache[block_table[b, positions // block_size].long(), positions % block_size] = value


def hopper_call_inputs(batch, heads_q, len_q, dim, dtype, options, gen):
    """A decode call's random query and its options for test_decode_kernel and its FP8 twin: ("alibi": True
    becomes random (Hq,) slopes) as the float64 reference takes them, and as CUDA float32 for the call."""
    query = torch.randn(batch, heads_q, len_q, dim, generator=gen).to(dtype)
    options = dict(options)
    if options.pop("alibi", False):
        options["alibi_slopes"] = torch.rand(heads_q, generator=gen, dtype=torch.float64) * 0.1
    on_cuda = {name: value.float().cuda() if isinstance(value, torch.Tensor) else value
               for name, value in options.items()}
    return query, options, on_cuda


def reference(query, key_cache, value_cache, lengths, block_table, is_causal, scale, alibi_slopes=None, **options):
    """(out, lse) in float64, one sequence at a time; options: naive_attention's window and softcap;
    alibi_slopes (Hq,) or (B, Hq)."""
    outs, lses = [], []
    for b, length in enumerate(lengths):
        if alibi_slopes is not None:
            options["alibi_slopes"] = (alibi_slopes[b] if alibi_slopes.dim() == 2 else alibi_slopes).double()
        if length == 0:  # no key: out 0, lse -inf (naive_attention cannot reduce over no key)
            heads, len_q = query.shape[1], query.shape[2]
            outs.append(torch.zeros(1, heads, len_q, value_cache.shape[-1], dtype=torch.float64))
            lses.append(torch.full((1, heads, len_q), -math.inf, dtype=torch.float64))
            continue
        k = sequence_rows(key_cache, b, length, block_table).double()[None]
        v = sequence_rows(value_cache, b, length, block_table).double()[None]
        out, lse = naive_attention(query[b : b + 1].double(), k, v, is_causal=is_causal, causal_lower_right=True,
                                   scale=scale, enable_gqa=True, **options)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block_size", [None, 1, 16], ids=["contiguous", "paged1", "paged16"])
@pytest.mark.parametrize("len_q, is_causal", [(1, False), (3, False), (3, True)])
@pytest.mark.parametrize("heads_q, heads_kv", [(4, 4), (8, 2), (12, 2)])  # (12, 2): 18 rows a key head
@on_paths("cpu", "cuda")
def test_matches_float64(dtype, block_size, len_q, is_causal, heads_q, heads_kv, path):
    device = path.device
    skip_unless_covered(device, dtype)
    gen = torch.Generator().manual_seed(0)
    capacity, dim = 40, 32
    key_cache, value_cache, table = make_cache(3, heads_kv, capacity, dim, dim, dtype, block_size, gen)
    # A sequence with no key yet (its queries see none: out 0, lse -inf), one in the middle of a
    # block, and a full one.
    lengths = [0, 21, capacity]
    query = torch.randn(3, heads_q, len_q, dim, generator=gen, dtype=torch.float64).to(dtype)
    on = lambda t: None if t is None else t.to(device)  # noqa: E731
    out, lse = flashattn_ext.decode_attention(on(query), on(key_cache), on(value_cache), on(torch.tensor(lengths)),
                                              block_table=on(table), is_causal=is_causal, return_lse=True)
    out, lse = out.cpu(), lse.cpu()
    want_out, want_lse = reference(query, key_cache, value_cache, lengths, table, is_causal, 1 / math.sqrt(dim))
    assert out.dtype == dtype and out.shape == (3, heads_q, len_q, dim)
    assert relative_error(out, want_out) <= TOLERANCE[dtype]
    seen = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    assert (lse[seen].double() - want_lse[seen]).abs().max().item() <= 1e-5
    assert torch.all(out[0] == 0)


def check_small_cache(device, dtype, block_size, seed, is_causal, **options):
    """decode_attention of 3 sequences (lengths 0, 21 and the whole 40-key cache), 8 query heads on 2 KV heads
    and 3 new tokens each, against the float64 reference with the same options (tensors among them moved to
    the device); returns the output and which query rows see a key."""
    skip_unless_covered(device, dtype)
    gen = torch.Generator().manual_seed(seed)
    capacity, dim = 40, 32
    key_cache, value_cache, table = make_cache(3, 2, capacity, dim, dim, dtype, block_size, gen)
    lengths = [0, 21, capacity]
    query = torch.randn(3, 8, 3, dim, generator=gen, dtype=torch.float64).to(dtype)
    on = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
    out, lse = flashattn_ext.decode_attention(on(query), on(key_cache), on(value_cache), on(torch.tensor(lengths)),
                                              block_table=on(table), is_causal=is_causal, return_lse=True,
                                              **{name: on(value) for name, value in options.items()})
    out, lse = out.cpu(), lse.cpu()
    want_out, want_lse = reference(query, key_cache, value_cache, lengths, table, is_causal, 1 / math.sqrt(dim),
                                   **options)
    assert relative_error(out, want_out) <= TOLERANCE[dtype]
    seen = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    assert (lse[seen].double() - want_lse[seen]).abs().max().item() <= 1e-5
    return out, seen


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block_size", [None, 4], ids=["contiguous", "paged4"])
@pytest.mark.parametrize(
    "options",
    [dict(window=(5, 0), is_causal=True), dict(window=(6, 2)), dict(softcap=1.5), dict(softcap=1.5, window=(3, None))],
    ids=["causal_window", "two_sided_window", "softcap", "softcap_left_window"],
)
@on_paths("cpu", "cuda")
def test_window_and_softcap(options, block_size, dtype, path):
    """Windows around the bottom-right diagonal and softcapping; rows whose window holds no key get 0."""
    options = dict(options)
    is_causal = options.pop("is_causal", False)
    out, seen = check_small_cache(path.device, dtype, block_size, 6, is_causal, **options)
    assert torch.all(out[~seen] == 0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block_size", [None, 4], ids=["contiguous", "paged4"])
@pytest.mark.parametrize("per_sequence", [False, True], ids=["per_head", "per_sequence"])
@on_paths("cpu", "cuda")
def test_alibi(per_sequence, block_size, dtype, path):
    """ALiBi's distances from the bottom-right diagonal, with a causal window on top."""
    slopes = torch.tensor([2.0 ** -(h + 1) for h in range(8)])
    if per_sequence:
        slopes = torch.stack([slopes, slopes.flip(0), slopes * 0.5])
    check_small_cache(path.device, dtype, block_size, 8, True, window=(30, None), alibi_slopes=slopes)


# ALiBi's usual slopes for 32 heads: 2^-0.25 down to 2^-8.
ALIBI_SLOPES_32 = torch.tensor([2.0 ** (-8 * (h + 1) / 32) for h in range(32)])


@cuda_test
@pytest.mark.parametrize("block_size", [None, 16], ids=["contiguous", "paged16"])
@pytest.mark.parametrize(
    "options",
    [dict(window=(700, 0), is_causal=True), dict(window=(300, 40)), dict(softcap=2.0),
     dict(softcap=2.0, window=(1000, None)), dict(alibi_slopes=ALIBI_SLOPES_32, is_causal=True)],
    ids=["causal_window", "two_sided_window", "softcap", "softcap_left_window", "alibi"],
)
def test_window_and_softcap_across_chunks_on_cuda(options, block_size):
    """The same against caches of a few thousand keys: the window covers some of a sequence's chunks
    and part of others (the chunks before it do no work); ALiBi's distances run into the thousands."""
    gen = torch.Generator().manual_seed(7)
    dtype, capacity, dim = torch.bfloat16, 4096, 128
    key_cache, value_cache, table = make_cache(2, 8, capacity, dim, dim, dtype, block_size, gen)
    lengths = [4096, 1500]
    query = torch.randn(2, 32, 3, dim, generator=gen).to(dtype)
    options = dict(options)
    is_causal = options.pop("is_causal", False)
    on_cuda = {name: value.cuda() if isinstance(value, torch.Tensor) else value for name, value in options.items()}
    out, lse = flashattn_ext.decode_attention(query.cuda(), key_cache.cuda(), value_cache.cuda(),
                                              torch.tensor(lengths).cuda(), is_causal=is_causal,
                                              block_table=None if table is None else table.cuda(), return_lse=True,
                                              **on_cuda)
    want_out, want_lse = reference(query, key_cache, value_cache, lengths, table, is_causal, 1 / math.sqrt(dim),
                                   **options)
    assert relative_error(out.cpu(), want_out) <= TOLERANCE[dtype]
    assert (lse.cpu().double() - want_lse).abs().max().item() <= 1e-4


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@on_paths("cpu", "cuda")
def test_index_tensors_are_read_in_place_through_their_strides(index_dtype, path):
    """cache_seqlens and block_table as strided views of larger tensors (no copy is made of them): the
    same result as contiguous copies, against the float64 reference."""
    device = path.device
    gen = torch.Generator().manual_seed(8)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    capacity, dim = 40, 16
    key_cache, value_cache, table = make_cache(3, 2, capacity, dim, dim, dtype, 4, gen)
    lengths = [0, 21, capacity]
    query = torch.randn(3, 4, 2, dim, generator=gen).to(dtype)
    # Every other element of a longer vector; the table's columns of a wider, transposed one (made on
    # the device: copying a view there would make it contiguous).
    seqlens_view = torch.tensor([n for length in lengths for n in (length, -7)], dtype=index_dtype,
                                device=device)[::2]
    wide = torch.full((table.shape[1] + 3, 3), -5, dtype=index_dtype, device=device)
    wide[: table.shape[1]] = table.t().to(device=device, dtype=index_dtype)
    table_view = wide.t()[:, : table.shape[1]]
    assert not seqlens_view.is_contiguous() and not table_view.is_contiguous()
    on = lambda t: t.to(device)  # noqa: E731
    got = flashattn_ext.decode_attention(on(query), on(key_cache), on(value_cache), seqlens_view,
                                         block_table=table_view, is_causal=True, return_lse=True)
    copies = flashattn_ext.decode_attention(on(query), on(key_cache), on(value_cache), seqlens_view.contiguous(),
                                            block_table=table_view.contiguous(), is_causal=True, return_lse=True)
    assert all(torch.equal(g, c) for g, c in zip(got, copies))
    want_out, _ = reference(query, key_cache, value_cache, lengths, table, True, 1 / math.sqrt(dim))
    assert relative_error(got[0].cpu(), want_out) <= TOLERANCE[dtype]


@pytest.mark.parametrize("block_size", [None, 4], ids=["contiguous", "paged4"])
@on_paths("cpu", "cuda")
def test_new_keys_are_written_into_the_cache_then_seen(block_size, path):
    device = path.device
    gen = torch.Generator().manual_seed(1)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    capacity, dim, dim_v, len_new = 24, 16, 8, 2
    key_cache, value_cache, table = make_cache(2, 2, capacity, dim, dim_v, dtype, block_size, gen)
    lengths = [5, 22]  # the second's new keys end at the cache's end
    key_new = torch.randn(2, 2, len_new, dim, generator=gen).to(dtype)
    value_new = torch.randn(2, 2, len_new, dim_v, generator=gen).to(dtype)
    query = torch.randn(2, 4, 2, dim, generator=gen).to(dtype)
    want_key_cache, want_value_cache = key_cache.clone(), value_cache.clone()
    for b, length in enumerate(lengths):
        for i in range(len_new):
            j = length + i
            if block_size is None:
                want_key_cache[b, :, j], want_value_cache[b, :, j] = key_new[b, :, i], value_new[b, :, i]
            else:
                block, row = table[b, j // block_size].long(), j % block_size
                want_key_cache[block, row], want_value_cache[block, row] = key_new[b, :, i], value_new[b, :, i]

    on = lambda t: None if t is None else t.to(device)  # noqa: E731
    caches = on(key_cache), on(value_cache)
    out = flashattn_ext.decode_attention(on(query), *caches, on(torch.tensor(lengths, dtype=torch.int32)),
                                         block_table=on(table), key_new=on(key_new), value_new=on(value_new),
                                         is_causal=True, scale=0.3).cpu()
    key_cache, value_cache = caches[0].cpu(), caches[1].cpu()
    assert torch.equal(key_cache, want_key_cache) and torch.equal(value_cache, want_value_cache)
    new_lengths = [length + len_new for length in lengths]
    want_out, _ = reference(query, key_cache, value_cache, new_lengths, table, True, 0.3)
    assert relative_error(out, want_out) <= TOLERANCE[dtype]


@pytest.mark.parametrize("layout", ["sequence_major", "column_strided", "odd_dims"])
@on_paths("cpu", "cuda")
def test_strided_views_and_sdpa_agree(layout, path):
    """Caches in layouts other than (B, H, capacity, D) contiguous, and a sequence-major query, against
    SDPA: a (B, capacity, H, D) cache seen as (B, H, capacity, D); a cache whose columns are strided (a
    transposed (B, H, D, capacity) store); head dims 20 and 12, whose rows are no whole 16-byte pieces."""
    device = path.device
    gen = torch.Generator().manual_seed(2)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    dim, dim_v = (20, 12) if layout == "odd_dims" else (16, 16)
    query = torch.randn(2, 1, 6, dim, generator=gen).transpose(1, 2)  # (B, Hq, 1, D) with Hq strided
    if layout == "column_strided":
        key_cache = torch.randn(2, 3, dim, 30, generator=gen).transpose(2, 3)
        value_cache = torch.randn(2, 3, dim_v, 30, generator=gen).transpose(2, 3)
    else:
        key_cache = torch.randn(2, 30, 3, dim, generator=gen).transpose(1, 2)
        value_cache = torch.randn(2, 30, 3, dim_v, generator=gen).transpose(1, 2)
    query, key_cache, value_cache = (t.to(device=device, dtype=dtype) for t in (query, key_cache, value_cache))
    out = flashattn_ext.decode_attention(query, key_cache, value_cache, torch.tensor([30, 17], device=device))
    mask = (torch.arange(30) < torch.tensor([30, 17])[:, None]).to(device)[:, None, None, :]
    want = torch.nn.functional.scaled_dot_product_attention(
        query.double(), key_cache.double(), value_cache.double(), attn_mask=mask, enable_gqa=True)
    assert relative_error(out.double(), want) <= TOLERANCE[dtype]


@pytest.mark.parametrize("with_new", [False, True])
@on_paths("cpu", "cuda")
def test_opcheck(with_new, path):
    device = path.device
    gen = torch.Generator().manual_seed(3)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    key_cache, value_cache, table = make_cache(2, 2, 12, 8, 8, dtype, 4, gen)
    query = torch.randn(2, 4, 2, 8, generator=gen).to(dtype)
    new = (torch.randn(2, 2, 2, 8, generator=gen).to(dtype), torch.randn(2, 2, 2, 8, generator=gen).to(dtype)) \
        if with_new else (None,) * 2
    args = tuple(t.to(device) if isinstance(t, torch.Tensor) else t
                 for t in (query, key_cache, value_cache, torch.tensor([3, 9]), table, *new, True, 0.35))
    torch.library.opcheck(torch.ops.flashattn_ext.decode_attention.default, args)


def _decode_call(**changes):
    gen = torch.Generator().manual_seed(4)
    arguments = dict(query=torch.randn(2, 4, 1, 8, generator=gen), key_cache=torch.randn(2, 2, 10, 8, generator=gen),
                     value_cache=torch.randn(2, 2, 10, 8, generator=gen), cache_seqlens=torch.tensor([3, 10]))
    arguments.update(changes)
    return lambda: flashattn_ext.decode_attention(**arguments)


@pytest.mark.parametrize(
    "call, exception, message",
    [
        (_decode_call(cache_seqlens=torch.tensor([3, 11])), ValueError, "sequence 1 has 11 cached keys, but its cache holds 10"),
        (_decode_call(cache_seqlens=torch.tensor([-1, 2])), ValueError, "sequence 0 has -1 cached keys"),
        (_decode_call(cache_seqlens=torch.tensor([3])), RuntimeError, "one length per sequence (2)"),
        (_decode_call(cache_seqlens=torch.tensor([3.0, 4.0])), TypeError, "cache_seqlens must be int32 or int64"),
        (_decode_call(key_cache=torch.randn(2, 3, 10, 8)), RuntimeError, "must agree in all but the last dim"),
        (_decode_call(key_cache=torch.randn(2, 3, 10, 8), value_cache=torch.randn(2, 3, 10, 8)), RuntimeError,
         "the 3 key/value heads of the cache must divide the 4 query heads"),
        (_decode_call(key_cache=torch.randn(2, 2, 10, 4), value_cache=torch.randn(2, 2, 10, 4)), RuntimeError,
         "key_cache head dim 4 does not match query head dim 8"),
        (_decode_call(key_new=torch.randn(2, 2, 1, 8)), RuntimeError, "key_new and value_new must be given together"),
        (_decode_call(key_new=torch.randn(2, 2, 1, 8), value_new=torch.randn(2, 2, 1, 8)), ValueError,
         "sequence 1 has 10 cached keys and 1 new ones, but its cache holds 10"),
        (_decode_call(block_table=torch.tensor([[0, 1], [2, 3]]), key_cache=torch.randn(3, 5, 2, 8),
                      value_cache=torch.randn(3, 5, 2, 8)), ValueError,
         "block_table[1, 1] is 3, not a block of the cache (3 blocks)"),
        (_decode_call(key_cache=torch.randn(2, 2, 10, 8, dtype=torch.float64)), TypeError, "key_cache has dtype"),
        (_decode_call(key_cache=torch.randn(2, 2, 1, 8).expand(2, 2, 10, 8), key_new=torch.randn(2, 2, 1, 8),
                      value_new=torch.randn(2, 2, 1, 8), cache_seqlens=torch.tensor([3, 4])), RuntimeError,
         "key_cache has elements that share memory"),
        (_decode_call(query=torch.randn(2, 4, 1, 8, requires_grad=True)), RuntimeError, "has no backward"),
    ],
)
def test_bad_arguments(call, exception, message):
    with pytest.raises(exception, match=None) as info:
        call()
    assert message in str(info.value)


def check_on_cuda(query, key_cache, value_cache, lengths, table, is_causal):
    """decode_attention of the CPU tensors on CUDA against the float64 reference: out, which rows see a key
    (finite lse) and their lse. Returns out (on the CPU) and that mask."""
    out, lse = flashattn_ext.decode_attention(query.cuda(), key_cache.cuda(), value_cache.cuda(),
                                              torch.tensor(lengths).cuda(), is_causal=is_causal,
                                              block_table=None if table is None else table.cuda(), return_lse=True)
    want_out, want_lse = reference(query, key_cache, value_cache, lengths, table, is_causal,
                                   1 / math.sqrt(query.shape[-1]))
    out, lse = out.cpu(), lse.cpu()
    assert relative_error(out, want_out) <= TOLERANCE[query.dtype]
    finite = want_lse.isfinite()
    assert torch.equal(lse.isfinite(), finite)
    assert (lse.double() - want_lse)[finite].abs().max().item() <= 1e-4
    return out, finite


@cuda_test
@pytest.mark.parametrize("block_size, dim, len_q", [(None, 128, 1), (16, 128, 1), (256, 128, 1), (None, 128, 5),
                                                    (16, 64, 2), (None, 80, 1), (256, 256, 3)])
def test_long_cache_in_chunks_on_cuda(block_size, dim, len_q):
    """GQA 32:8 against caches of a few thousand keys: several chunks a sequence, merged by their lse;
    with len_q > 1, causal, and 4 * len_q query rows a key head (two blocks of rows at len_q = 5)."""
    gen = torch.Generator().manual_seed(5)
    dtype, capacity = torch.bfloat16, 4096
    key_cache, value_cache, table = make_cache(2, 8, capacity, dim, dim, dtype, block_size, gen)
    lengths = [4096, 1500]
    query = torch.randn(2, 32, len_q, dim, generator=gen).to(dtype)
    _, finite = check_on_cuda(query, key_cache, value_cache, lengths, table, is_causal=len_q > 1)
    assert finite.all()


@cuda_test
@pytest.mark.parametrize("batch, len_q, lengths", [(1, 1, [8192]), (1, 8, [6000]), (2, 6, [8192, 0]),
                                                   (4, 1, [8192, 700, 1, 5000])], ids=str)
@pytest.mark.parametrize("block_size", [None, 16], ids=["contiguous", "paged16"])
def test_small_batches_on_cuda(batch, len_q, lengths, block_size):
    """A few sequences of GQA 32:8 against long caches: on Hopper, each key head's keys split into up to
    16 chunks, a block each, which merge after the grid's barrier, each a share of the rows; 6 and 8 query
    tokens (24 and 32 query rows a key head) take two row groups of warps. Lengths that leave chunks
    empty, and an empty cache (out 0, lse -inf)."""
    gen = torch.Generator().manual_seed(batch * 10 + len_q)
    dtype, capacity, dim = torch.bfloat16, 8192, 128
    key_cache, value_cache, table = make_cache(batch, 8, capacity, dim, dim, dtype, block_size, gen)
    query = torch.randn(batch, 32, len_q, dim, generator=gen).to(dtype)
    out, finite = check_on_cuda(query, key_cache, value_cache, lengths, table, is_causal=len_q > 1)
    assert torch.equal(out[~finite], torch.zeros_like(out[~finite]))


@cuda_test
@pytest.mark.parametrize("len_q", [1, 8])
@pytest.mark.parametrize("block_size", [None, 16], ids=["contiguous", "paged16"])
def test_small_batches_mark_bad_lengths_nan_on_cuda(block_size, len_q):
    """Lengths past the capacity or below 0 beside a valid one, in chunks merged after the grid's
    barrier: NaN out and lse for those sequences (the kernel's own mark on a contiguous cache), the
    float64 reference's answer for the valid one."""
    gen = torch.Generator().manual_seed(17 + len_q)
    dtype, capacity, dim = torch.bfloat16, 8192, 128
    key_cache, value_cache, table = make_cache(3, 8, capacity, dim, dim, dtype, block_size, gen)
    query = torch.randn(3, 32, len_q, dim, generator=gen).to(dtype)
    out, lse = flashattn_ext.decode_attention(query.cuda(), key_cache.cuda(), value_cache.cuda(),
                                              torch.tensor([capacity, capacity + 1, -1]).cuda(),
                                              is_causal=len_q > 1, return_lse=True,
                                              block_table=None if table is None else table.cuda())
    out, lse = out.cpu(), lse.cpu()
    assert out[1:].isnan().all() and lse[1:].isnan().all()
    want_out, want_lse = reference(query[:1], key_cache, value_cache, [capacity], None if table is None else table[:1],
                                   len_q > 1, 1 / math.sqrt(dim))
    assert relative_error(out[:1], want_out) <= TOLERANCE[dtype]
    assert (lse[:1].double() - want_lse).abs().max().item() <= 1e-4


@cuda_test
@pytest.mark.parametrize("block_size", [None, 16], ids=["contiguous", "paged16"])
def test_more_key_heads_than_sms_on_cuda(block_size):
    """More (sequence, key head) units than the GPU has SMs, a few left over: the Hopper kernel takes
    most whole and splits those left over into chunks merged by the last to finish; sequences of
    different lengths (one empty, one shorter than a chunk)."""
    gen = torch.Generator().manual_seed(11)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch, heads_kv, dtype, capacity, dim = sms // 8 + 2, 8, torch.bfloat16, 4096, 128
    key_cache, value_cache, table = make_cache(batch, heads_kv, capacity, dim, dim, dtype, block_size, gen)
    lengths = torch.randint(1, capacity + 1, (batch,), generator=gen)
    lengths[-1], lengths[-2], lengths[-3] = 0, 300, capacity
    query = torch.randn(batch, 4 * heads_kv, 1, dim, generator=gen).to(dtype)
    check_on_cuda(query, key_cache, value_cache, lengths.tolist(), table, is_causal=False)


@cuda_test
def test_cuda_takes_16_bit_types_only():
    call = _decode_call(query=torch.randn(2, 4, 1, 8).cuda(), key_cache=torch.randn(2, 2, 10, 8).cuda(),
                        value_cache=torch.randn(2, 2, 10, 8).cuda(), cache_seqlens=torch.tensor([3, 10]).cuda())
    with pytest.raises(TypeError, match="takes float16 or bfloat16"):
        call()


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


@on_paths("sm90")
@pytest.mark.parametrize("options", [{}, {"window": (100, 0)}, {"softcap": 20.0}, {"alibi": True}],
                         ids=["plain", "window", "softcap", "alibi"])
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"paged{c[0]}-d{c[1]}-b{c[2]}-lq{c[5]}")
def test_decode_kernel(path, case, options):
    """decode_attention through the Hopper decode kernel (its name in the profiler) against float64,
    with the cache's rows past each sequence's length NaN (rows a tile reads but no query sees must
    not reach the output) and the outputs on NaN-poisoned memory."""
    block_size, dim, batch, heads_q, heads_kv, len_q, lengths, capacity = case
    gen = torch.Generator().manual_seed(31)
    dtype = torch.bfloat16
    if lengths is None:
        lengths = torch.randint(0, capacity + 1, (batch,), generator=gen).tolist()
    key_cache, value_cache, table = make_cache(batch, heads_kv, capacity, dim, dim, dtype, block_size, gen)
    for cache in (key_cache, value_cache):
        fill_past_lengths(cache, lengths, table, math.nan)
    query, options, on_cuda = hopper_call_inputs(batch, heads_q, len_q, dim, dtype, options, gen)

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


@on_paths("sm90")
@pytest.mark.parametrize("block_size", [None, 4])
def test_decode_kernel_cache_layouts(path, block_size):
    """The Hopper decode kernel's copies walk the nearer of heads and rows in memory first: each cache
    also in the other order (a contiguous cache's heads side by side in each row; a paged cache's
    heads apart in each block, 4 blocks a tile): the same results against float64."""
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


@on_paths("sm90")
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
def test_decode_kernel_choice(path, block_size, dim, heads_q, heads_kv, len_q, hopper, monkeypatch):
    """The Hopper decode kernel runs where it takes the call, the mma.sync one elsewhere and under
    FLASHATTN_EXT_KERNELS=sm80; both agree with float64."""
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
