"""varlen_attention: packed batches of sequences of different lengths (empty ones included) against
the naive attention in float64, one sequence at a time; values, log-sum-exps and gradients."""
import math

import pytest
import torch

import flashattn_ext
from helpers import ERROR_FLOOR, POISON_BYTES, dtype_name, kernel_names, naive_attention, on_paths, on_paths_each
from helpers import poison_cuda_allocator, relative_error

LENGTHS_Q = [5, 0, 140, 33]
LENGTHS_K = [9, 4, 140, 0]  # a sequence with no key: out 0, lse -inf


DTYPES_BY_PATH = {"cpu": (torch.float64, torch.float32), "cuda": (torch.bfloat16,)}


def cumulative(lengths, device):
    return torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)


@on_paths_each("dtype", DTYPES_BY_PATH, ids=dtype_name)
@pytest.mark.parametrize(
    "options",
    [dict(), dict(is_causal=True), dict(is_causal=True, causal_lower_right=True), dict(window=(20, 3), softcap=3.0),
     dict(alibi_slopes="per_head", is_causal=True), dict(alibi_slopes="per_sequence")],
    ids=["full", "causal", "causal_lower_right", "window_softcap", "alibi_causal", "alibi_per_sequence"],
)
def test_matches_float64_sequence_by_sequence(options, path, dtype):
    device = path.device
    gen = torch.Generator().manual_seed(0)
    heads_q, heads_kv, dim, dim_v = 4, 2, 16, 24
    q = torch.randn(sum(LENGTHS_Q), heads_q, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(sum(LENGTHS_K), heads_kv, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(sum(LENGTHS_K), heads_kv, dim_v, generator=gen, dtype=torch.float64)
    dout = torch.randn(sum(LENGTHS_Q), heads_q, dim_v, generator=gen, dtype=torch.float64)
    # The reference takes the values the kernels see: the inputs rounded to dtype.
    q, k, v, dout = (t.to(dtype).double() for t in (q, k, v, dout))

    # ALiBi: one slope a query head, or one a sequence and query head.
    options = dict(options)
    slopes = {"per_head": torch.tensor([0.5, 0.25, 0.125, 0.0625]),
              "per_sequence": torch.rand(len(LENGTHS_Q), heads_q, generator=gen)}.get(options.pop("alibi_slopes", None))
    slopes_of = (lambda b: None) if slopes is None else (lambda b: (slopes[b] if slopes.dim() == 2 else slopes).double())

    leaves = [t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v)]
    out, lse = flashattn_ext.varlen_attention(*leaves, cumulative(LENGTHS_Q, device), cumulative(LENGTHS_K, device),
                                              max(LENGTHS_Q), max(LENGTHS_K), scale=0.4, return_lse=True,
                                              alibi_slopes=None if slopes is None else slopes.to(device), **options)
    grads = torch.autograd.grad(out, leaves, dout.to(device=device, dtype=dtype))
    assert out.shape == (sum(LENGTHS_Q), heads_q, dim_v) and lse.shape == (heads_q, sum(LENGTHS_Q))

    # The reference: each sequence alone, in float64, with autograd for the gradients.
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want_out, want_lse = [], []
    bq, bk = 0, 0
    for b, (lq, lk) in enumerate(zip(LENGTHS_Q, LENGTHS_K)):
        args = [ref[0][bq:bq + lq], ref[1][bk:bk + lk], ref[2][bk:bk + lk]]
        if lk == 0:
            o = args[0].new_zeros(lq, heads_q, dim_v) + 0 * args[0].sum()
            lse_b = torch.full((heads_q, lq), -torch.inf, dtype=torch.float64)
        else:
            o, lse_b = naive_attention(*(a.transpose(0, 1) for a in args), scale=0.4, enable_gqa=True,
                                       alibi_slopes=slopes_of(b), **options)
            o, lse_b = o.transpose(0, 1), lse_b
        want_out.append(o)
        want_lse.append(lse_b)
        bq, bk = bq + lq, bk + lk
    want_out = torch.cat(want_out)
    want_grads = torch.autograd.grad(want_out, ref, dout)
    tolerance = 1e-12 if dtype == torch.float64 else 20 * ERROR_FLOOR[dtype]
    assert relative_error(out.detach().cpu(), want_out.detach()) <= tolerance
    want_lse = torch.cat(want_lse, dim=1)
    seen = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), seen)
    assert (lse.cpu().double()[seen] - want_lse[seen]).abs().max().item() <= (1e-12 if dtype == torch.float64 else 1e-4)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
        assert relative_error(g.cpu(), w) <= tolerance, name


def call(**changes):
    q = torch.randn(6, 2, 8)
    arguments = dict(query=q, key=q, value=q, cu_seqlens_q=torch.tensor([0, 2, 6]), cu_seqlens_k=torch.tensor([0, 2, 6]),
                     max_seqlen_q=4, max_seqlen_k=4)
    arguments.update(changes)
    return lambda: flashattn_ext.varlen_attention(**arguments)


