"""flashattn_ext as torch's own flash-attention implementation (torch.nn.attention's registry).

Importing flashattn_ext registers the name "flashattn_ext" (register_with_torch); nothing changes until
a user activates it:

    torch.nn.attention.activate_flash_attention_impl("flashattn_ext")

From then on the CUDA kernels of aten's flash-attention ops (_scaled_dot_product_flash_attention, its
backward, and _flash_attention_forward / _backward, dense and packed) are ours: every SDPA call that
picks the flash backend (eager, torch.compile, DTensor, torch's context parallel) runs flashattn_ext.
torch.nn.attention.restore_flash_attention_impl() gives torch's kernels back.

The FP8 overloads (`.quantized`, forward only: float8_e4m3fn inputs, descales a (sequence, key/value
head), bfloat16 out) run flashattn_ext.scaled_dot_product_attention_fp8's op.

The aten ops' contract (as torch's FA2, FA3 and FA4 keep it): the SDPA-level ops take and return
(batch, heads, seq, dim) tensors, the others (batch, seq, heads, dim), or (total, heads, dim) with
cum_seq_q / cum_seq_k; the log-sum-exp is float32, (batch, heads, seq) or (heads, total); causal and
window bounds align bottom-right. Dropout's random state travels in the rng_state (two uint64: our seed
and offset) and `unused` (one uint64: our bits) outputs, which aten hands the backward unchanged.
"""
from typing import Optional

import torch
from torch import Tensor
from torch.nn.attention import register_flash_attention_impl

from .options import default_scale

_NAME = "flashattn_ext"


def register_with_torch() -> None:
    """Registers flashattn_ext under the name "flashattn_ext" with torch.nn.attention's flash-attention
    registry (without activating it). Called when flashattn_ext is imported; calling it again is harmless."""
    register_flash_attention_impl(_NAME, register_fn=_activate)


class _Handle:
    """What the registry keeps while flashattn_ext is active: the library that holds our aten kernels.
    remove() drops it, and with it the kernels (torch's come back)."""

    def __init__(self, library: torch.library.Library):
        self.library: Optional[torch.library.Library] = library

    def remove(self) -> None:
        self.library = None


def _activate() -> _Handle:
    library = torch.library.Library("aten", "IMPL", "CUDA")  # noqa: TOR901  (replacing aten's own kernels)
    library.impl("_scaled_dot_product_flash_attention", _sdpa_flash_forward, "CUDA")
    library.impl("_scaled_dot_product_flash_attention_backward", _sdpa_flash_backward, "CUDA")
    library.impl("_flash_attention_forward", _flash_forward, "CUDA")
    library.impl("_flash_attention_backward", _flash_backward, "CUDA")
    # FP8 (torch.nn.attention.experimental._scaled_dot_product_attention_quantized calls the first)
    library.impl("_scaled_dot_product_flash_attention.quantized", _sdpa_flash_forward_fp8, "CUDA")
    library.impl("_flash_attention_forward.quantized", _flash_forward_fp8, "CUDA")
    return _Handle(library)


def _scale(scale: Optional[float], head_dim: int) -> float:
    return scale if scale is not None else default_scale(head_dim)


def _window(left: Optional[int], right: Optional[int]):
    return (-1 if left is None else left), (-1 if right is None else right)


def _aten_rng_state(rng_state: Tensor, query: Tensor):
    """Our rng_state ({seed, offset, bits} int64, or empty without dropout) as aten's (rng_state,
    unused) pair: (2,) and () uint64 views of it, or zeros."""
    if rng_state.numel() == 0:
        return (torch.zeros(2, dtype=torch.uint64, device=query.device),
                torch.zeros((), dtype=torch.uint64, device=query.device))
    as_uint64 = rng_state.view(torch.uint64)
    return as_uint64[:2], as_uint64[2]


def _aten_rng_state_without_dropout(query: Tensor):
    """aten's (rng_state, unused) pair of a forward that drew nothing: zeros."""
    return _aten_rng_state(torch.empty(0, dtype=torch.long, device=query.device), query)


