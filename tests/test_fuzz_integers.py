"""The integer arguments of every API at their extremes (0, -1, 2^31, 2^63 - 1, ...), in other dtypes and
on other devices (meta among them). Each call must raise a clear error, return the documented NaN (CUDA's
decode and varlen calls, which do not wait for the GPU to check their indices), or return the right
answer. None may crash, and none may write outside its tensors: every cache lies inside a buffer whose
guard slabs, on either side, must come back unchanged."""
import math

import pytest
import torch

import flashattn_ext
from helpers import cuda_test, naive_attention, on_paths, relative_error
from test_decode import make_cache, reference

EXTREMES = [0, 1, -1, 2**31 - 1, 2**31, -(2**31), 2**63 - 1, -(2**63)]
ERRORS = (RuntimeError, ValueError, TypeError, IndexError)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def dtype_on(device):
    return torch.float32 if device == "cpu" else torch.bfloat16


def fits(value, dtype):
    info = torch.iinfo(dtype)
    return info.min <= value <= info.max


def raises_clearly(call):
    """Runs call; returns True where it raised one of ERRORS whose message names flashattn_ext."""
    try:
        call()
    except ERRORS as error:
        assert "flashattn_ext" in str(error), f"an unclear error: {error!r}"
        return True
    return False


def guarded(tensor):
    """tensor (dim 0 outermost) inside a buffer with a random guard slab before and after it: returns
    (the view of tensor's rows in the buffer, the buffer)."""
    guard = torch.randn((1, *tensor.shape[1:]), dtype=torch.float64).to(tensor.device, tensor.dtype)
    buffer = torch.cat([guard, tensor, guard.clone()])
    return buffer[1:-1], buffer


# decode_attention: 2 sequences, 4 query heads on 2 key heads, capacity 12 (paged: blocks of 4, 3 a
# sequence), head dim 8; sequence 1's length or block table entry takes the extreme value.
CAPACITY, BLOCK = 12, 4


