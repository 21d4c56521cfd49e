"""FP8 attention: torch.nn.attention.experimental._scaled_dot_product_attention_quantized's signature and
semantics (float8_e4m3fn query, key and value, descales a (sequence, key/value head), bfloat16 out), and a
trainable form of it: 16-bit (or float32) query, key and value, quantized inside.

On an H100 / H200 at head dim 128 with descales a (sequence, key/value head), the Hopper forward takes
the e4m3 operands itself (P rounded to e4m3 too); every other call runs attention_forward on the tensors
dequantized (float32 on the CPU, bfloat16 on CUDA): right, and no faster than bfloat16 attention. The
backward (attention_backward_fp8) runs the 16-bit backward on the dequantized tensors on every device for now.
quantize_fp8 makes the inputs (per head or per block of rows), and hadamard_rotation the random rotation of
queries and keys that FA3 pairs with block quantization (benchmarks/fp8_accuracy.py measures both against
float64; benchmarks/fp8_training.py trains a small model with each attention).
"""
import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from .options import default_scale, window_bounds

E4M3_MAX = 448.0
# Rows a block descale covers (csrc/ops_fp8.cpp's kFp8BlockRows).
BLOCK_ROWS = 128


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
    """query (N, Hq, L, E), key (N, H, S, E), value (N, H, S, Ev) -> (N, Hq, L, Ev), in either of two forms.

    - float8_e4m3fn, with the descales (forward only, as torch's): each descale, float32 (None: 1), multiplies
      its tensor's values: (N, H), one a (sequence, key/value head), the query's heads by their key/value
      head's (torch's PER_HEAD descaling), or (N, H, ceil(rows / BLOCK_ROWS)), one a block of BLOCK_ROWS rows
      of those (quantize_fp8 makes either). Out in bfloat16.
    - bfloat16, float16 or float32, no descales: each tensor quantized here per (sequence, key/value head)
      (quantize_fp8), out in the inputs' dtype, and differentiable: the gradients are those of attention over
      the dequantized tensors, passed straight through the quantization (as Transformer Engine's FP8
      attention), computed from this forward's out and log-sum-exp (the op attention_forward_quantized).

    is_causal aligns the mask top-left, as SDPA does; window (left, right) as attention_with_lse's.
    """
    left, right = window_bounds(window)
    scale = default_scale(query.size(-1)) if scale is None else scale
    fp8 = [t.dtype == torch.float8_e4m3fn for t in (query, key, value)]
    if all(fp8):
        out, _ = torch.ops.flashattn_ext.attention_forward_fp8(query, key, value, q_descale, k_descale, v_descale,
                                                               is_causal, False, scale, left, right)
        return out
    if any(fp8) or len({query.dtype, key.dtype, value.dtype}) != 1 or not query.dtype.is_floating_point:
        raise TypeError("flashattn_ext: scaled_dot_product_attention_fp8 takes query, key and value all in "
                        "float8_e4m3fn, or all in one of bfloat16, float16 and float32; got "
                        f"{query.dtype}, {key.dtype} and {value.dtype}")
    if any(d is not None for d in (q_descale, k_descale, v_descale)):
        raise ValueError("flashattn_ext: scaled_dot_product_attention_fp8 quantizes 16-bit inputs itself; "
                         "q_descale, k_descale and v_descale go with float8_e4m3fn inputs only")
    out, _ = torch.ops.flashattn_ext.attention_forward_quantized(query, key, value, is_causal, False, scale, left,
                                                                 right)
    return out


def quantize_fp8(x: Tensor, heads_kv: Optional[int] = None, per_block: bool = False) -> Tuple[Tensor, Tensor]:
    """x (N, H, L, E) as scaled_dot_product_attention_fp8 takes it: (x / descale) in float8_e4m3fn, rounded
    to nearest and saturated, and its float32 descale, each the largest magnitude over 448 of what it
    covers: a (sequence, key/value head) ((N, heads_kv): the query's heads_kv groups of heads share one), or
    with per_block a block of BLOCK_ROWS rows of those ((N, heads_kv, ceil(L / BLOCK_ROWS)): FA3's block
    quantization, which keeps one outlier from coarsening a whole head). heads_kv defaults to H. On CUDA a
    16-bit x with one descale a (sequence, key/value head) takes a kernel (csrc/cuda/fp8_convert.cu: x read
    twice, written once), the same bits as the ATen path that takes every other call.
    """
    if heads_kv is None:
        heads_kv = x.size(1) if x.dim() == 4 else 0  # (the op names a tensor of another rank)
    return torch.ops.flashattn_ext.quantize_fp8(x, heads_kv, per_block)


def hadamard_rotation(dim: int, generator: Optional[torch.Generator] = None,
                      device: Optional[torch.device] = None) -> Tensor:
    """A random orthogonal (dim, dim) float32 matrix R, dim a power of two: the normalized Walsh-Hadamard
    matrix times random signs (FA3's incoherent processing). Rotating the queries and the keys alike,
    (q @ R) (k @ R)^T = q k^T, and each rotated row mixes all of a row's values, so one outlier no longer
    sets a row's (or a block's) FP8 scale alone.
    """
    if dim <= 0 or dim & (dim - 1):
        raise ValueError(f"flashattn_ext: hadamard_rotation takes a power-of-two dim, got {dim}")
    matrix = torch.ones(1, 1)
    while matrix.shape[0] < dim:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    signs = torch.randint(0, 2, (dim,), generator=generator).float() * 2 - 1
    return (signs[:, None] * matrix / math.sqrt(dim)).to(device)
