"""Shared helpers: kernel paths, a float64 reference written out naively, error measures,
and the inputs, masks and profiler look-ups that the tests of several features share."""
import contextlib
import math
import socket

import pytest
import torch
from torch.nn.attention.bias import CausalBias
from torch.profiler import ProfilerActivity, profile

CUDA_REASON = "needs a CUDA GPU"


def cuda_test(fn):
    """Marks a GPU-only test: the cuda marker, and a skip with a reason where there is no GPU."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_REASON)(fn))


def is_hopper():
    """Whether the GPU is an sm_90 one (H100 / H200), where the Hopper kernels are the default."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


HOPPER_REASON = "needs a Hopper GPU"

# The kernel paths a test can name (the `path` fixture of conftest.py sets each up), after the family
# that flashattn_ext.kernel_route names for the calls the path takes:
#   cpu:   the CPU kernels (FLASHATTN_EXT_KERNELS as the environment leaves it: .ci/run's second
#          run, with =aten, sends these tests through the ATen fallback);
#   cuda:  the GPU's default kernels (sm90 on an H100 / H200, sm80 elsewhere), the environment as
#          it is;
#   sm80:  the mma.sync kernels, forced with FLASHATTN_EXT_KERNELS=sm80;
#   sm90:  the Hopper kernels: skipped but on an sm_90 GPU, FLASHATTN_EXT_KERNELS unset (their
#          default there); also marked sm90, so that `pytest -m sm90` runs the Hopper kernels' own tests;
#   deterministic: the GPU's kernels under torch.use_deterministic_algorithms (which the test
#          turns on around the calls it means).
_ON_CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_REASON)]
PATH_MARKS = {
    "cpu": [],
    "cuda": _ON_CUDA,
    "sm80": _ON_CUDA,
    "sm90": _ON_CUDA + [pytest.mark.sm90, pytest.mark.skipif(torch.cuda.is_available() and not is_hopper(),
                                                               reason=HOPPER_REASON)],
    "deterministic": _ON_CUDA,
}


@contextlib.contextmanager
def deterministic_algorithms(on=True):
    """torch.use_deterministic_algorithms(on) within the block, the setting before it restored after."""
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


def on_paths(*names):
    """Parametrizes a test over the kernel paths named (see PATH_MARKS), each with its marks, through
    the `path` fixture (conftest.py): the test takes a `path` argument, whose .name and .device say
    which path it runs."""
    return pytest.mark.parametrize("path", [pytest.param(n, marks=PATH_MARKS[n], id=n) for n in names],
                                   indirect=True)


def on_paths_each(argname, values_by_path, ids=str):
    """Like on_paths, for a test that takes its own values of argname on each path (say the dtypes
    each path's kernels take): parametrizes (path, argname) over the pairs, ids like "cpu-float32"."""
    params = [pytest.param(name, value, marks=PATH_MARKS[name], id=f"{name}-{ids(value)}")
              for name, values in values_by_path.items() for value in values]
    return pytest.mark.parametrize(("path", argname), params, indirect=["path"])


def dtype_name(dtype):
    """float32 for torch.float32: a short test id."""
    return str(dtype).removeprefix("torch.")


def kernel_names(fn):
    """The names of the CUDA kernels fn launches. fn runs once before it is profiled: in a fresh
    process the first profiled call could miss its kernels (seen with the first windowed call)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [event.name for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA]


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


# NaN poison laid into the CUDA allocator's free memory before each call under test (the Hopper tests).
POISON_BYTES = 512 * 2**20


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


def make_inputs(shape, dtype, device, seed=0):
    """random_qkv for a (batch, heads_q, heads_kv, len_q, len_k, head_dim, head_dim_v) problem."""
    batch, heads_q, heads_kv, len_q, len_k, head_dim, head_dim_v = shape
    return random_qkv(
        (batch, heads_q, len_q, head_dim),
        (batch, heads_kv, len_k, head_dim),
        (batch, heads_kv, len_k, head_dim_v),
        dtype,
        device,
        seed,
    )


def random_grad_out(shape, device, seed=0):
    """A seeded random upstream gradient for the output of a make_inputs problem."""
    batch, heads_q, _, len_q, _, _, head_dim_v = shape
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads_q, len_q, head_dim_v, generator=gen, dtype=torch.float64).to(device)


def assert_within_twice_sdpa(got, baseline, want, dtype, names=("out", "dq", "dk", "dv")):
    """Each of got (ours: in dtype, finite) within twice baseline's error (torch SDPA's, in dtype) against want
    (float64), plus ERROR_FLOOR, errors measured against the problem's scale."""
    problem_scale = max(w.abs().max().item() for w in want)
    for name, g, b, w in zip(names, got, baseline, want):
        assert g.dtype == dtype and torch.isfinite(g).all(), name
        ours_error = relative_error(g, w, zero_scale=problem_scale)
        sdpa_error = relative_error(b, w, zero_scale=problem_scale)
        assert ours_error <= 2 * sdpa_error + ERROR_FLOOR[dtype], (
            f"{name}: error {ours_error:.3g} vs torch SDPA's {sdpa_error:.3g}"
        )


