"""FP8 attention: torch.nn.attention.experimental._scaled_dot_product_attention_quantized's signature and
semantics (float8_e4m3fn query, key and value, descales a (sequence, key/value head), bfloat16 out).

Until the Hopper kernels take e4m3 operands, the op runs attention_forward on the tensors dequantized
(float32 on the CPU, bfloat16 on CUDA): right, and no faster than bfloat16 attention. Forward only, as
torch's.
"""
from typing import Optional

import torch
from torch import Tensor

from .options import default_scale, window_bounds


def scaled_dot_product_attention_fp8(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    is_causal: bool = False,
    scale: Optional[float] = None,
    q_descale: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
    window: Optional[tuple] = None,
) -> Tensor:
    """query (N, Hq, L, E), key (N, H, S, E), value (N, H, S, Ev), all torch.float8_e4m3fn -> (N, Hq, L, Ev)
    bfloat16. Each descale (N, H), float32 (None: 1), multiplies its tensor's values of each (sequence,
    key/value head), the query's heads by their key/value head's (torch's PER_HEAD descaling). is_causal
    aligns the mask top-left, as SDPA does; window (left, right) as attention_with_lse's.
    """
    left, right = window_bounds(window)
    out, _ = torch.ops.flashattn_ext.attention_forward_fp8(
        query, key, value, q_descale, k_descale, v_descale, is_causal, False,
        default_scale(query.size(-1)) if scale is None else scale, left, right)
    return out
