"""Fake (meta) kernels: the output shapes, dtypes and strides of each op, without
computing anything. They mirror the allocations in csrc/ops_*.cpp and the device files."""
import torch

from .fp8 import BLOCK_ROWS
from .options import lse_dtype


def _empty_in_layout_of(query: torch.Tensor, sizes) -> torch.Tensor:
    """empty_in_layout_of in csrc/ops_checks.cpp: dims 0-2 in the memory order of query's (by stride, ties in dim
    order; sorted() is stable), the last dim contiguous."""
    order = sorted(range(3), key=lambda dim: -query.stride(dim))
    out = query.new_empty([sizes[dim] for dim in order] + [sizes[3]])
    return out.permute([order.index(dim) for dim in range(3)] + [3])


def _check_devices(query, **tensors):
    """The real kernels' device checks. A meta tensor among CPU ones sends the whole call here, and the
    fake kernel must then raise as the real one would, not return memory nobody computed."""
    for name, tensor in tensors.items():
        if tensor is not None and tensor.device != query.device:
            raise RuntimeError(f"flashattn_ext: {name} is on {tensor.device} but query is on {query.device}")


@torch.library.register_fake("flashattn_ext::attention_forward")
def _attention_forward_fake(query, key, value, attn_mask, dropout_p, is_causal, causal_lower_right, scale,
                            window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, sinks=None):
    _check_devices(query, key=key, value=value, attn_mask=attn_mask, alibi_slopes=alibi_slopes, sinks=sinks)
    if sinks is not None and tuple(sinks.shape) != (query.shape[1],):
        raise RuntimeError(f"flashattn_ext: sinks must have shape ({query.shape[1]},), one logit a query head, "
                           f"got {tuple(sinks.shape)}")
    batch, heads, len_q, _ = query.shape
    out = _empty_in_layout_of(query, (batch, heads, len_q, value.shape[-1]))
    lse = query.new_empty((batch, heads, len_q), dtype=lse_dtype(query.dtype))
    rng_state = query.new_empty((3,) if dropout_p > 0 else (0,), dtype=torch.int64)
    return out, lse, rng_state


@torch.library.register_fake("flashattn_ext::attention_backward")
def _attention_backward_fake(grad_out, query, key, value, out, lse, rng_state, attn_mask, dropout_p, is_causal,
                             causal_lower_right, scale, compute_grad_attn_mask, window_left=-1, window_right=-1,
                             softcap=0.0, alibi_slopes=None, sinks=None):
    _check_devices(query, grad_out=grad_out, key=key, value=value, out=out, lse=lse, attn_mask=attn_mask,
                   alibi_slopes=alibi_slopes, rng_state=rng_state if dropout_p > 0 else None, sinks=sinks)
    grad_attn_mask = query.new_empty(attn_mask.shape if compute_grad_attn_mask else (0,))
    return (torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), grad_attn_mask)


@torch.library.register_fake("flashattn_ext::decode_attention")
def _decode_attention_fake(query, key_cache, value_cache, cache_seqlens, block_table, key_new, value_new, is_causal,
                           scale, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, sinks=None,
                           key_scale=None, value_scale=None):
    _check_devices(query, key_cache=key_cache, value_cache=value_cache, cache_seqlens=cache_seqlens,
                   block_table=block_table, key_new=key_new, value_new=value_new, alibi_slopes=alibi_slopes,
                   sinks=sinks, key_scale=key_scale, value_scale=value_scale)
    batch, heads, len_q, _ = query.shape
    out = _empty_in_layout_of(query, (batch, heads, len_q, value_cache.shape[-1]))
    lse = query.new_empty((batch, heads, len_q), dtype=lse_dtype(query.dtype))
    return out, lse


@torch.library.register_fake("flashattn_ext::attention_forward_fp8")
def _attention_forward_fp8_fake(query, key, value, q_descale, k_descale, v_descale, is_causal, causal_lower_right,
                                scale, window_left=-1, window_right=-1):
    _check_devices(query, key=key, value=value, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    batch, heads, len_q, _ = query.shape
    out = query.new_empty((batch, heads, len_q, value.shape[-1]), dtype=torch.bfloat16)
    lse = query.new_empty((batch, heads, len_q), dtype=torch.float32)
    return out, lse


@torch.library.register_fake("flashattn_ext::attention_forward_quantized")
def _attention_forward_quantized_fake(query, key, value, is_causal, causal_lower_right, scale, window_left=-1,
                                      window_right=-1):
    _check_devices(query, key=key, value=value)
    batch, heads, len_q, _ = query.shape
    out = query.new_empty((batch, heads, len_q, value.shape[-1]))
    lse = query.new_empty((batch, heads, len_q), dtype=torch.float32)
    return out, lse


@torch.library.register_fake("flashattn_ext::attention_backward_fp8")
def _attention_backward_fp8_fake(grad_out, query, key, value, out, lse, q_descale, k_descale, v_descale, is_causal,
                                 causal_lower_right, scale, window_left=-1, window_right=-1):
    _check_devices(query, grad_out=grad_out, key=key, value=value, out=out, lse=lse, q_descale=q_descale,
                   k_descale=k_descale, v_descale=v_descale)
    return tuple(grad_out.new_empty(t.shape) for t in (query, key, value))


@torch.library.register_fake("flashattn_ext::quantize_fp8")
def _quantize_fp8_fake(x, heads_kv, per_block=False):
    batch, _, length, _ = x.shape
    blocks = (length + BLOCK_ROWS - 1) // BLOCK_ROWS
    descale = x.new_empty((batch, heads_kv, blocks) if per_block else (batch, heads_kv), dtype=torch.float32)
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), descale


@torch.library.register_fake("flashattn_ext::dequantize_fp8")
def _dequantize_fp8_fake(x, descale, dtype):
    _check_devices(x, descale=descale)
    return x.new_empty(x.shape, dtype=dtype)


@torch.library.register_fake("flashattn_ext::dropout_mask")
def _dropout_mask_fake(rng_state, dropout_p, batch, heads, len_q, len_k, row_begin, row_end):
    return rng_state.new_empty((batch, heads, row_end - row_begin, len_k), dtype=torch.bool)


@torch.library.register_fake("flashattn_ext::varlen_forward")
def _varlen_forward_fake(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                         causal_lower_right, scale, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None):
    _check_devices(query, key=key, value=value, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                   alibi_slopes=alibi_slopes)
    total_q, heads, _ = query.shape
    out = query.new_empty((total_q, heads, value.shape[-1]))
    lse = query.new_empty((heads, total_q), dtype=lse_dtype(query.dtype))
    return out, lse


@torch.library.register_fake("flashattn_ext::varlen_backward")
def _varlen_backward_fake(grad_out, query, key, value, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, is_causal, causal_lower_right, scale, window_left=-1, window_right=-1,
                          softcap=0.0, alibi_slopes=None):
    _check_devices(query, grad_out=grad_out, key=key, value=value, out=out, lse=lse, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k, alibi_slopes=alibi_slopes)
    return tuple(t.new_empty(t.shape) for t in (query, key, value))


@torch.library.register_fake("flashattn_ext::sinks_backward")
def _sinks_backward_fake(grad_out, out, lse, sinks):
    _check_devices(out, grad_out=grad_out, lse=lse, sinks=sinks)
    return sinks.new_empty(sinks.shape)
