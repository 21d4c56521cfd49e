"""flashattn_ext as an attention backend of Hugging Face transformers (an optional dependency).

>>> import flashattn_ext
>>> flashattn_ext.register_with_transformers()
>>> model = AutoModelForCausalLM.from_config(config, attn_implementation="fa_ext")

The name has no "flash" in it: transformers takes any attn_implementation containing "flash" for a
flash-attn kernel of its own and tries to import one by that name (transformers 5).

The backend takes the calls that transformers' "sdpa" backend takes, with the same masks (padding,
causal and sliding-window masks reach it as the boolean masks transformers builds for SDPA, or as
is_causal when none is needed; a sliding window as the kernels' window, not a mask, where the
queries are the keys), and runs them through flashattn_ext.attention_with_lse: GQA
without repeating the key/value heads, dropout, an explicit scale, and logit softcapping (Gemma 2),
which SDPA lacks, and attention sinks (gpt-oss's `s_aux`). T5's position bias raises
NotImplementedError.

A padded batch whose queries are its keys (an encoder's bidirectional mask, or a decoder's causal one
in training or in a prefill with no cache before it) gets a mask that hides the padding tokens' query
rows as well as their keys: the kernels then skip every tile of padding, as an unpadded (varlen) call
would, and the padding tokens' outputs are 0 (as with transformers' flash-attention unpadding; SDPA's
are arbitrary there, and nothing real attends to them). The real tokens' outputs are unchanged.
"""
import inspect
from typing import Optional, Tuple

import torch

from .attention import attention_with_lse