def _our_rng_state(rng_state: Tensor, unused: Tensor, dropout_p: float, query: Tensor) -> Tensor:
    """_aten_rng_state undone: the int64 {seed, offset, bits} our backward takes (empty without dropout)."""
    if dropout_p == 0.0:
        return torch.empty(0, dtype=torch.long, device=query.device)
    if rng_state.dtype != torch.uint64 or rng_state.shape != (2,) or unused.shape != ():
        raise RuntimeError(
            "flashattn_ext: the flash backward's rng_state is not the one its forward made; was the forward run "
            "before flashattn_ext was activated as torch's flash-attention implementation?"
        )
    return torch.cat([rng_state.view(torch.long), unused.view(torch.long).reshape(1)])


def _debug_mask(wanted: bool, rng_state: Tensor, dropout_p: float, out: Tensor, len_k: int) -> Tensor:
    """aten's debug_attn_mask for a (B, H, Lq, E) output: when wanted and with dropout, (B, H, Lq, Lk) in
    out's dtype, +1 where the forward kept a score and -1 where it dropped it (FA2's mask carries the
    decision in its sign, which is what torch's tests read; its magnitudes, the probabilities, are not
    kept here). Otherwise empty. Debugging only: it is the N x N matrix the kernels never write."""
    if not wanted or dropout_p == 0.0:
        return out.new_empty(0)
    batch, heads, len_q, _ = out.shape
    kept = torch.ops.flashattn_ext.dropout_mask(rng_state, dropout_p, batch, heads, len_q, len_k, 0, len_q)
    return torch.where(kept, 1.0, -1.0).to(out.dtype)


def _unsupported(what: str) -> RuntimeError:
    return RuntimeError(f"flashattn_ext (as torch's flash-attention implementation): {what} is not supported")


# ----------------------------------------------------------------------------- SDPA-level ops (BHSD)

def _sdpa_flash_forward(query: Tensor, key: Tensor, value: Tensor, dropout_p: float = 0.0, is_causal: bool = False,
                        return_debug_mask: bool = False, *, scale: Optional[float] = None):
    out, lse, rng_state = torch.ops.flashattn_ext.attention_forward(
        query, key, value, None, dropout_p, is_causal, True, _scale(scale, query.size(-1)))
    seed, offset = _aten_rng_state(rng_state, query)
    debug_mask = _debug_mask(return_debug_mask, rng_state, dropout_p, out, key.size(2))
    return out, lse, None, None, query.size(2), key.size(2), seed, offset, debug_mask


def _sdpa_flash_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, logsumexp: Tensor,
                         cum_seq_q: Optional[Tensor], cum_seq_k: Optional[Tensor], max_q: int, max_k: int,
                         dropout_p: float, is_causal: bool, philox_seed: Tensor, philox_offset: Tensor, *,
                         scale: Optional[float] = None):
    rng_state = _our_rng_state(philox_seed, philox_offset, dropout_p, query)
    dq, dk, dv, _ = torch.ops.flashattn_ext.attention_backward(
        grad_out, query, key, value, out, logsumexp, rng_state, None, dropout_p, is_causal, True,
        _scale(scale, query.size(-1)), False)
    return dq, dk, dv


def _sdpa_flash_forward_fp8(query: Tensor, key: Tensor, value: Tensor, q_descale: Optional[Tensor],
                            k_descale: Optional[Tensor], v_descale: Optional[Tensor], dropout_p: float = 0.0,
                            is_causal: bool = False, return_debug_mask: bool = False, *,
                            scale: Optional[float] = None):
    if query.dtype != torch.float8_e4m3fn and all(d is None for d in (q_descale, k_descale, v_descale)):
        return _sdpa_flash_forward(query, key, value, dropout_p, is_causal, return_debug_mask, scale=scale)
    if dropout_p != 0.0:
        raise _unsupported("dropout with FP8 inputs")
    out, lse = torch.ops.flashattn_ext.attention_forward_fp8(
        query, key, value, q_descale, k_descale, v_descale, is_causal, True, _scale(scale, query.size(-1)))
    seed, offset = _aten_rng_state_without_dropout(query)
    return out, lse, None, None, query.size(2), key.size(2), seed, offset, out.new_empty(0)


# ----------------------------------------------------------------------------- flash-level ops (BSHD, or packed)

def _heads_first(*tensors: Tensor):
    return tuple(t.transpose(1, 2) for t in tensors)


