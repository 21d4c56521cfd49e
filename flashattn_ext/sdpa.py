"""torch.nn.functional.scaled_dot_product_attention's signature and semantics: attention_with_lse
without the log-sum-exp, and torch's jagged nested tensors through varlen_attention."""
from typing import Optional

import torch
from torch import Tensor

from .attention import attention_with_lse
from .varlen import varlen_attention


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Drop-in replacement for torch.nn.functional.scaled_dot_product_attention.

    query (N, ..., Hq, L, E), key (N, ..., H, S, E), value (N, ..., H, S, Ev)
    -> (N, ..., Hq, L, Ev). is_causal aligns the mask top-left, as torch does.
    attn_mask: bool (True takes part) or float (added to the scores), broadcasting
    to (N, ..., Hq, L, S), or one of torch's CausalBias objects.

    Nested (jagged) tensors of shape (N, H, j, E), as SDPA takes them, run
    through varlen_attention (no attn_mask, as in SDPA).
    """
    if any(isinstance(t, Tensor) and t.is_nested for t in (query, key, value)):
        return _nested_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    out, _ = attention_with_lse(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return out


def _nested_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> Tensor:
    """SDPA on jagged nested tensors (N, H, j, E): their packed values and offsets go to
    varlen_attention, and the output comes back as a nested tensor of the same layout."""
    packed = []
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not (t.is_nested and t.layout == torch.jagged and t.dim() == 4 and t._ragged_idx == 2):
            raise ValueError(
                f"flashattn_ext: with nested tensors, {name} must be a jagged nested tensor of shape "
                f"(N, H, j, E) (a (N, j, H, E) one transposed), as SDPA takes them"
            )
        sequence_major = t.transpose(1, 2)  # (N, j, H, E): values() is (total, H, E)
        # The longest sequence as torch's SDPA takes it: cached on the nested tensor (read from the
        # device, a wait for it, only where no one has yet).
        packed.append((sequence_major.values(), sequence_major.offsets(), sequence_major._get_max_seqlen()))
    if attn_mask is not None:
        raise ValueError("flashattn_ext: nested tensors take no attn_mask (as in SDPA)")
    (q, offsets_q, longest_q), (k, offsets_k, longest_k), (v, offsets_v, _) = packed
    if offsets_v is not offsets_k and not torch.equal(offsets_v, offsets_k):
        raise ValueError("flashattn_ext: with nested tensors, key and value must have the same sequence lengths")
    if not enable_gqa and q.shape[1] != k.shape[1]:
        raise RuntimeError(
            f"flashattn_ext: query has {q.shape[1]} heads but key has {k.shape[1]}; pass enable_gqa=True for GQA"
        )

    out = varlen_attention(q, k, v, offsets_q, offsets_k, longest_q, longest_k, dropout_p=dropout_p,
                           is_causal=is_causal, scale=scale)
    return torch.nested.nested_tensor_from_jagged(out, offsets_q, max_seqlen=longest_q).transpose(1, 2)
