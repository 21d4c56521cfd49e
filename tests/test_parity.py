"""Parity with torch.nn.functional.scaled_dot_product_attention over its whole signature.

A seeded sweep draws one call per case: dtype, any number of leading batch dims, GQA, E != Ev,
is_causal or an attn_mask (bool, float, a float mask that requires grad, or torch's CausalBias
objects) in any shape that broadcasts, an explicit scale (negative and zero included), dropout,
and inputs laid out as (N, ..., L, H, E) memory seen through transposed views. Values and every
gradient (q, k, v, and a float mask's) are compared with SDPA's math backend in float64 on the
same rounded inputs: within twice torch SDPA's own error in the same dtype, plus a floor. With
dropout, the math backend is given the mask our call used (its dropout_mask testing hook), in
float64 and, for the error budget, in the inputs' dtype.

``pytest tests/test_parity.py -k cpu-seed7`` reruns one case; failures print the case.
"""
import math
import random
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention import bias as sdpa_bias

import flashattn_ext
from helpers import ERROR_FLOOR, draw_rng_state, math_with_dropout_mask, on_paths_each, relative_error

SEEDS_BY_PATH = {"cpu": range(40), "cuda": range(40)}  # one case a seed
MASK_KINDS = ("none", "is_causal", "bool", "float", "float_grad", "causal_upper_left", "causal_lower_right")


@dataclass(frozen=True)
class Call:
    dtype: torch.dtype
    leading: Tuple[int, ...]  # batch dims before the heads
    heads_kv: int
    group: int  # query heads per key/value head; > 1 means enable_gqa
    len_q: int
    len_k: int
    head_dim: int
    head_dim_v: int
    mask: str  # one of MASK_KINDS
    mask_shape: Optional[Tuple[int, ...]]  # of a tensor mask: broadcasts to (*leading, heads_q, len_q, len_k)
    scale: Optional[float]
    seq_major: bool  # q, k, v are (..., L, H, E) memory seen as (..., H, L, E)
    dropout_p: float


def draw_call(seed):
    rng = random.Random(seed)
    leading = tuple(rng.randint(1, 3) for _ in range(rng.choice((0, 1, 1, 2))))
    heads_kv, group = rng.randint(1, 3), rng.choice((1, 1, 2, 3))
    len_q, len_k = rng.randint(1, 70), rng.randint(1, 70)
    mask = rng.choice(MASK_KINDS)
    full_shape = (*leading, heads_kv * group, len_q, len_k)
    mask_shape = None
    if mask in ("bool", "float", "float_grad"):
        # Each dim of the full shape kept or broadcast (1), and leading dims dropped at random.
        kept = tuple(n if rng.random() < 0.5 else 1 for n in full_shape[:-2]) + full_shape[-2:]
        mask_shape = kept[rng.randint(0, len(kept) - 2) :]
    return Call(
        dtype=rng.choice((torch.float64, torch.float32, torch.float16, torch.bfloat16)),
        leading=leading,
        heads_kv=heads_kv,
        group=group,
        len_q=len_q,
        len_k=len_k,
        head_dim=rng.choice((8, 16, 24, 64, rng.randint(1, 80))),
        head_dim_v=rng.choice((None, rng.randint(1, 80))),
        mask=mask,
        mask_shape=mask_shape,
        scale=rng.choice((None, None, rng.uniform(-1.0, 2.0), 0.0)),
        seq_major=rng.random() < 0.5,
        dropout_p=rng.choice((0.0, 0.0, 0.0, round(rng.uniform(0.05, 0.7), 3))),
    )


def make_inputs(call, device, seed):
    """Leaves q, k, v (and a float mask that requires grad), the attn_mask argument, and grad_out."""
    gen = torch.Generator().manual_seed(seed)
    head_dim_v = call.head_dim if call.head_dim_v is None else call.head_dim_v

    def randn(heads, length, dim):
        shape = (*call.leading, length, heads, dim) if call.seq_major else (*call.leading, heads, length, dim)
        t = torch.randn(shape, generator=gen, dtype=torch.float64).to(device=device, dtype=call.dtype)
        return (t.transpose(-3, -2) if call.seq_major else t).requires_grad_()

    heads_q = call.heads_kv * call.group
    q = randn(heads_q, call.len_q, call.head_dim)
    k = randn(call.heads_kv, call.len_k, call.head_dim)
    v = randn(call.heads_kv, call.len_k, head_dim_v)
    if call.mask in ("bool", "float", "float_grad"):
        if call.mask == "bool":
            mask = torch.rand(call.mask_shape, generator=gen) > 0.3
            mask[..., 0] = True  # every row sees a key: rows that see none are tested elsewhere
        else:
            mask = torch.randn(call.mask_shape, generator=gen, dtype=torch.float64).to(call.dtype)
        mask = mask.to(device).requires_grad_(call.mask == "float_grad")
    elif call.mask == "causal_upper_left":
        mask = sdpa_bias.causal_upper_left(call.len_q, call.len_k)
    elif call.mask == "causal_lower_right":
        mask = sdpa_bias.causal_lower_right(call.len_q, call.len_k)
    else:
        mask = None
    grad_out = torch.randn((*call.leading, heads_q, call.len_q, head_dim_v), generator=gen, dtype=torch.float64)
    return q, k, v, mask, grad_out.to(device=device, dtype=call.dtype)