def forward_and_grads(fn, inputs, grad_out):
    """Runs fn on fresh leaf copies of inputs; returns (out, dq, dk, dv)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out.to(out.dtype))
    return (out.detach(), *(t.grad for t in leaves))


def random_inputs(shape, dtype, seq_major=False, seed=0):
    """q, k, v on the GPU for a (batch, heads_q, heads_kv, len_q, len_k, head_dim) problem (the
    Hopper tests'), optionally stored (B, N, H, D) and seen as (B, H, N, D)."""
    batch, heads_q, heads_kv, len_q, len_k, dim = shape
    gen = torch.Generator().manual_seed(seed)

    def draw(heads, length):
        if seq_major:  # (B, N, H, D) storage seen as (B, H, N, D)
            x = torch.randn(batch, length, heads, dim, generator=gen).transpose(1, 2)
        else:
            x = torch.randn(batch, heads, length, dim, generator=gen)
        return x.to("cuda", dtype)

    return draw(heads_q, len_q), draw(heads_kv, len_k), draw(heads_kv, len_k)


def expanded(fn):
    """fn with key/value heads repeated to the query's (torch's math SDPA with a CausalBias takes no GQA)."""
    def run(q, k, v, **kwargs):
        group = q.shape[1] // k.shape[1]
        return fn(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), **kwargs)
    return run


def random_attn_mask(case, shape, dtype, seed, empty_batch=True):
    """attn_mask of one kind (bool: True takes part; float: added), in the shape the case names:
    key padding (B, 1, 1, S), with (empty_batch) a batch that sees no key at all (its rows: out 0,
    lse -inf), or (L, S), (B, 1, L, S) and (B, H, L, S) masks that hide about a fifth of the pairs
    or add normal noise with some -inf."""
    batch, heads_q, _, len_q, len_k, _ = shape
    gen = torch.Generator().manual_seed(seed)
    if case.startswith("key_padding"):
        lengths = torch.randint(1, len_k + 1, (batch,), generator=gen)
        lengths[-1] = 0 if batch > 1 and empty_batch else lengths[-1]
        keep = (torch.arange(len_k)[None, :] < lengths[:, None])[:, None, None, :]
    else:
        sizes = {"2d": (len_q, len_k), "per_batch": (batch, 1, len_q, len_k), "per_head": (batch, heads_q, len_q, len_k)}
        keep = torch.rand(*sizes[case.split("_", 1)[1]], generator=gen) > 0.2
    if case.startswith("bool") or case == "key_padding_bool":
        return keep.cuda()
    bias = torch.zeros(keep.shape) if case.startswith("key_padding") else torch.randn(keep.shape, generator=gen)
    return bias.masked_fill(~keep, -float("inf")).to("cuda", dtype)


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


def small_config(family, sliding_window=8):
    """A transformers config of a tiny random-init model of `family` (no download)."""
    import transformers
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "mistral":  # a window shorter than the sequence: the masks carry it
        return transformers.MistralConfig(sliding_window=sliding_window, **common)
    if family == "gemma2":  # logit softcapping (scores of a few units: a cap of 2 bends them) and a window
        return transformers.Gemma2Config(sliding_window=sliding_window, attn_logit_softcapping=2.0, head_dim=16,
                                         **common)
    if family == "gpt_oss":  # attention sinks (s_aux), windowed and full layers; both experts of 2 always
        # chosen, so that no routing decision can flip between two roundings
        return transformers.GptOssConfig(sliding_window=sliding_window, head_dim=16, num_local_experts=2,
                                         num_experts_per_tok=2, **common)
    raise ValueError(family)


def free_port():
    """A free TCP port on this host, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def process_group(rank, world, port, backend):
    """This process as rank `rank` of a torch.distributed group of `world` (gloo, or NCCL on GPU `rank`)."""
    import torch.distributed as dist
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
