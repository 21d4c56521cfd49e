"""attention_with_lse, SDPA's semantics with the log-sum-exp and the options SDPA lacks, on top of the 4-d
ops registered in csrc/schemas.cpp (sdpa.py puts SDPA's own signature on it).

The shim only reshapes: it maps SDPA's (N, ..., H, L, E) layout, broadcasting
and GQA onto 4-d (batch, heads, seq_len, head_dim) views. Broadcast dimensions
become stride-0 views, so no data is copied unless leading batch dimensions
cannot be merged into one (a rank above 4 with a broadcast batch dimension).
"""
import math
from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.nn.attention.bias import CausalBias, CausalVariant

from .options import default_scale, per_head_slopes, softcap_value, window_bounds


def attention_with_lse(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    causal_lower_right: bool = False,
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Like scaled_dot_product_attention, but also returns the log-sum-exp of
    each query row's scaled scores, shape (N, ..., Hq, L): float32, or float64
    for float64 inputs. Rows that see no key get out = 0 and lse = -inf.
    The lse output is not differentiable.

    causal_lower_right=True aligns the causal mask bottom-right (query i sees
    keys j <= i + S - L) instead of top-left; it only matters with is_causal.

    window=(left, right): sliding-window attention, query i sees the keys j with
    i + d - left <= j <= i + d + right, d the causal diagonal's offset (0, or
    S - L with causal_lower_right); None on a side leaves it open. With
    is_causal, right is 0 whatever is given (Mistral's window of W tokens is
    window=(W - 1, 0) with is_causal=True).

    softcap=c: logit softcapping (Gemma 2), the scaled scores s become
    c * tanh(s / c) before attn_mask is added; the gradients go through it.

    alibi_slopes: ALiBi (Press et al.), a float32 tensor (Hq,) or (..., Hq) with
    query's batch dims, on query's device: -slope * |i + d - j| is added to the
    scaled (and capped) scores of query i and key j, before attn_mask, d the
    diagonal's offset as for window (flash-attn's bias with causal_lower_right).
    The slopes get no gradient.

    sinks: attention sinks (gpt-oss), a floating-point tensor (Hq,) on query's
    device: each query row's softmax also spans one more key, whose score is
    sinks[h] (beside the scaled, capped and biased scores) and whose value is
    0, so rows weigh their keys less. lse includes it; a row that sees no key
    gets out = 0 and lse = sinks[h]. The sinks get a gradient (no double
    backward).
    """
    if _is_plain_4d(query, key, value, attn_mask, enable_gqa) and window is None and softcap is None and \
            alibi_slopes is None and sinks is None:
        # The op checks dtypes, devices and sizes itself: a decoding step's host time shows in its latency.
        out, lse, _ = torch.ops.flashattn_ext.attention_forward(
            query, key, value, attn_mask, float(dropout_p), bool(is_causal), bool(causal_lower_right),
            float(default_scale(query.shape[3]) if scale is None else scale))
        return out, lse
    args, lead, len_q, head_dim_v = _op_arguments(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                                  enable_gqa, causal_lower_right, window, softcap, alibi_slopes)
    if sinks is not None and not isinstance(sinks, Tensor):
        raise TypeError(f"flashattn_ext: sinks must be a torch.Tensor or None, got {type(sinks).__name__}")
    out, lse, _ = torch.ops.flashattn_ext.attention_forward(*args, sinks=sinks)
    return _reshaped(out, (*lead, len_q, head_dim_v)), _reshaped(lse, (*lead, len_q))


def kernel_route(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    causal_lower_right: bool = False,
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    backward: bool = False,
) -> Tuple[str, str]:
    """Which kernel family takes this attention_with_lse call (with backward=True, its backward), and
    why, without running it: on CUDA "sm90", "sm80", "decode" or "aten" (the fallback), from the routing
    table in csrc/cuda/route.h; on the CPU "cpu" or "aten". A kernel may still refuse at launch tensors
    it cannot address (the Hopper kernels' copy engine), and the call then runs the next row's."""
    args, *_ = _op_arguments(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                             causal_lower_right, window, softcap, alibi_slopes)
    family, reason = torch.ops.flashattn_ext.kernel_route(*args, bool(backward))
    return family, reason


def _op_arguments(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_lower_right,
                  window, softcap, alibi_slopes):
    """attention_with_lse's arguments checked as SDPA checks them and mapped onto the op's 4-d views:
    returns (the attention_forward op's arguments, the output's leading dims, len_q, head_dim_v)."""
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"flashattn_ext: {name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() < 2:
            raise RuntimeError(
                f"flashattn_ext: {name} must have at least 2 dimensions (..., seq_len, head_dim), "
                f"got shape {tuple(tensor.shape)}"
            )
    if not (query.dtype == key.dtype == value.dtype):
        raise RuntimeError(
            f"flashattn_ext: query, key and value must have the same dtype, got {query.dtype}, "
            f"{key.dtype} and {value.dtype}"
        )
    if not (query.device == key.device == value.device):
        raise RuntimeError(
            f"flashattn_ext: query, key and value must be on the same device, got {query.device}, "
            f"{key.device} and {value.device}"
        )
    if attn_mask is not None and is_causal:
        raise RuntimeError("flashattn_ext: attn_mask must be None when is_causal=True")
    if isinstance(attn_mask, CausalBias):
        # torch's causal_upper_left / causal_lower_right objects: plain causal masking, no mask to read.
        if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (query.shape[-2], key.shape[-2]):
            raise RuntimeError(
                f"flashattn_ext: attn_mask is a CausalBias for {attn_mask.seq_len_q} queries and "
                f"{attn_mask.seq_len_kv} keys, but there are {query.shape[-2]} and {key.shape[-2]}"
            )
        is_causal, causal_lower_right = True, attn_mask.variant == CausalVariant.LOWER_RIGHT
        attn_mask = None
    elif attn_mask is not None and not isinstance(attn_mask, Tensor):
        raise TypeError(f"flashattn_ext: attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if key.shape[-1] != query.shape[-1]:
        raise RuntimeError(
            f"flashattn_ext: key head dim {key.shape[-1]} does not match query head dim {query.shape[-1]}"
        )
    if key.shape[-2] != value.shape[-2]:
        raise RuntimeError(
            f"flashattn_ext: key has sequence length {key.shape[-2]} but value has {value.shape[-2]}"
        )

    # Give inputs without a head dimension a head dimension of 1.
    q, k, v = (t if t.dim() >= 3 else t.unsqueeze(0) for t in (query, key, value))
    heads_q, heads_k, heads_v = q.shape[-3], k.shape[-3], v.shape[-3]
    if enable_gqa:
        if heads_k != heads_v or heads_k == 0 or heads_q % heads_k != 0:
            raise RuntimeError(
                f"flashattn_ext: with enable_gqa, key and value must have the same number of heads, dividing "
                f"the query's; got query {heads_q}, key {heads_k}, value {heads_v}"
            )
        heads_kv = heads_k
    else:
        heads_q = heads_kv = _broadcast("heads", (heads_q,), (heads_k,), (heads_v,))[0]
    batch = _broadcast("batch dimensions", q.shape[:-3], k.shape[:-3], v.shape[:-3])
    flat_batch = math.prod(batch)
    len_q, len_k, head_dim, head_dim_v = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]

    q = _flattened(q, batch, heads_q, len_q, head_dim)
    k = _flattened(k, batch, heads_kv, len_k, head_dim)
    v = _flattened(v, batch, heads_kv, len_k, head_dim_v)
    if attn_mask is not None:
        # Broadcast to (*batch, heads, L, S) as a stride-0 view: the kernels read it in place.
        try:
            attn_mask = attn_mask.expand(*batch, heads_q, len_q, len_k)
        except RuntimeError:
            raise RuntimeError(
                f"flashattn_ext: attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                f"{(*batch, heads_q, len_q, len_k)}"
            ) from None
        attn_mask = attn_mask.reshape(flat_batch, heads_q, len_q, len_k)
    if scale is None:
        scale = default_scale(head_dim)
    window_left, window_right = window_bounds(window)
    slopes = per_head_slopes(alibi_slopes, batch, heads_q)

    args = (q, k, v, attn_mask, float(dropout_p), bool(is_causal), bool(causal_lower_right), float(scale),
            window_left, window_right, softcap_value(softcap), slopes)
    # SDPA's output has the broadcast rank of its inputs.
    lead = (*batch, heads_q) if max(query.dim(), key.dim(), value.dim()) >= 3 else ()
    return args, lead, len_q, head_dim_v


def _is_plain_4d(query, key, value, attn_mask, enable_gqa) -> bool:
    """Whether the call is already the op's: 4-d (B, H, L, E) tensors of one batch size, dtype and
    device, no mask, and the heads equal (with enable_gqa, key's dividing query's), so that nothing is
    left to broadcast or reshape. Anything else takes the general path, which raises SDPA's errors."""
    if attn_mask is not None or type(query) is not Tensor or type(key) is not Tensor or type(value) is not Tensor:
        return False
    q_shape, k_shape, v_shape = query.shape, key.shape, value.shape
    return (len(q_shape) == len(k_shape) == len(v_shape) == 4 and q_shape[0] == k_shape[0] == v_shape[0]
            and k_shape[1] == v_shape[1]
            and (q_shape[1] == k_shape[1] or (enable_gqa and k_shape[1] > 0 and q_shape[1] % k_shape[1] == 0))
            and query.dtype == key.dtype == value.dtype and query.device == key.device == value.device)


def _flattened(t: Tensor, batch: Tuple[int, ...], heads: int, length: int, dim: int) -> Tensor:
    """t broadcast to (*batch, heads, length, dim) and flattened to (prod(batch), heads, length, dim): t
    itself where it has that shape (an expand or reshape would add a view, and its autograd node, to every
    call)."""
    shape = (math.prod(batch), heads, length, dim)
    return t if t.shape == shape else t.expand(*batch, heads, length, dim).reshape(shape)


def _reshaped(t: Tensor, shape: Tuple[int, ...]) -> Tensor:
    """t in shape: t itself where it has it (as _flattened)."""
    return t if t.shape == shape else t.reshape(shape)


def _broadcast(what: str, *shapes) -> torch.Size:
    if all(shape == shapes[0] for shape in shapes):
        return torch.Size(shapes[0])
    try:
        return torch.broadcast_shapes(*shapes)
    except RuntimeError:
        shapes_text = ", ".join(str(tuple(shape)) for shape in shapes)
        raise RuntimeError(
            f"flashattn_ext: the {what} of query, key and value do not broadcast: {shapes_text}"
        ) from None


def set_dropout_bits(bits: int) -> None:
    """Chooses the random numbers of dropout for the calls that follow: 8 bits (the default, the
    fastest: the drop probability is rounded to a multiple of 1/256, 0.1 drops 26/256) or 16 bits
    (rounded to 1/65536). A backward draws what its forward drew, whatever the setting is then."""
    torch.ops.flashattn_ext.set_dropout_bits(bits)


def get_dropout_bits() -> int:
    """The bits of dropout's random numbers that calls draw now (see set_dropout_bits)."""
    return torch.ops.flashattn_ext.get_dropout_bits()