def _flash_forward(query: Tensor, key: Tensor, value: Tensor, cum_seq_q: Optional[Tensor],
                   cum_seq_k: Optional[Tensor], max_q: int, max_k: int, dropout_p: float, is_causal: bool,
                   return_debug_mask: bool, *, scale: Optional[float] = None, window_size_left: Optional[int] = None,
                   window_size_right: Optional[int] = None, seqused_k: Optional[Tensor] = None,
                   alibi_slopes: Optional[Tensor] = None):
    if seqused_k is not None:
        raise _unsupported("seqused_k")
    if alibi_slopes is not None:
        # (aten's flash backward takes no slopes: its gradients would be those without ALiBi.)
        raise _unsupported("alibi_slopes through aten's flash op (flashattn_ext.attention_with_lse takes them)")
    scale = _scale(scale, query.size(-1))
    left, right = _window(window_size_left, window_size_right)
    if cum_seq_q is None:
        q, k, v = _heads_first(query, key, value)
        out, lse, rng_state = torch.ops.flashattn_ext.attention_forward(
            q, k, v, None, dropout_p, is_causal, True, scale, left, right)
        seed, offset = _aten_rng_state(rng_state, query)
        debug_mask = _debug_mask(return_debug_mask, rng_state, dropout_p, out, k.size(2))
        return out.transpose(1, 2), lse, seed, offset, debug_mask
    if dropout_p != 0.0:
        raise _unsupported("dropout on a packed batch (cum_seq_q)")
    debug_mask = query.new_empty(0)
    out, lse = torch.ops.flashattn_ext.varlen_forward(
        query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, True, scale, left, right)
    seed, offset = _aten_rng_state_without_dropout(query)
    return out, lse, seed, offset, debug_mask


def _flash_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, logsumexp: Tensor,
                    cum_seq_q: Optional[Tensor], cum_seq_k: Optional[Tensor], max_q: int, max_k: int,
                    dropout_p: float, is_causal: bool, rng_state: Tensor, unused: Tensor, *,
                    scale: Optional[float] = None, window_size_left: Optional[int] = None,
                    window_size_right: Optional[int] = None):
    scale = _scale(scale, query.size(-1))
    left, right = _window(window_size_left, window_size_right)
    if cum_seq_q is None:
        ours = _our_rng_state(rng_state, unused, dropout_p, query)
        g, q, k, v, o = _heads_first(grad_out, query, key, value, out)
        dq, dk, dv, _ = torch.ops.flashattn_ext.attention_backward(
            g, q, k, v, o, logsumexp, ours, None, dropout_p, is_causal, True, scale, False, left, right)
        return _heads_first(dq, dk, dv)
    if dropout_p != 0.0:
        raise _unsupported("dropout on a packed batch (cum_seq_q)")
    return torch.ops.flashattn_ext.varlen_backward(
        grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, True, scale,
        left, right)


def _flash_forward_fp8(query: Tensor, key: Tensor, value: Tensor, cum_seq_q: Optional[Tensor],
                       cum_seq_k: Optional[Tensor], max_q: int, max_k: int, dropout_p: float, is_causal: bool,
                       return_debug_mask: bool, q_descale: Optional[Tensor], k_descale: Optional[Tensor],
                       v_descale: Optional[Tensor], *, scale: Optional[float] = None,
                       window_size_left: Optional[int] = None, window_size_right: Optional[int] = None,
                       seqused_k: Optional[Tensor] = None, alibi_slopes: Optional[Tensor] = None):
    if query.dtype != torch.float8_e4m3fn and all(d is None for d in (q_descale, k_descale, v_descale)):
        return _flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                              return_debug_mask, scale=scale, window_size_left=window_size_left,
                              window_size_right=window_size_right, seqused_k=seqused_k, alibi_slopes=alibi_slopes)
    for name, given in (("dropout", dropout_p != 0.0), ("a packed batch (cum_seq_q)", cum_seq_q is not None),
                        ("seqused_k", seqused_k is not None), ("alibi_slopes", alibi_slopes is not None)):
        if given:
            raise _unsupported(f"{name} with FP8 inputs")
    left, right = _window(window_size_left, window_size_right)
    q, k, v = _heads_first(query, key, value)
    out, lse = torch.ops.flashattn_ext.attention_forward_fp8(
        q, k, v, q_descale, k_descale, v_descale, is_causal, True, _scale(scale, query.size(-1)), left, right)
    seed, offset = _aten_rng_state_without_dropout(query)
    return out.transpose(1, 2), lse, seed, offset, out.new_empty(0)