def decode_case(device, paged, with_new, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dtype = dtype_on(device)
    key_cache, value_cache, table = make_cache(2, 2, CAPACITY, 8, 8, dtype, BLOCK if paged else None, gen)
    query = torch.randn(2, 4, 1, 8, generator=gen, dtype=torch.float64).to(dtype)
    new = [torch.randn(2, 2, 1, 8, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2)] if with_new \
        else [None, None]
    return query, key_cache, value_cache, table, new


def run_decode(device, query, key_cache, value_cache, lengths, table, new, **options):
    """decode_attention on device, its caches guarded; returns (result or None where it raised, the
    caches after the call, the guard slabs' fate: True where unchanged)."""
    (k, k_buffer), (v, v_buffer) = guarded(key_cache.to(device)), guarded(value_cache.to(device))
    before = (k_buffer.clone(), v_buffer.clone())
    on = lambda t: t.to(device) if isinstance(t, torch.Tensor) and t.device.type != "meta" else t  # noqa: E731
    result = []
    raised = raises_clearly(lambda: result.append(flashattn_ext.decode_attention(
        on(query), k, v, on(lengths), block_table=on(table), key_new=on(new[0]), value_new=on(new[1]),
        return_lse=True, **options)))
    if device == "cuda":
        torch.cuda.synchronize()
    guards_kept = all(torch.equal(after[[0, -1]], was[[0, -1]]) for after, was in zip((k_buffer, v_buffer), before))
    if raised:  # nothing written before the error
        assert torch.equal(k_buffer, before[0]) and torch.equal(v_buffer, before[1])
    return (None if raised else result[0]), (k.cpu(), v.cpu()), guards_kept


def appended(cache, rows, lengths, table):
    """cache (on the CPU) with each sequence's new rows (B, H, S_new, D) written at its length."""
    cache = cache.clone()
    for b, length in enumerate(lengths):
        for i in range(rows.shape[2]):
            j = length + i
            if table is None:
                cache[b, :, j] = rows[b, :, i]
            else:
                cache[table[b, j // BLOCK], j % BLOCK] = rows[b, :, i]
    return cache


def check_decode(device, query, key_cache, value_cache, lengths, table, new, sequence_ok, **options):
    """Runs decode_attention on the lengths (a list or tensor of them) and table and checks the outcome:
    where every sequence is valid, the float64 reference's answer and the new rows in the caches; where
    sequence_ok[b] is False, an error (the CPU must raise), or on CUDA NaN out and lse for those
    sequences and the right answer for the others."""
    lengths_tensor = lengths if isinstance(lengths, torch.Tensor) else torch.tensor(lengths)
    result, (k_after, v_after), guards_kept = run_decode(device, query, key_cache, value_cache, lengths_tensor,
                                                         table, new, **options)
    assert guards_kept, "a write outside the caches"
    if result is None:
        assert not all(sequence_ok), "a valid call raised"
        return
    assert device == "cuda" and lengths_tensor.dtype in (torch.int32, torch.int64) or all(sequence_ok), \
        "the CPU answered a bad call"
    out, lse = (t.cpu() for t in result)
    plain = [int(x) for x in lengths_tensor.tolist()]
    if new[0] is not None:  # the valid sequences' new rows land in the caches
        good_lengths = [n if ok else 0 for n, ok in zip(plain, sequence_ok)]
        k_want = appended(key_cache, new[0], good_lengths, table)
        v_want = appended(value_cache, new[1], good_lengths, table)
        for b, ok in enumerate(sequence_ok):
            if ok:
                keys = plain[b] + new[0].shape[2]
                rows = (lambda c: c[b, :, :keys]) if table is None else \
                    (lambda c: c[table[b, : math.ceil(keys / BLOCK)].long()])
                assert torch.equal(rows(k_after), rows(k_want)) and torch.equal(rows(v_after), rows(v_want))
        key_cache, value_cache = k_want, v_want
    seen = [n + (0 if new[0] is None else new[0].shape[2]) if ok else 0 for n, ok in zip(plain, sequence_ok)]
    if "window" in options:
        options = dict(options, window=reference_window(options["window"]))
    want_out, want_lse = reference(query, key_cache, value_cache, seen, table, options.pop("is_causal", False),
                                   1 / math.sqrt(query.shape[-1]), **options)
    for b, ok in enumerate(sequence_ok):
        if ok:
            assert relative_error(out[b], want_out[b]) <= TOLERANCE[out.dtype]
            finite = want_lse[b].isfinite()
            assert torch.equal(lse[b].isfinite(), finite)
            assert torch.allclose(lse[b][finite].double(), want_lse[b][finite], rtol=0, atol=1e-4)
        else:
            assert out[b].isnan().all() and lse[b].isnan().all(), f"sequence {b}'s bad input gave no NaN"


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("with_new", [False, True], ids=["", "append"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@on_paths("cpu", "cuda")
def test_decode_lengths(path, paged, with_new, index_dtype):
    device = path.device
    query, key_cache, value_cache, table, new = decode_case(device, paged, with_new)
    room = CAPACITY - (1 if with_new else 0)
    for value in EXTREMES + [room, room + 1, CAPACITY]:
        if fits(value, index_dtype):
            lengths = torch.tensor([5, value], dtype=index_dtype)
            check_decode(device, query, key_cache, value_cache, lengths, table, new, [True, 0 <= value <= room])


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("with_new", [False, True], ids=["", "append"])
@on_paths("cpu", "cuda")
def test_decode_block_table(path, with_new, index_dtype):
    """Sequence 1's second block (which its 7 keys reach) and its third (which they do not: never read)."""
    device = path.device
    query, key_cache, value_cache, table, new = decode_case(device, True, with_new)
    num_blocks = key_cache.shape[0]
    for column, read in ((1, True), (2, False)):
        for value in EXTREMES + [num_blocks, num_blocks - 1]:
            if fits(value, index_dtype):
                bad_table = table.to(index_dtype)
                bad_table[1, column] = value
                ok = not read or 0 <= value < num_blocks
                check_decode(device, query, key_cache, value_cache, [5, 7], bad_table, new, [True, ok])


@on_paths("cpu", "cuda")
def test_decode_index_types_and_devices(path):
    device = path.device
    query, key_cache, value_cache, table, new = decode_case(device, True, True)
    lengths = torch.tensor([5, 7])
    for bad_lengths in (lengths.float(), lengths.to(torch.int16), lengths.bool(), lengths.to("meta"), [5, 7],
                        lengths[None], lengths[:1]):
        result, _, guards_kept = run_decode(device, query, key_cache, value_cache, bad_lengths, table, new)
        assert result is None and guards_kept
    for bad_table in (table.float(), table.to(torch.int16), table.to("meta"), table[0], table.tolist()):
        result, _, guards_kept = run_decode(device, query, key_cache, value_cache, lengths, bad_table, new)
        assert result is None and guards_kept
    # A capacity past int64's range: an expanded block table of 2^61 blocks of 4 rows a sequence.
    huge = table.to(device)[:, :1].expand(2, 2**61)
    result, _, guards_kept = run_decode(device, query, key_cache, value_cache, lengths, huge, new)
    assert result is None and guards_kept


# The repro of issue 44: an int64 length near 2^63 with new keys overflowed the length check.
@on_paths("cpu", "cuda")
def test_decode_length_near_int64_max_with_new_keys(path):
    device = path.device
    query, key_cache, value_cache, table, new = decode_case(device, True, True)
    check_decode(device, query, key_cache, value_cache, torch.tensor([5, 2**63 - 1]), table, new, [True, False])


WINDOWS = [(None, 2**63 - 1), (2**63 - 1, None), (2**63 - 1, 2**63 - 1), (2**31, 0), (0, 2**31 - 1), (2**64, None),
           (1, 2**62), (2**63 - 1, 0)]


@on_paths("cpu", "cuda")
def test_decode_windows(path):
    device = path.device
    query, key_cache, value_cache, table, new = decode_case(device, True, True)
    for window in WINDOWS:
        check_decode(device, query, key_cache, value_cache, [5, 7], table, new, [True, True], window=window)
    for window in ((-1, None), (None, -(2**63)), (1.5, None), (True, None), (1,)):
        assert raises_clearly(lambda: flashattn_ext.decode_attention(
            query.to(device), key_cache.to(device), value_cache.to(device), torch.tensor([5, 7], device=device),
            block_table=table.to(device), window=window))


def reference_window(window):
    """window with its huge bounds made small: a bound past every key hides none (the reference's mask
    is built from int64 indices, which 2^63 would overflow)."""
    return None if window is None else tuple(None if x is None else min(x, 10**6) for x in window)


@pytest.mark.parametrize("is_causal", [False, True])
@on_paths("cpu", "cuda")
def test_dense_windows(path, is_causal):
    device = path.device
    gen = torch.Generator().manual_seed(1)
    dtype = dtype_on(device)
    q, k, v = (torch.randn(2, 2, n, 16, generator=gen, dtype=torch.float64).to(dtype).double() for n in (24, 40, 40))
    for window in WINDOWS:
        for lower_right in (False, True):
            out, lse = flashattn_ext.attention_with_lse(*(t.to(device, dtype) for t in (q, k, v)), is_causal=is_causal,
                                                        causal_lower_right=lower_right, window=window)
            want_out, want_lse = naive_attention(q, k, v, is_causal=is_causal, causal_lower_right=lower_right,
                                                 window=reference_window(window))
            assert relative_error(out.cpu(), want_out) <= TOLERANCE[dtype]
            finite = want_lse.isfinite()
            assert torch.equal(lse.cpu().isfinite(), finite)
            assert (lse.cpu().double() - want_lse)[finite].abs().max().item() <= 1e-4


# varlen_attention: 3 sequences of 5, 0 and 9 tokens (queries and keys alike), 2 heads, head dim 16.
LENGTHS = [5, 0, 9]


def varlen_case(device, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(sum(LENGTHS), 2, 16, generator=gen, dtype=torch.float64).to(dtype_on(device)).double()
            for _ in range(3)]


def varlen_reference(q, k, v, bounds, **options):
    outs = []
    for begin, end in zip(bounds, bounds[1:]):
        if end == begin:
            continue
        piece = lambda t: t[begin:end].transpose(0, 1)[None]  # noqa: E731
        outs.append(naive_attention(piece(q), piece(k), piece(v), **options)[0][0].transpose(0, 1))
    return torch.cat(outs)


def check_varlen(device, q, k, v, cu_seqlens, max_seqlen, valid, **options):
    """varlen_attention on device: where valid, the reference's answer; else an error (the CPU must
    raise) or, on CUDA, NaN everywhere (its one-launch path checks the bounds on the GPU)."""
    dtype = dtype_on(device)
    result = []
    on = lambda t: t.to(device) if isinstance(t, torch.Tensor) and t.device.type != "meta" else t  # noqa: E731
    raised = raises_clearly(lambda: result.append(flashattn_ext.varlen_attention(
        *(t.to(device, dtype) for t in (q, k, v)), on(cu_seqlens), on(cu_seqlens), max_seqlen, max_seqlen,
        **options)))
    if raised:
        assert not valid, "a valid call raised"
        return
    out = result[0].cpu()
    if not valid:
        assert device == "cuda", "the CPU answered a bad call"
        assert out.isnan().all(), "bad bounds gave no NaN"
        return
    window = options.pop("window", None)
    want = varlen_reference(q, k, v, [int(x) for x in cu_seqlens.tolist()], window=reference_window(window),
                            **options)
    assert relative_error(out, want) <= TOLERANCE[dtype]


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@on_paths("cpu", "cuda")
def test_varlen_bounds(path, index_dtype):
    device = path.device
    q, k, v = varlen_case(device)
    bounds = [0, 5, 5, 14]
    for position in (0, 1, 3):
        for value in EXTREMES + [14, 15, 13]:
            if fits(value, index_dtype):
                bad = list(bounds)
                bad[position] = value
                valid = bad[0] == 0 and bad[-1] == 14 and all(b <= c for b, c in zip(bad, bad[1:])) and \
                    max(c - b for b, c in zip(bad, bad[1:])) <= 9
                check_varlen(device, q, k, v, torch.tensor(bad, dtype=index_dtype), 9, valid, is_causal=True)


@on_paths("cpu", "cuda")
def test_varlen_max_seqlen(path):
    device = path.device
    q, k, v = varlen_case(device)
    cu = torch.tensor([0, 5, 5, 14], dtype=torch.int32)
    for value in EXTREMES + [8, 9, 2**63, 9.0, True, None]:
        valid = isinstance(value, int) and not isinstance(value, bool) and 9 <= value < 2**63
        check_varlen(device, q, k, v, cu, value, valid)


@on_paths("cpu", "cuda")
def test_varlen_index_types_and_devices(path):
    device = path.device
    q, k, v = varlen_case(device)
    cu = torch.tensor([0, 5, 5, 14], dtype=torch.int32)
    for bad in (cu.float(), cu.to(torch.int16), cu.bool(), cu.to("meta"), [0, 5, 5, 14], cu[None], cu[:0]):
        check_varlen(device, q, k, v, bad, 9, False)
    for window in WINDOWS:
        check_varlen(device, q, k, v, cu, 9, True, window=window, is_causal=True)


@on_paths("cpu", "cuda")
def test_meta_tensors_beside_real_ones(path):
    """A meta tensor among real ones dispatches to the fake kernels, which must raise as the real ones do."""
    device = path.device
    dtype = dtype_on(device)
    q, k, v = (torch.randn(1, 2, 8, 16, device=device, dtype=dtype) for _ in range(3))
    mask = torch.ones(8, 8, dtype=torch.bool)
    for call in (lambda: flashattn_ext.attention_with_lse(q, k, v, attn_mask=mask.to("meta")),
                 lambda: flashattn_ext.attention_with_lse(q, k, v, alibi_slopes=torch.ones(2, device="meta")),
                 lambda: flashattn_ext.scaled_dot_product_attention(q, k, v, attn_mask=mask.float().to("meta"))):
        assert raises_clearly(call)


@on_paths("cpu", "cuda")
def test_dropout_mask_rows(path):
    device = path.device
    # (the rng_state of a forward with dropout, as the op returns it)
    _, _, rng_state = torch.ops.flashattn_ext.attention_forward(
        *(torch.randn(1, 1, 4, 8, device=device, dtype=dtype_on(device)) for _ in range(3)), None, 0.5, False, False,
        1.0)
    whole = torch.ops.flashattn_ext.dropout_mask(rng_state, 0.5, 1, 1, 4, 4, 0, 4).cpu()
    for begin in EXTREMES + [4, 5]:
        for end in EXTREMES + [4, 5, 3]:
            rows = []
            raised = raises_clearly(lambda: rows.append(
                torch.ops.flashattn_ext.dropout_mask(rng_state, 0.5, 1, 1, 4, 4, begin, end)))
            assert raised == (not 0 <= begin <= end <= 4)
            if not raised:
                assert torch.equal(rows[0].cpu(), whole[:, :, begin:end])


@cuda_test
def test_checked_mode_raises_on_cuda(monkeypatch):
    """FLASHATTN_EXT_CHECK_INPUTS=1: the CUDA ops read the index tensors to the host and raise the CPU's
    errors where they would otherwise answer NaN."""
    monkeypatch.setenv("FLASHATTN_EXT_CHECK_INPUTS", "1")
    query, key_cache, value_cache, table, new = decode_case("cuda", True, True)
    with pytest.raises(ValueError, match="sequence 1 has 9223372036854775807 cached keys and 1 new ones"):
        flashattn_ext.decode_attention(
            query.cuda(), key_cache.cuda(), value_cache.cuda(), torch.tensor([5, 2**63 - 1], device="cuda"),
            block_table=table.cuda(), key_new=new[0].cuda(), value_new=new[1].cuda())
    bad_table = table.clone()
    bad_table[1, 1] = -1
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] is -1, not a block of the cache"):
        flashattn_ext.decode_attention(query.cuda(), key_cache.cuda(), value_cache.cuda(),
                                       torch.tensor([5, 7], device="cuda"), block_table=bad_table.cuda())
    q, k, v = (t.to("cuda", torch.bfloat16) for t in varlen_case("cuda"))
    cu = torch.tensor([0, 5, 3, 14], device="cuda", dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q must not decrease"):
        flashattn_ext.varlen_attention(q, k, v, cu, cu, 11, 11)