@pytest.mark.parametrize(
    "fn, exception, message",
    [
        (call(query=torch.randn(1, 6, 2, 8)), ValueError, "query must be a 3-d (total_tokens, heads, head_dim)"),
        (call(cu_seqlens_q=torch.tensor([0, 2, 5])), ValueError, "must start at 0 and end at the 6 packed tokens"),
        (call(cu_seqlens_q=torch.tensor([0, 4, 2, 6]), cu_seqlens_k=torch.tensor([0, 2, 4, 6])), ValueError,
         "cu_seqlens_q must not decrease"),
        (call(cu_seqlens_k=torch.tensor([0.0, 6.0])), TypeError, "cu_seqlens_k must be int32 or int64"),
        (call(cu_seqlens_k=torch.tensor([0, 6]), max_seqlen_k=6), ValueError, "holds 2 sequences but cu_seqlens_k 1"),
        (call(max_seqlen_q=3), ValueError, "(3) is below its longest sequence (4)"),
        (call(key=torch.randn(6, 3, 8), value=torch.randn(6, 3, 8)), ValueError, "the 3 key/value heads must divide"),
        (call(alibi_slopes=torch.ones(3)), RuntimeError, "alibi_slopes must have shape (2,) or (2, 2)"),
        (call(max_seqlen_k=4.0), ValueError, "max_seqlen_k must be an int"),
    ],
)
def test_bad_arguments(fn, exception, message):
    with pytest.raises(exception) as info:
        fn()
    assert message in str(info.value)


@on_paths_each("dtype", DTYPES_BY_PATH, ids=dtype_name)
@pytest.mark.parametrize("is_causal", [False, True])
def test_nested_tensors_in_scaled_dot_product_attention(is_causal, path, dtype):
    """Jagged nested tensors (N, H, j, E), as SDPA takes them (here with GQA, which SDPA's own nested
    path lacks): values and gradients against each sequence's naive attention in float64."""
    device = path.device
    gen = torch.Generator().manual_seed(1)
    lengths = [7, 1, 130]
    parts = {name: [torch.randn(n, heads, 16, generator=gen, dtype=torch.float64) for n in lengths]
             for name, heads in (("q", 4), ("k", 2), ("v", 2))}
    douts = [torch.randn(n, 4, 16, generator=gen, dtype=torch.float64) for n in lengths]

    leaves = [torch.nested.nested_tensor([p.to(device=device, dtype=dtype) for p in parts[name]], layout=torch.jagged,
                                         requires_grad=True) for name in ("q", "k", "v")]
    out = flashattn_ext.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves), is_causal=is_causal,
                                                     scale=0.3, enable_gqa=True)
    assert out.is_nested and out.shape[:2] == (3, 4)
    # The incoming gradient shares the output's offsets (so its ragged dim is the output's).
    grad = torch.nested.nested_tensor_from_jagged(torch.cat(douts).to(device=device, dtype=dtype),
                                                  out.transpose(1, 2).offsets())
    grads = torch.autograd.grad(out, leaves, grad.transpose(1, 2))

    tolerance = 1e-12 if dtype == torch.float64 else 20 * ERROR_FLOOR[dtype]
    for b in range(len(lengths)):
        ref = [parts[name][b].transpose(0, 1)[None].clone().requires_grad_() for name in ("q", "k", "v")]
        want, _ = naive_attention(*ref, is_causal=is_causal, scale=0.3, enable_gqa=True)
        want_grads = torch.autograd.grad(want, ref, douts[b].transpose(0, 1)[None])
        got_b = [out.unbind()[b]] + [g.unbind()[b].transpose(0, 1) for g in grads]
        want_b = [want[0]] + [w[0] for w in want_grads]
        # A one-token sequence's dq and dk are exactly 0: measured against the output's scale there.
        scale = want.abs().max().item()
        for name, g, w in zip(("out", "dq", "dk", "dv"), got_b, want_b):
            assert relative_error(g.detach().cpu(), w, zero_scale=scale) <= tolerance, f"sequence {b}: {name}"


def test_nested_tensors_refuse_a_mask():
    q = torch.nested.nested_tensor([torch.randn(3, 2, 8), torch.randn(5, 2, 8)], layout=torch.jagged).transpose(1, 2)
    with pytest.raises(ValueError, match="nested tensors take no attn_mask"):
        flashattn_ext.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(1, dtype=torch.bool))


# The Hopper kernels' packed batches in one launch (path sm90).
# Query and key lengths of a packed batch: empty sequences, one token, lengths on and off the tiles'
# multiples, keys fewer and more than queries.
VARLEN_LENGTHS_Q = [300, 0, 1, 129, 700, 64, 5]


VARLEN_LENGTHS_K = [300, 7, 1, 400, 690, 0, 260]


VARLEN_OPTIONS = [dict(), dict(is_causal=True), dict(is_causal=True, causal_lower_right=True),
                  dict(window=(50, 10)), dict(window=(30, 0), is_causal=True, causal_lower_right=True)]


@on_paths("sm90")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("options", VARLEN_OPTIONS, ids=[str(o) for o in VARLEN_OPTIONS])
def test_varlen_forward_in_one_launch(path, options, head_dim, dtype):
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


@on_paths("sm90")
def test_varlen_in_one_launch_does_not_wait_for_the_device(path):
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


@on_paths("sm90")
@pytest.mark.parametrize("case", ["decreasing", "past_the_end", "longer_than_max_seqlen", "not_from_zero"])
def test_varlen_bad_bounds_in_one_launch_give_nan(path, case):
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
