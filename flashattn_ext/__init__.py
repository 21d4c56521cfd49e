"""FlashAttention as a PyTorch extension: a drop-in torch.nn.functional.scaled_dot_product_attention.

>>> import flashattn_ext
>>> out = flashattn_ext.scaled_dot_product_attention(q, k, v, is_causal=True)
"""
import torch  # noqa: F401  (loads libc10 and libtorch, which _C links against)

from . import _C  # noqa: F401  (loads the library, which registers torch.ops.flashattn_ext)
from . import _fake  # noqa: F401  (shape-only kernels for torch.compile and opcheck)
from . import distributed  # noqa: F401  (context parallelism: flashattn_ext.distributed)
from .attention import attention_with_lse, get_dropout_bits, kernel_route, set_dropout_bits
from .decode import decode_attention
from .fp8 import scaled_dot_product_attention_fp8
from .sdpa import scaled_dot_product_attention
from .torch_flash import register_with_torch
from .transformers_backend import register_with_transformers
from .varlen import varlen_attention

register_with_torch()  # the name only: torch.nn.attention.activate_flash_attention_impl("flashattn_ext") activates it

__all__ = ["scaled_dot_product_attention", "attention_with_lse", "varlen_attention", "decode_attention",
           "scaled_dot_product_attention_fp8", "register_with_transformers", "register_with_torch",
           "set_dropout_bits", "get_dropout_bits", "kernel_route"]
__version__ = "0.1.0"
