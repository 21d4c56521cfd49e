"""Shared helpers: devices, a float64 reference written out naively, and error measures."""
import math

import pytest
import torch
from torch.nn.attention.bias import CausalBias

CUDA_REASON = "needs a CUDA GPU"
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_REASON)]),
]


def device_dtype_params(dtypes):
    """pytest params (device, dtype) for each device of DEVICES and each of dtypes[device], with the
    device's marks, ids like "cpu-float32"."""
    params = []
    for device in DEVICES:
        (name,), marks = (device.values, device.marks) if hasattr(device, "values") else ((device,), ())
        for dtype in dtypes[name]:
            params.append(pytest.param(name, dtype, marks=marks, id=f"{name}-{str(dtype).split('.')[-1]}"))
    return params


def cuda_test(fn):
    """Marks a GPU-only test: the cuda marker, and a skip with a reason where there is no GPU."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_REASON)(fn))


# Our error may exceed twice torch SDPA's own by this much: about one unit in the
# last place of each dtype, relative to the tensor's scale.
ERROR_FLOOR = {torch.float32: 2e-7, torch.float16: 5e-4, torch.bfloat16: 4e-3}


def naive_attention(q, k, v, is_causal=False, causal_lower_right=False, scale=None, enable_gqa=False, window=None,
                    softcap=None, attn_mask=None, alibi_slopes=None):
    """softmax(Q K^T * scale) V with the whole score matrix in memory, in the inputs' dtype.

    window=(left, right) (None: open side) hides keys outside [i + d - left, i + d + right], d the
    causal diagonal's offset; softcap=c replaces the scaled scores s by c * tanh(s / c); alibi_slopes
    ((Hq,) or (B, Hq)) then subtracts slope * |i + d - j|; attn_mask (bool or float) applies after
    them. Returns (out, lse). Rows that see no key give out = 0 and lse = -inf."""
    if enable_gqa:
        group = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    scores = (q @ k.transpose(-2, -1)) * scale
    len_q, len_k = q.shape[-2], k.shape[-2]
    offset = len_k - len_q if causal_lower_right else 0
    rows = torch.arange(len_q, device=q.device)[:, None]
    cols = torch.arange(len_k, device=q.device)[None, :]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(scores.dtype)[..., None, None]  # (float32 slopes keep the inputs' dtype)
        scores = scores - slopes * (rows + offset - cols).abs().to(scores.dtype)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool else scores + attn_mask
    left, right = window if window is not None else (None, None)
    if is_causal:
        right = 0
    if right is not None:
        scores = scores.masked_fill(cols > rows + offset + right, -math.inf)
    if left is not None:
        scores = scores.masked_fill(cols < rows + offset - left, -math.inf)
    # The row max is subtracted for range only; rows of -inf keep a max of 0 so
    # that neither the values nor the gradients become NaN.
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = row_max.masked_fill(torch.isinf(row_max), 0.0)
    weights = torch.exp(scores - row_max)
    row_sum = weights.sum(dim=-1, keepdim=True)
    probs = weights / torch.where(row_sum > 0, row_sum, torch.ones_like(row_sum))
    lse = (row_max + torch.log(row_sum)).squeeze(-1)
    return probs @ v, lse


def relative_error(actual, expected, zero_scale=None):
    """Largest absolute error, relative to the largest magnitude of the expected tensor.

    An expected tensor that is exactly 0 (dq and dk when every row sees a single key, so the
    softmax is constant) is measured against zero_scale instead, typically the largest magnitude
    among the problem's reference results: relative to 0, any rounding would be infinite."""
    actual, expected = actual.double(), expected.double()
    if expected.numel() == 0:
        return 0.0
    error = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    if scale == 0 and zero_scale is not None:
        scale = zero_scale
    return error / max(scale, 1e-30)


# The CUDA caching allocator serves requests up to 1 MiB from a pool of 2 MiB segments of its own.
SMALL_POOL_REQUEST = 1 << 20


def poison_cuda_allocator(nbytes, device="cuda"):
    """Fills about nbytes of the CUDA caching allocator's free memory with NaN.

    Outputs and workspaces are carved from that free memory, so an element that a kernel forgets
    to write reads as NaN instead of a stale value that may happen to look right. Cached blocks
    are released first so that the poisoned ones are what the next allocations reuse; the two
    1 MiB blocks fill one segment of the pool that serves small requests such as lse."""
    torch.cuda.empty_cache()
    blocks = [
        torch.empty(size // 4, dtype=torch.float32, device=device)
        for size in (nbytes, SMALL_POOL_REQUEST, SMALL_POOL_REQUEST)
    ]
    for block in blocks:
        block.fill_(math.nan)


def random_qkv(shape_q, shape_k, shape_v, dtype, device, seed=0):
    """Random inputs (never zeros) on the device, created in float64 and rounded to dtype."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype).requires_grad_()
        for shape in (shape_q, shape_k, shape_v)
    )


def seq_major_qkv(batch, length, heads, head_dim, device, seed):
    """Random float64 q, k, v stored as (B, N, H, D) and seen as (B, H, N, D) views, as
    models produce them; leaves that require grad."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(batch, length, heads, head_dim, generator=gen, dtype=torch.float64)
        .to(device)
        .transpose(1, 2)
        .requires_grad_()
        for _ in range(3)
    )


@pytest.fixture(params=[8, 16], ids=["8bit", "16bit"])
def dropout_bits(request):
    """Runs a test with dropout's random numbers of 8 and of 16 bits, then restores the setting
    (a fixture: import it into the test module)."""
    import flashattn_ext

    before = flashattn_ext.get_dropout_bits()
    flashattn_ext.set_dropout_bits(request.param)
    yield request.param
    flashattn_ext.set_dropout_bits(before)


def draw_rng_state(device, dropout_p):
    """The rng_state that a flashattn_ext call with dropout_p draws from the generator's current state."""
    x = torch.zeros(1, 1, 1, 8, device=device)
    return torch.ops.flashattn_ext.attention_forward(x, x, x, None, dropout_p, False, False, 1.0)[2]


def math_with_dropout_mask(q, k, v, keep, dropout_p, attn_mask=None, **kwargs):
    """torch's math SDPA dropping exactly where keep is False (its hook for testing fused kernels).
    Unlike F.scaled_dot_product_attention, it adds a bool attn_mask as 0/1, so the mask goes in as
    -inf/0 scores instead; a CausalBias is materialized."""
    if isinstance(attn_mask, CausalBias):
        attn_mask = attn_mask._materialize(q.device)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill(~attn_mask, -math.inf)
    return torch.ops.aten._scaled_dot_product_attention_math(
        q, k, v, attn_mask, dropout_p, dropout_mask=keep, **kwargs
    )[0]