NAME = "fa_ext"


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs,
) -> Tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (B, Hq, L, E), key and value (B, Hkv, S, E);
    returns the output as (B, L, Hq, Ev) and no attention weights."""
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError(
            "flashattn_ext: the transformers backend does not support `position_bias` yet; "
            'use attn_implementation="eager" for this model'
        )
    # As transformers' sdpa backend: causal through the flag only when no mask is given and more
    # than one query token is new (a single new token sees the whole cache).
    q_length, kv_length = query.shape[2], key.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = q_length > 1 and attention_mask is None and is_causal
    if is_causal and kv_length > q_length:
        # Prefill into an empty static cache: the keys past the new tokens are unused slots
        # (is_causal aligns the diagonal top-left, as SDPA does).
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    # A sliding-window layer whose mask the mask builder left to the kernels (no mask, or a key mask
    # (B, 1, 1, S) for several queries, which sdpa_mask never builds): key j visible to query i where
    # i - sliding_window < j <= i. (Without a mask, sdpa_mask also gives none where the window spans
    # every key: the window then hides nothing.)
    sliding_window = kwargs.get("sliding_window")
    key_mask = attention_mask is not None and attention_mask.shape[-2] == 1
    window = (int(sliding_window) - 1, 0) if sliding_window and q_length > 1 and (is_causal or key_mask) else None
    out, _ = attention_with_lse(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        is_causal=is_causal,
        scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],
        window=window,
        softcap=kwargs.get("softcap"),
        sinks=kwargs.get("s_aux"),
    )
    return out.transpose(1, 2).contiguous(), None


def register_with_transformers(name: str = NAME) -> str:
    """Registers flashattn_ext with transformers' AttentionInterface (and the SDPA-style mask builder
    with its AttentionMaskInterface) under `name`, so that attn_implementation=name selects it.
    Returns the name. Raises ImportError if transformers is not installed."""
    if "flash" in name:
        raise ValueError(
            f"flashattn_ext: cannot register as {name!r}: transformers takes any attn_implementation "
            "containing 'flash' for one of its flash-attn kernels; choose a name without it"
        )
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as error:
        raise ImportError(
            "flashattn_ext: register_with_transformers needs transformers with AttentionInterface and "
            "AttentionMaskInterface (pip install transformers)"
        ) from error
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, _masks_for_the_kernels(sdpa_mask))
    return name


def _masks_for_the_kernels(sdpa_mask):
    """transformers' sdpa_mask for the calls whose queries are their keys (no cache before them, no
    offsets), with two changes:
    - a bidirectional or causal mask (its own mask functions, nothing composed with them) of a padded
      batch hides the padding tokens' query rows too;
    - a sliding-window causal mask leaves the window to the kernels (attention_forward passes it as
      `window`): none with no padding, else the padding as a key mask (B, 1, 1, S), a view of it,
      at head dims up to 128 (outside torch.compile).
    Every other call gets sdpa_mask's own mask."""
    from transformers.masking_utils import and_masks, bidirectional_mask_function, causal_mask_function

    signature = inspect.signature(sdpa_mask)

    def build(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        given = call.arguments
        padding = given.get("attention_mask")
        # (q_length in transformers 5.2x; cache_position, the queries' positions, before.)
        positions = given.get("cache_position")
        q_length = given.get("q_length", positions.shape[0] if positions is not None else None)
        same_tokens = q_length == given.get("kv_length") and not given.get("q_offset") and not given.get("kv_offset")
        padded = isinstance(padding, torch.Tensor) and padding.dim() == 2 and padding.shape[1] == q_length
        mask_function = given.get("mask_function")
        # (Not under torch.compile, which cannot trace the closures it reads: the mask then has the window.)
        window = None
        if same_tokens and not torch.compiler.is_compiling():
            window = _sliding_window_of(mask_function, causal_mask_function)
        if window is not None and window == given.get("local_size"):
            if padding is None:
                return None
            config = given.get("config", given.get("kwargs", {}).get("config"))  # (sdpa_mask takes it in **kwargs)
            if padded and _head_dim(config) <= _MASKED_WINDOW_HEAD_DIMS:
                return padding.bool()[:, None, None, :]
        if same_tokens and padded and mask_function in (bidirectional_mask_function, causal_mask_function):
            given["mask_function"] = and_masks(mask_function, _query_padding_function(padding))
        return sdpa_mask(*call.args, **call.kwargs)

    return build


# Head dims up to which the Hopper kernels take a mask with a window; above, a mask runs the sm80
# kernels, which have no window (cuda/route.h): the window then stays in the mask.
_MASKED_WINDOW_HEAD_DIMS = 128


def _head_dim(config) -> float:
    """The attention head dim of a transformers config (inf where it cannot tell)."""
    if config is None:
        return float("inf")
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None and getattr(config, "num_attention_heads", None):
        head_dim = config.hidden_size // config.num_attention_heads
    return head_dim or float("inf")


def _sliding_window_of(mask_function, causal_mask_function) -> Optional[int]:
    """W where mask_function is transformers' sliding_window_causal_mask_function(W), that is
    and_masks(sliding_window_overlay(W), causal_mask_function) (key j visible to query i where
    i - W < j <= i), else None. Read from the functions' closures, and the overlay probed on
    integers: a transformers whose functions differ gets None, and so sdpa_mask's own mask."""

    def closure_of(fn):
        cells = getattr(fn, "__closure__", None) or ()
        return dict(zip(getattr(getattr(fn, "__code__", None), "co_freevars", ()), (c.cell_contents for c in cells)))

    if getattr(mask_function, "__qualname__", "") != "and_masks.<locals>.and_mask":
        return None
    parts = closure_of(mask_function).get("mask_functions")
    if not (isinstance(parts, tuple) and len(parts) == 2 and parts[1] is causal_mask_function):
        return None
    overlay = parts[0]
    if getattr(overlay, "__qualname__", "") != "sliding_window_overlay.<locals>.inner_mask":
        return None
    window = closure_of(overlay).get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        return None
    sees = [bool(overlay(0, 0, 2 * window, key)) for key in (window, window + 1, 2 * window)]
    return window if sees == [False, True, True] else None


def _query_padding_function(padding: torch.Tensor):
    def query_is_real(batch_idx, head_idx, q_idx, kv_idx):
        return padding[batch_idx, q_idx].bool()

    return query_is_real