def sees_no_key(call):
    """Whether some query row sees no key (SDPA's math backend gives NaN there; ours gives 0)."""
    if call.mask in ("is_causal", "causal_upper_left"):
        return False  # row 0 always sees key 0
    return call.mask == "causal_lower_right" and call.len_q > call.len_k


def is_tensor_mask_or_input(t):
    """A plain tensor: not None, and not a CausalBias (a torch.Tensor subclass that holds no values)."""
    return isinstance(t, torch.Tensor) and not isinstance(t, sdpa_bias.CausalBias)


def run(fn, call, q, k, v, mask, grad_out):
    """(out, dq, dk, dv[, dmask]) of fn called as SDPA, on fresh leaves of the given tensors."""
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in (q, k, v)]
    as_leaf = is_tensor_mask_or_input(mask) and mask.requires_grad
    mask_arg = mask.detach().clone().requires_grad_() if as_leaf else mask
    out = fn(
        *leaves,
        attn_mask=None if call.mask == "is_causal" else mask_arg,
        dropout_p=call.dropout_p,
        is_causal=call.mask == "is_causal",
        scale=call.scale,
        enable_gqa=call.group > 1,
    )
    wrt = leaves + ([mask_arg] if as_leaf else [])
    return (out.detach(), *torch.autograd.grad(out, wrt, grad_out))


def sdpa_math(*args, **kwargs):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(*args, **kwargs)


def sdpa_math_with_dropout_mask(keep):
    """SDPA's math backend, called as SDPA, dropping exactly where keep is False."""

    def attention(q, k, v, attn_mask=None, dropout_p=0.0, **kwargs):
        return math_with_dropout_mask(q, k, v, keep, dropout_p, attn_mask, **kwargs)

    return attention


def dropout_mask_of_call(call, device, seed):
    """The keep mask of the flashattn_ext call made right after torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    rng_state = draw_rng_state(device, call.dropout_p)
    heads_q, batch = call.heads_kv * call.group, math.prod(call.leading)
    keep = torch.ops.flashattn_ext.dropout_mask(
        rng_state, call.dropout_p, batch, heads_q, call.len_q, call.len_k, 0, call.len_q
    )
    return keep.reshape(*call.leading, heads_q, call.len_q, call.len_k)


@on_paths_each("seed", SEEDS_BY_PATH, ids=lambda seed: f"seed{seed}")
def test_parity_with_sdpa(path, seed):
    device = path.device
    call, redraw = draw_call(seed), seed
    while sees_no_key(call):  # draw again until every query row sees a key
        redraw += 10_000
        call = draw_call(redraw)
    q, k, v, mask, grad_out = make_inputs(call, device, seed)
    context = f"case {call} on {device}"

    def upcast(t):
        if not is_tensor_mask_or_input(t) or t.dtype == torch.bool:
            return t
        return t.detach().double().requires_grad_(t.requires_grad)

    torch.manual_seed(seed)
    got = run(flashattn_ext.scaled_dot_product_attention, call, q, k, v, mask, grad_out)
    if call.dropout_p > 0:
        reference = sdpa_math_with_dropout_mask(dropout_mask_of_call(call, device, seed))
        want = run(reference, call, *(upcast(t) for t in (q, k, v, mask, grad_out)))
        baseline = run(reference, call, q, k, v, mask, grad_out)
    else:
        want = run(sdpa_math, call, *(upcast(t) for t in (q, k, v, mask, grad_out)))
        # The error budget: torch SDPA's own error in the same dtype, from the backend it picks (on
        # CUDA its fused kernels return NaN for a scale <= 0: then from the math backend).
        baseline = run(F.scaled_dot_product_attention, call, q, k, v, mask, grad_out)
        if not all(torch.isfinite(b).all() for b in baseline):
            baseline = run(sdpa_math, call, q, k, v, mask, grad_out)
    names = ("out", "dq", "dk", "dv", "dmask")
    problem_scale = max(w.abs().max().item() for w in want)
    floor = 1e-12 if call.dtype == torch.float64 else ERROR_FLOOR[call.dtype]
    for name, g, b, w in zip(names, got, baseline, want):
        assert g.shape == w.shape and g.dtype == call.dtype, f"{name}: {g.shape} {g.dtype}; {context}"
        assert torch.isfinite(g).all(), f"{name} is not finite; {context}"
        ours_error = relative_error(g, w, zero_scale=problem_scale)
        sdpa_error = relative_error(b, w, zero_scale=problem_scale)
        assert ours_error <= 2 * sdpa_error + floor, (
            f"{name}: error {ours_error:.3g} vs torch SDPA's {sdpa_error:.3g}; {context}"
        )
    assert math.isfinite(problem_scale), context
