"""decode_attention: a decoding step of inference, a few query tokens per sequence against a key/value
cache, contiguous or paged, optionally writing the new keys and values into it first."""
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from .options import default_scale, per_head_slopes, softcap_value, window_bounds


def decode_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    cache_seqlens: Tensor,
    *,
    block_table: Optional[Tensor] = None,
    key_new: Optional[Tensor] = None,
    value_new: Optional[Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    key_scale: Optional[Tensor] = None,
    value_scale: Optional[Tensor] = None,
    return_lse: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention of each sequence's query tokens to the keys in its cache (inference only: no backward).

    query (B, Hq, Sq, D) -> out (B, Hq, Sq, Dv). The caches hold, for each sequence b, its
    cache_seqlens[b] keys and values (cache_seqlens: (B,), int32 or int64, any stride, read in place):
    - contiguous: key_cache (B, H, capacity, D) and value_cache (B, H, capacity, Dv), any strides;
    - paged (block_table given, (B, blocks per sequence), int32 or int64, any strides): key_cache
      (num_blocks, block_size, H, D) and value_cache (num_blocks, block_size, H, Dv), vLLM's layout; key j
      of sequence b is row j % block_size of block block_table[b, j // block_size].
    H divides Hq (GQA/MQA: query head h reads cache head h // (Hq // H)). key_new (B, H, S_new, D) and
    value_new (B, H, S_new, Dv), when given, are written into the caches in place at positions
    cache_seqlens[b] .. cache_seqlens[b] + S_new - 1 (cache_seqlens itself is not changed), and the
    queries then see all cache_seqlens[b] + S_new keys. is_causal aligns the mask bottom-right within
    each sequence (query i of Sq sees keys up to cache_seqlens[b] + S_new - Sq + i), as for several
    new tokens in speculative decoding. window, softcap and alibi_slopes ((Hq,) or (B, Hq)) mean what
    they mean for attention_with_lse, the window and ALiBi's distance taken from that bottom-right
    diagonal, and so do sinks (attention sinks, (Hq,): one more score a row, of value 0). With
    return_lse, also returns the log-sum-exp of
    each query's scaled scores, (B, Hq, Sq), float32 (float64 for float64 inputs). A query that sees no
    key gets out = 0 and lse = -inf (with sinks, its head's sink).

    FP8 caches (vLLM's kv_cache_dtype="fp8_e4m3"): key_cache and value_cache of dtype
    torch.float8_e4m3fn, with key_scale and value_scale, float32 on the caches' device, each one scale
    (shape () or (1,)) or one a cache head ((H,)): a stored key x stands for x * key_scale[h], a value
    likewise. The queries (and key_new, value_new, out) are float32, bfloat16 or float16; key_new and
    value_new are written as e4m3 of x / scale, rounded to nearest and saturated to +-448 (where torch's
    own conversion would give NaN past 480). On a Hopper GPU at head dim 128 the decode kernel reads
    the e4m3 bytes itself (converted to float16 on the way to the tensor cores, exactly); elsewhere on
    CUDA the attention reads copies of the caches dequantized to the queries' dtype.

    On CUDA (float16 and bfloat16, head dims up to 256) each sequence's keys are split into chunks
    whose partial results merge through their log-sum-exps (flash-decoding). cache_seqlens and the
    block table are not read back there to check them (that would wait for the GPU): a sequence
    whose length does not fit its cache (negative, or past the capacity with the new keys), or
    whose block table names a block outside the cache, gets NaN out and lse, and no new key is
    written where it does not fit; nothing outside the caches is read or written. The CPU raises
    on such values, and so does CUDA with FLASHATTN_EXT_CHECK_INPUTS=1 (read at each call), which
    reads them to the host first.
    """
    tensors = {"query": query, "key_cache": key_cache, "value_cache": value_cache, "cache_seqlens": cache_seqlens,
               "block_table": block_table, "key_new": key_new, "value_new": value_new, "sinks": sinks,
               "key_scale": key_scale, "value_scale": value_scale}
    for name, tensor in tensors.items():
        if tensor is not None and not isinstance(tensor, Tensor):
            raise TypeError(f"flashattn_ext: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors.values()):
        raise RuntimeError(
            "flashattn_ext: decode_attention is for inference and has no backward; call it under "
            "torch.no_grad() or torch.inference_mode(), or on tensors that do not require grad"
        )
    if scale is None:
        scale = default_scale(query.shape[-1] if query.dim() > 0 else 0)
    window_left, window_right = window_bounds(window)
    slopes = per_head_slopes(alibi_slopes, tuple(query.shape[:1]), query.shape[1]) if query.dim() == 4 else alibi_slopes
    out, lse = torch.ops.flashattn_ext.decode_attention(
        query, key_cache, value_cache, cache_seqlens, block_table, key_new, value_new, bool(is_causal), float(scale),
        window_left, window_right, softcap_value(softcap), slopes, sinks, key_scale, value_scale,
    )
    return (out, lse) if return_lse else out
