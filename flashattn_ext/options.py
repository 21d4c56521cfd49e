"""The options beyond SDPA's (window, softcap, ALiBi slopes) and SDPA's defaults, checked and put in the
form the ops take: shared by attention_with_lse, varlen_attention and decode_attention."""
import math
from typing import Optional, Tuple

import torch
from torch import Tensor


def window_bounds(window) -> Tuple[int, int]:
    """window=(left, right) as the ops take it: -1 for an open side (also for a bound past int64's range,
    which hides no key; the ops open any bound of len_q + len_k or more)."""
    if window is None:
        return -1, -1
    if not (isinstance(window, (tuple, list)) and len(window) == 2):
        raise ValueError(f"flashattn_ext: window must be a pair (left, right), got {window!r}")
    bounds = []
    for side, bound in zip(("left", "right"), window):
        if bound is None:
            bounds.append(-1)
        elif isinstance(bound, int) and not isinstance(bound, bool) and bound >= 0:
            bounds.append(bound if bound < 2**63 else -1)
        else:
            raise ValueError(f"flashattn_ext: window's {side} bound must be an int >= 0 or None, got {bound!r}")
    return bounds[0], bounds[1]


def softcap_value(softcap: Optional[float]) -> float:
    """softcap as the ops take it: 0.0 for none."""
    if softcap is None:
        return 0.0
    if not (isinstance(softcap, (int, float)) and not isinstance(softcap, bool) and math.isfinite(softcap)
            and softcap > 0):
        raise ValueError(f"flashattn_ext: softcap must be a finite number > 0 (or None), got {softcap!r}")
    return float(softcap)


def per_head_slopes(alibi_slopes: Optional[Tensor], batch: Tuple[int, ...], heads_q: int) -> Optional[Tensor]:
    """alibi_slopes, (Hq,) or (*batch, Hq), as the ops take it: (prod(batch), Hq), a view where
    the layout allows (the ops check dtype and device)."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, Tensor):
        raise TypeError(
            f"flashattn_ext: alibi_slopes must be a torch.Tensor or None, got {type(alibi_slopes).__name__}"
        )
    if tuple(alibi_slopes.shape) not in ((heads_q,), (*batch, heads_q)):
        raise RuntimeError(
            f"flashattn_ext: alibi_slopes must have shape ({heads_q},) or {(*batch, heads_q)} (one slope a query "
            f"head, or one a batch element and query head), got {tuple(alibi_slopes.shape)}"
        )
    return alibi_slopes.expand(*batch, heads_q).reshape(math.prod(batch), heads_q)


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The log-sum-exp's dtype for inputs of dtype (csrc/ops_checks.cpp's lse_dtype): float64 for float64, else
    float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def default_scale(head_dim: int) -> float:
    """SDPA's default scale, 1 / sqrt(head_dim) (inf for head dim 0)."""
    return 1.0 / math.sqrt(head_dim) if head_dim > 0 else math.inf
