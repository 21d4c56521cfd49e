"""varlen_attention: packed batches of sequences of different lengths (empty ones included) against
the naive attention in float64, one sequence at a time; values, log-sum-exps and gradients."""
import pytest
import torch

import flashattn_ext
from helpers import ERROR_FLOOR, device_dtype_params, naive_attention, relative_error

LENGTHS_Q = [5, 0, 140, 33]
LENGTHS_K = [9, 4, 140, 0]  # a sequence with no key: out 0, lse -inf


DEVICE_DTYPES = device_dtype_params({"cpu": (torch.float64, torch.float32), "cuda": (torch.bfloat16,)})


def cumulative(lengths, device):
    return torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)


@pytest.mark.parametrize("device, dtype", DEVICE_DTYPES)
@pytest.mark.parametrize(
    "options",
    [dict(), dict(is_causal=True), dict(is_causal=True, causal_lower_right=True), dict(window=(20, 3), softcap=3.0),
     dict(alibi_slopes="per_head", is_causal=True), dict(alibi_slopes="per_sequence")],
    ids=["full", "causal", "causal_lower_right", "window_softcap", "alibi_causal", "alibi_per_sequence"],
)
def test_matches_float64_sequence_by_sequence(options, device, dtype):
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


@pytest.mark.parametrize("device, dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("is_causal", [False, True])
def test_nested_tensors_in_scaled_dot_product_attention(is_causal, device, dtype):
    """Jagged nested tensors (N, H, j, E), as SDPA takes them (here with GQA, which SDPA's own nested
    path lacks): values and gradients against each sequence's naive attention in float64."""
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
