"""varlen_attention: attention over a packed batch of sequences of different lengths (flash-attn's
varlen layout), with no work spent on padding.

The varlen_forward op takes the packed batch as a whole: on an H100 / H200 the Hopper forward runs
it as one launch (tiles over every sequence's query blocks); elsewhere, and for the backward for now,
each sequence runs as its own dense call on views of the packed tensors. Calls with dropout run
one attention_with_lse call per sequence here (each with its own random numbers).
"""
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from .attention import attention_with_lse
from .options import default_scale, lse_dtype, softcap_value, window_bounds


def varlen_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    causal_lower_right: bool = False,
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    return_lse: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention of each sequence's queries over its own keys, on packed tensors.

    query (total_q, Hq, E), key (total_k, Hkv, E), value (total_k, Hkv, Ev): sequence b holds rows
    cu_seqlens_q[b] to cu_seqlens_q[b + 1] of query and cu_seqlens_k[b] to cu_seqlens_k[b + 1] of
    key and value. cu_seqlens_*: 1-d int32 or int64, starting at 0, non-decreasing, ending at the
    total; max_seqlen_*: at least the longest sequence. Hkv must divide Hq (GQA without copies).
    The options mean what they mean for attention_with_lse (is_causal top-left unless
    causal_lower_right; window; softcap; dropout; alibi_slopes, here (Hq,) or (sequences, Hq)).
    Returns out (total_q, Hq, Ev) and, with return_lse, the log-sum-exp (Hq, total_q) in float32
    (float64 for float64 inputs), as flash-attn's varlen call does. Where the Hopper kernels take
    the call whole, cu_seqlens are read on the GPU only (no wait for it): bad ones give NaN
    results there instead of an error (see the README).
    """
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, Tensor) or tensor.dim() != 3:
            shape = tuple(tensor.shape) if isinstance(tensor, Tensor) else type(tensor).__name__
            raise ValueError(f"flashattn_ext: {name} must be a 3-d (total_tokens, heads, head_dim) tensor, got {shape}")
    if key.shape[:2] != value.shape[:2]:
        raise ValueError(
            f"flashattn_ext: key {tuple(key.shape)} and value {tuple(value.shape)} must agree in tokens and heads"
        )
    heads_q, heads_kv = query.shape[1], key.shape[1]
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(f"flashattn_ext: the {heads_kv} key/value heads must divide the {heads_q} query heads")
    for name, bounds in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(bounds, Tensor):
            raise TypeError(f"flashattn_ext: {name} must be a 1-d int32 or int64 torch.Tensor, got "
                            f"{type(bounds).__name__}")
    for name, longest in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not isinstance(longest, int) or isinstance(longest, bool) or not 0 <= longest < 2**63:
            raise ValueError(f"flashattn_ext: {name} must be an int from 0 to 2**63 - 1, got {longest!r}")
    sequences = cu_seqlens_q.numel() - 1
    per_sequence_slopes = isinstance(alibi_slopes, Tensor) and alibi_slopes.dim() == 2
    if per_sequence_slopes and alibi_slopes.shape[0] != sequences:
        raise RuntimeError(
            f"flashattn_ext: alibi_slopes has {alibi_slopes.shape[0]} rows but there are {sequences} sequences"
        )
    if isinstance(alibi_slopes, Tensor) and tuple(alibi_slopes.shape) not in ((heads_q,), (sequences, heads_q)):
        raise RuntimeError(
            f"flashattn_ext: alibi_slopes must have shape ({heads_q},) or ({sequences}, {heads_q}) (one slope a "
            f"query head, or one a sequence and query head), got {tuple(alibi_slopes.shape)}"
        )
    if dropout_p > 0:
        return _by_sequence(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                            is_causal, scale, causal_lower_right, window, softcap, alibi_slopes, return_lse)
    if isinstance(alibi_slopes, Tensor) and not per_sequence_slopes:
        alibi_slopes = alibi_slopes.expand(sequences, heads_q)  # (a view: read in place)
    window_left, window_right = window_bounds(window)
    out, lse = torch.ops.flashattn_ext.varlen_forward(
        query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, bool(is_causal),
        bool(causal_lower_right), float(default_scale(query.shape[2]) if scale is None else scale), window_left,
        window_right, softcap_value(softcap), alibi_slopes,
    )
    return (out, lse) if return_lse else out


def _by_sequence(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, is_causal,
                 scale, causal_lower_right, window, softcap, alibi_slopes, return_lse):
    """varlen_attention as one attention_with_lse call per sequence, on views of the packed tensors
    (the outputs concatenated): the path of calls with dropout."""
    heads_q, heads_kv = query.shape[1], key.shape[1]
    starts_q = _sequence_bounds("cu_seqlens_q", cu_seqlens_q, query.shape[0], max_seqlen_q)
    starts_k = _sequence_bounds("cu_seqlens_k", cu_seqlens_k, key.shape[0], max_seqlen_k)
    if len(starts_q) != len(starts_k):
        raise ValueError(
            f"flashattn_ext: cu_seqlens_q holds {len(starts_q) - 1} sequences but cu_seqlens_k {len(starts_k) - 1}"
        )

    # (tokens, heads, dim) slices seen as (1, heads, tokens, dim): views, no copies.
    def heads_first(t, begin, end):
        return t[begin:end].transpose(0, 1).unsqueeze(0)

    sequences = len(starts_q) - 1
    per_sequence_slopes = isinstance(alibi_slopes, Tensor) and alibi_slopes.dim() == 2
    outs, lses = [], []
    for b in range(sequences):
        out, lse = attention_with_lse(
            heads_first(query, starts_q[b], starts_q[b + 1]),
            heads_first(key, starts_k[b], starts_k[b + 1]),
            heads_first(value, starts_k[b], starts_k[b + 1]),
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=heads_q != heads_kv,
            causal_lower_right=causal_lower_right,
            window=window,
            softcap=softcap,
            alibi_slopes=alibi_slopes[b] if per_sequence_slopes else alibi_slopes,
        )
        outs.append(out[0].transpose(0, 1))  # (tokens, heads, Ev)
        lses.append(lse[0])  # (heads, tokens)
    if outs:
        out, lse = torch.cat(outs), torch.cat(lses, dim=1)
    else:  # no sequences: empty results of the right shapes and types
        out = query.new_empty((0, heads_q, value.shape[2]))
        lse = query.new_empty((heads_q, 0), dtype=lse_dtype(query.dtype))
    return (out, lse) if return_lse else out


def _sequence_bounds(name: str, cu_seqlens: Tensor, total: int, max_seqlen: int) -> list:
    """cu_seqlens checked and read to the host (a wait for the device where it lives there)."""
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() == 0:
        raise ValueError(f"flashattn_ext: {name} must be a non-empty 1-d tensor")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"flashattn_ext: {name} must be int32 or int64, got {cu_seqlens.dtype}")
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(f"flashattn_ext: {name} must start at 0 and end at the {total} packed tokens, got "
                         f"{bounds[0]} ... {bounds[-1]}")
    lengths = [end - begin for begin, end in zip(bounds, bounds[1:])]
    if any(length < 0 for length in lengths):
        raise ValueError(f"flashattn_ext: {name} must not decrease, got {bounds}")
    longest = max(lengths, default=0)
    if longest > max_seqlen:
        raise ValueError(f"flashattn_ext: the max_seqlen given with {name} ({max_seqlen!r}) is below its longest "
                         f"sequence ({longest})")
    return bounds
