"""Dense attention: values, log-sum-exps and gradients against a naive float64 reference and torch
SDPA, over shapes (ragged lengths, Nq != Nk, GQA/MQA, head dims), causal alignments, scales and dtypes.

Each test runs on the cpu path, and on the cuda path (the GPU's default kernels) where a GPU is present;
the Hopper kernels' own cases (path sm90, their name in the profiler) at the end. Shapes, layouts and
broadcasting: test_shapes.py; attn_mask: test_mask.py."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention import bias as sdpa_bias
from torch.nn.attention.bias import causal_lower_right

import flashattn_ext
from helpers import (
    ERROR_FLOOR,
    POISON_BYTES,
    assert_within_twice_sdpa,
    deterministic_algorithms,
    expanded,
    forward_and_grads,
    kernel_names,
    make_inputs,
    naive_attention,
    on_paths,
    poison_cuda_allocator,
    random_grad_out,
    random_inputs,
    relative_error,
)


# (batch, heads_q, heads_kv, len_q, len_k, head_dim, head_dim_v): ragged lengths,
# len_q != len_k, head dims that are not powers of two, GQA and MQA.
SHAPES = [
    (1, 2, 2, 1, 1, 16, 16),
    (2, 3, 3, 7, 7, 8, 8),
    (1, 2, 2, 63, 65, 24, 24),
    (1, 4, 2, 65, 63, 40, 40),
    (2, 2, 1, 7, 1000, 64, 64),
    (1, 2, 2, 1000, 1000, 64, 64),
    (1, 3, 1, 1000, 65, 72, 72),
    (1, 1, 1, 63, 1, 3, 5),
]


SHAPE_IDS = ["x".join(map(str, shape)) for shape in SHAPES]


@on_paths("cpu", "cuda")
@pytest.mark.parametrize("mode", ["full", "causal", "causal_lower_right"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_float64_matches_naive_reference(shape, mode, path):
    """In float64 the kernel must agree with the naive formula to rounding."""
    device = path.device
    inputs = make_inputs(shape, torch.float64, device)
    is_causal, lower_right = mode != "full", mode == "causal_lower_right"
    gqa = shape[1] != shape[2]

    def ours(q, k, v):
        out, _ = flashattn_ext.attention_with_lse(
            q, k, v, is_causal=is_causal, causal_lower_right=lower_right, enable_gqa=gqa
        )
        return out

    def reference(q, k, v):
        return naive_attention(q, k, v, is_causal, lower_right, enable_gqa=gqa)[0]

    grad_out = random_grad_out(shape, device)
    got, want = forward_and_grads(ours, inputs, grad_out), forward_and_grads(reference, inputs, grad_out)
    # Where every row sees one key, dq is exactly 0: measured against the problem's scale.
    problem_scale = max(w.abs().max().item() for w in want)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(g).all(), name
        assert relative_error(g, w, zero_scale=problem_scale) < 1e-12, name


@on_paths("cpu", "cuda")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_low_precision_error_within_twice_sdpa(shape, is_causal, dtype, path):
    """Error against a float64 reference: at most twice torch SDPA's own error in the same dtype, plus a floor."""
    device = path.device
    inputs = make_inputs(shape, dtype, device)
    gqa = shape[1] != shape[2]
    grad_out = random_grad_out(shape, device)

    def ours(q, k, v):
        return flashattn_ext.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=gqa)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=gqa)

    inputs64 = [t.detach().double() for t in inputs]
    want = forward_and_grads(sdpa, inputs64, grad_out)
    got = forward_and_grads(ours, inputs, grad_out)
    baseline = forward_and_grads(sdpa, inputs, grad_out)
    assert_within_twice_sdpa(got, baseline, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("threads", [1, 3, 8])
@pytest.mark.parametrize("shape", [(1, 2, 1, 300, 300, 64, 64), (2, 4, 2, 200, 330, 48, 48)], ids=["mqa", "gqa"])
def test_cpu_any_thread_count(shape, threads, dtype):
    """The CPU forward splits its work by the thread count: with fewer key/value heads than threads, the
    threads share each head's key and value tiles, loaded in a pass of their own (here at 8 threads, and
    for MQA at 3). Every split: within twice torch SDPA's error against float64, causal and with GQA."""
    inputs = make_inputs(shape, dtype, "cpu")
    grad_out = random_grad_out(shape, "cpu")

    def run(fn, inputs):
        return forward_and_grads(lambda q, k, v: fn(q, k, v, is_causal=True, enable_gqa=True), inputs, grad_out)

    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = run(flashattn_ext.scaled_dot_product_attention, inputs)
    finally:
        torch.set_num_threads(saved_threads)
    want = run(F.scaled_dot_product_attention, [t.detach().double() for t in inputs])
    baseline = run(F.scaled_dot_product_attention, inputs)
    assert_within_twice_sdpa(got, baseline, want, dtype)


@on_paths("cpu", "cuda")
@pytest.mark.parametrize("scale", [-0.3, 0.0, 2.0], ids=["negative", "zero", "large"])
def test_any_scale_error_within_twice_sdpa(scale, path):
    """The forward's fast path folds a positive scale into the row max; zero and negative scales take
    the general path. With whole key tiles (200 keys) both paths run; each must give SDPA's answer."""
    device = path.device
    dtype = torch.bfloat16
    shape = (2, 4, 2, 130, 200, 64, 64)
    inputs = make_inputs(shape, dtype, device)
    grad_out = random_grad_out(shape, device)

    def ours(q, k, v):
        return flashattn_ext.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

    want = forward_and_grads(sdpa, [t.detach().double() for t in inputs], grad_out)
    got = forward_and_grads(ours, inputs, grad_out)
    # The baseline error comes from SDPA's math backend: on an H100, torch's default CUDA backend
    # returned NaN here (2026-11-21), as a kernel would that assumes a positive scale.
    with sdpa_kernel(SDPBackend.MATH):
        baseline = forward_and_grads(sdpa, inputs, grad_out)
    assert_within_twice_sdpa(got, baseline, want, dtype)


@on_paths("cpu", "cuda")
@pytest.mark.parametrize("mode", ["full", "causal", "causal_lower_right"])
def test_lse_is_logsumexp_of_scaled_scores(mode, path):
    device = path.device
    q, k, v = make_inputs((2, 4, 2, 65, 130, 32, 32), torch.float32 if device == "cpu" else torch.bfloat16, device)
    is_causal, lower_right = mode != "full", mode == "causal_lower_right"
    _, lse = flashattn_ext.attention_with_lse(
        q, k, v, is_causal=is_causal, causal_lower_right=lower_right, scale=0.3, enable_gqa=True
    )
    _, want = naive_attention(q.double(), k.double(), v.double(), is_causal, lower_right, 0.3, enable_gqa=True)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 65)
    torch.testing.assert_close(lse.double(), want, rtol=1e-5, atol=1e-5)


@on_paths("cpu", "cuda")
def test_matches_torch_sdpa_lower_right_causal_bias(path):
    """Bottom-right alignment means what torch's causal_lower_right bias means."""
    q, k, v = make_inputs((1, 2, 2, 40, 100, 16, 16), torch.float64, path.device)
    ours, _ = flashattn_ext.attention_with_lse(q, k, v, is_causal=True, causal_lower_right=True)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_bias.causal_lower_right(40, 100))
    torch.testing.assert_close(ours, want, rtol=1e-12, atol=1e-12)


@on_paths("cpu", "cuda")
def test_rows_that_see_no_key_give_zero_and_finite_gradients(path):
    """Bottom-right causal with len_q > len_k: the first len_q - len_k rows see no key."""
    q, k, v = make_inputs((1, 2, 2, 9, 4, 8, 8), torch.float64, path.device)
    out, lse = flashattn_ext.attention_with_lse(q, k, v, is_causal=True, causal_lower_right=True)
    assert (out[:, :, :5] == 0).all() and torch.isneginf(lse[:, :, :5]).all()
    want, want_lse = naive_attention(q, k, v, is_causal=True, causal_lower_right=True)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse[:, :, 5:], want_lse[:, :, 5:])
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[:, :, :5] == 0).all()


# (len_q, len_k, causal alignment, head dim): query 0 of a causal call sees key 0 alone; bottom-right
# with more queries than keys, query len_q - len_k does; with one key, every query does (and every
# query of a long causal call but the first sees more).
ONE_KEY_CASES = [(1, 9, "top_left", 40), (300, 300, "top_left", 128), (70, 20, "bottom_right", 64),
                 (33, 1, None, 128), (200, 1, "top_left", 64)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", ONE_KEY_CASES, ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}-d{c[3]}")
@on_paths("cpu", "cuda", "sm80", "deterministic")
def test_a_row_that_sees_one_key_gets_exact_zero_gradients(path, case, dtype):
    """A query row that sees one key has probability 1 there: its dq is 0 and it adds 0 to dk,
    exactly, as SDPA gives, in every backward (the CPU's delta summed from P and dP; the CUDA
    kernels' from the rounded output, zeroed for these rows), and its output is that key's value."""
    device = path.device
    len_q, len_k, causal, dim = case
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, n, dim, generator=gen, dtype=torch.float64).to(dtype).to(device).requires_grad_()
               for n in (len_q, len_k, len_k))
    dout = torch.randn(2, 3, len_q, dim, generator=gen, dtype=torch.float64).to(dtype).to(device)
    first = len_q - len_k if causal == "bottom_right" else 0  # the first row that sees key 0 alone
    alone = slice(None) if len_k == 1 else slice(first, first + 1)  # the rows that do
    with deterministic_algorithms(path.name == "deterministic"):
        out, _ = flashattn_ext.attention_with_lse(q, k, v, is_causal=causal is not None,
                                                  causal_lower_right=causal == "bottom_right")
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert (dq[:, :, alone] == 0).all()
    if len_k == 1 or len_q == 1:  # every row that sees key 0 sees it alone
        assert (dk == 0).all()
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all()
    assert torch.equal(out[:, :, alone], v[:, :, :1].expand_as(out[:, :, alone]))


# The Hopper (sm_90a) kernels against float64, path sm90. On an H100/H200 they are the default for the
# calls they cover, and the tests above run through them too; these check what is particular to them:
# every covered shape (ragged lengths against the 128-row tiles, Nq != Nk, both causal alignments, GQA,
# padded head dims, sequence-major strides), every output element written (outputs land on memory
# poisoned with NaN).
# (batch, heads_q, heads_kv, len_q, len_k, head_dim)
SM90_SHAPES = [
    (2, 4, 4, 128, 128, 128),
    (1, 2, 2, 1000, 1000, 128),
    (2, 4, 2, 200, 517, 64),
    (1, 3, 1, 517, 200, 64),
    (1, 2, 2, 1, 1000, 128),
    (1, 2, 2, 1000, 1, 64),
    (1, 8, 2, 384, 384, 96),
    (2, 2, 2, 129, 257, 72),
    (1, 2, 1, 300, 300, 32),
    (1, 1, 1, 4096, 4096, 128),
    # More tiles than an H100 or H200 has SMs (132): the persistent forward's blocks take several
    # each, with the K/V ring running on across them; in the second, tiles whose rows see no key.
    (4, 40, 8, 520, 520, 128),
    (2, 48, 48, 600, 100, 64),
    # Head dim 96 (padded to 128: the copy engine's output stores clip the columns), keyless tiles
    # among tiles whose output is still being stored from shared memory.
    (2, 40, 40, 600, 100, 96),
    # Causal calls take tiles heaviest first in chunks of (batch, head) pairs: here 602 pairs of
    # 2-block heads, in chunks of unequal sizes (on 132 SMs, the forward's three of 201, 201 and
    # 200 pairs, the backward's ten of 61 or 60).
    (2, 301, 301, 256, 256, 128),
    # The last 176-key tile of a non-causal row block runs its GEMMs over 48 or 112 keys where it holds
    # no more: 112 of 112 here (48 of 48 at 4096 keys above, masked ones at 384, 257 and 256 keys).
    (1, 4, 2, 333, 2048, 128),
    # Head dim 256 (the forward's 80-key tiles in two stages; the backward's 64-key blocks, both
    # consumers on the same keys): a ragged last key tile with GQA, head dims 160 and 192 padded to
    # it, one query, more tiles than SMs, a causal diagonal through ragged tiles, and a long ring of
    # key tiles.
    (2, 4, 2, 200, 517, 256),
    (2, 3, 3, 129, 257, 160),
    (1, 2, 1, 1, 1000, 192),
    (2, 40, 8, 300, 300, 256),
    (1, 2, 2, 1000, 1000, 256),
    (1, 1, 1, 4096, 4096, 256),
]


SM90_SHAPE_IDS = ["x".join(map(str, s)) for s in SM90_SHAPES]


SM90_MODES = ["full", "causal", "causal_lower_right"]


def poisoned_forward(q, k, v, mode, scale=None):
    """flashattn_ext's (out, lse), its outputs allocated on poisoned memory."""
    poison_cuda_allocator(POISON_BYTES)
    return flashattn_ext.attention_with_lse(
        q, k, v, is_causal=mode != "full", causal_lower_right=mode == "causal_lower_right", scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )


def float64_reference(q, k, v, mode, scale=None):
    return naive_attention(
        q.double(), k.double(), v.double(), is_causal=mode != "full",
        causal_lower_right=mode == "causal_lower_right", scale=scale, enable_gqa=q.shape[1] != k.shape[1],
    )


def sdpa_error_of(q, k, v, mode, want_out):
    """torch SDPA's own error in this dtype, against the same float64 reference (rows that see
    no key, NaN there, counted as the 0 we give)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if mode == "causal_lower_right":
        mask = causal_lower_right(q.shape[-2], k.shape[-2])
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    else:
        got = F.scaled_dot_product_attention(q, k, v, is_causal=mode == "causal")
    return relative_error(torch.nan_to_num(got), want_out)


@on_paths("sm90")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", SM90_MODES)
@pytest.mark.parametrize("shape", SM90_SHAPES, ids=SM90_SHAPE_IDS)
def test_forward_matches_float64(path, shape, mode, dtype):
    """Out and lse within twice SDPA's own error of a float64 reference, every element written."""
    q, k, v = random_inputs(shape, dtype, seed=hash(shape) % 1000)
    out, lse = poisoned_forward(q, k, v, mode)
    want_out, want_lse = float64_reference(q, k, v, mode)
    assert torch.isfinite(out).all(), "an output element was not written (NaN poison) or overflowed"
    error = relative_error(out, want_out)
    assert error <= 2 * sdpa_error_of(q, k, v, mode, want_out) + ERROR_FLOOR[dtype], error
    visible = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), visible)
    assert (lse[visible].double() - want_lse[visible]).abs().max().item() < 1e-3


@on_paths("sm90")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", ["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_forward_with_scores_climbing_along_the_keys(path, head_dim, mode, dtype):
    """Scores that climb (or fall) along the keys, by up to 200 (log2 units) over a row and at a rate
    that differs by row: the forward moves a row's running max only where a key tile's exceeds it by
    more than a margin, and takes the exps against the stale one otherwise. Out and lse must come out
    as with the exact max in every tile."""
    batch, heads, n = 1, 2, 2048
    gen = torch.Generator().manual_seed(head_dim)
    q, k, v = (torch.randn(batch, heads, n, head_dim, generator=gen) for _ in range(3))
    direction = torch.randn(head_dim, generator=gen)
    direction /= direction.norm()
    # Row i's scores gain slope_i * key / n * climb along the keys (log2 units), slope_i from -1 to 1.
    climb = 200 / (head_dim**-0.5 * math.log2(math.e))
    q += (torch.linspace(-1, 1, n) * climb)[:, None] * direction
    k += (torch.arange(n) / n)[:, None] * direction
    q, k, v = (x.to("cuda", dtype) for x in (q, k, v))
    out, lse = poisoned_forward(q, k, v, mode)
    want_out, want_lse = float64_reference(q, k, v, mode)
    assert torch.isfinite(out).all()
    error = relative_error(out, want_out)
    assert error <= 2 * sdpa_error_of(q, k, v, mode, want_out) + ERROR_FLOOR[dtype], error
    assert (lse.double() - want_lse).abs().max().item() < 1e-3


def gradients(fn, q, k, v, mode, grad_out):
    """(out, dq, dk, dv) of fn on fresh leaves; fn takes SDPA's arguments."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if mode == "causal_lower_right":
        out = fn(*leaves, attn_mask=causal_lower_right(q.shape[-2], k.shape[-2]))
    else:
        out = fn(*leaves, is_causal=mode == "causal")
    return (out.detach(), *torch.autograd.grad(out, leaves, grad_out.to(out.dtype)))


@on_paths("sm90")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", SM90_MODES)
@pytest.mark.parametrize("shape", [s for s in SM90_SHAPES if s[3] * s[4] <= 1000 * 1000], ids=lambda s: "x".join(map(str, s)))
def test_backward_matches_float64(path, shape, mode, dtype):
    """dq, dk, dv within twice SDPA's own error of float64 (the atomic-dQ backward, the default)."""
    check_backward(shape, mode, dtype, seed=hash(shape) % 1000 + 1)


@on_paths("sm90")
@pytest.mark.parametrize("mode", ["full", "causal_lower_right"])
def test_backward_at_head_dim_256_in_chunks_of_heads(path, mode):
    """Above head dim 128 the backward takes the (batch, key/value head) pairs a chunk at a time, over a
    float32 dQ workspace for one chunk: here, with 264 key blocks a pair, on 132 SMs, three chunks of two
    of the six pairs (the second spans both batch elements), each through the workspace the one before
    left."""
    check_backward((2, 6, 3, 1024, 16896, 256), mode, torch.bfloat16, seed=11)


def check_backward(shape, mode, dtype, seed):
    q, k, v = random_inputs(shape, dtype, seed=seed)
    gen = torch.Generator().manual_seed(7)
    grad_out = torch.randn(shape[0], shape[1], shape[3], shape[5], generator=gen).to("cuda")
    poison_cuda_allocator(POISON_BYTES)
    ours = lambda *args, **kwargs: flashattn_ext.scaled_dot_product_attention(*args, enable_gqa=True, **kwargs)  # noqa: E731
    assert_gradients_within_twice_sdpa(gradients(ours, q, k, v, mode, grad_out), q, k, v, mode, grad_out, dtype)


def assert_gradients_within_twice_sdpa(got, q, k, v, mode, grad_out, dtype):
    """got (out, dq, dk, dv) every element finite, and each within twice SDPA's own error in dtype of SDPA's
    in float64 (plus ERROR_FLOOR), errors against the gradients' scale."""
    want = gradients(expanded(F.scaled_dot_product_attention), q.double(), k.double(), v.double(), mode, grad_out)
    base = gradients(expanded(F.scaled_dot_product_attention), q, k, v, mode, grad_out)
    scale = max(w.abs().max().item() for w in want[1:])
    for name, g, b, w in zip(("out", "dq", "dk", "dv"), got, base, want):
        assert torch.isfinite(g).all(), f"{name}: not every element written, or not finite"
        w, b = torch.nan_to_num(w), torch.nan_to_num(b)  # rows that see no key: SDPA's NaN, our 0
        ours, sdpa = relative_error(g, w, zero_scale=scale), relative_error(b, w, zero_scale=scale)
        assert ours <= 2 * sdpa + ERROR_FLOOR[dtype], f"{name}: {ours:.3g} vs SDPA's {sdpa:.3g}"


# (batch, heads_q, heads_kv, len_q, len_k, head_dim): key blocks of 128 a head fewer than its query tiles
# (64 rows at head dim 128, 128 at 64), more of them (several blocks start at one tile), and a top-left causal
# call whose last key blocks no row sees; causal GQA groups of 2, 3 and 4 (their query heads split over 2, 3
# and 2 blocks: deterministic_head_splits).
DETERMINISTIC_SHAPES = [(2, 4, 2, 1000, 1000, 128), (2, 2, 2, 2047, 513, 128), (1, 3, 1, 300, 2100, 64),
                        (1, 2, 1, 4096, 4096, 64), (1, 8, 2, 700, 900, 128)]


@on_paths("sm90")
@pytest.mark.parametrize("mode", SM90_MODES)
@pytest.mark.parametrize("shape", DETERMINISTIC_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_deterministic_backward_on_hopper(path, shape, mode):
    """Under torch.use_deterministic_algorithms the Hopper kernel takes the backward (its name in the
    profiler, no sm80 kernel), its key blocks adding their dQ of a tile in a fixed order: dq, dk and dv
    bitwise equal over three runs, and within twice SDPA's error of float64."""
    check_deterministic_backward(shape, mode)


@on_paths("sm90")
def test_deterministic_causal_backward_past_the_sms(path):
    """Causal, more key blocks of 128 than the GPU has SMs: the blocks start last first and each waits
    only for blocks that started before it, so the Hopper kernel takes it."""
    len_k = (torch.cuda.get_device_properties(0).multi_processor_count + 3) * 128
    check_deterministic_backward((1, 2, 1, 300, len_k, 64), "causal_lower_right")


def check_deterministic_backward(shape, mode):
    q, k, v = random_inputs(shape, torch.bfloat16, seed=sum(shape))
    gen = torch.Generator().manual_seed(5)
    grad_out = torch.randn(shape[0], shape[1], shape[3], shape[5], generator=gen).to("cuda")
    ours = lambda *args, **kwargs: flashattn_ext.scaled_dot_product_attention(*args, enable_gqa=True, **kwargs)  # noqa: E731
    with deterministic_algorithms():
        names = kernel_names(lambda: gradients(ours, q, k, v, mode, grad_out))
        runs = [gradients(ours, q, k, v, mode, grad_out) for _ in range(3)]
    assert any("sm90" in n and "attention_backward_kernel" in n for n in names), names
    assert not any("sm80" in n for n in names), names
    for name, first, *others in zip(("out", "dq", "dk", "dv"), *runs):
        assert all(torch.equal(first, other) for other in others), f"{name} differs between runs"
    assert_gradients_within_twice_sdpa(runs[0], q, k, v, mode, grad_out, torch.bfloat16)


@on_paths("sm90")
def test_deterministic_backward_past_the_sms_runs_sm80(path):
    """Not causal, more key blocks of 128 a head than the GPU has SMs: the Hopper kernel's order would have a
    block wait for one not yet resident, so the sm80 kernels' separate dQ pass takes the deterministic
    backward."""
    len_k = (torch.cuda.get_device_properties(0).multi_processor_count + 1) * 128
    q, k, v = random_inputs((1, 1, 1, 64, len_k, 64), torch.bfloat16, seed=2)
    grad_out = torch.randn_like(q)
    with deterministic_algorithms():
        names = kernel_names(lambda: gradients(flashattn_ext.scaled_dot_product_attention, q, k, v, "full", grad_out))
    assert any("sm80" in n and "attention_dq_kernel" in n for n in names), names
    assert not any("sm90" in n and "attention_backward_kernel" in n for n in names), names


# (batch, heads_q, heads_kv, len_q, len_k, head_dim, head_dim_v): MLA's prefill (192 / 128), GQA with ragged
# lengths, and head dims the kernel pads (160 / 96 read as 192 / 128); keys of one 96-key block and one more.
MLA_SHAPES = [(2, 4, 2, 333, 700, 192, 128), (1, 3, 1, 1024, 1024, 192, 128), (2, 2, 2, 200, 129, 160, 96),
              (1, 4, 1, 150, 97, 192, 128)]


@on_paths("sm90")
@pytest.mark.parametrize("options", [dict(), dict(is_causal=True), dict(is_causal=True, causal_lower_right=True),
                                     dict(window=(100, 0), is_causal=True)],
                         ids=["full", "causal", "causal_lower_right", "window"])
@pytest.mark.parametrize("shape", MLA_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_values_of_another_head_dim(path, shape, options, dtype):
    """Queries and keys of head dim 192 with values of 128 (MLA's prefill): the Hopper forward and backward
    (their kernels in the profiler) against float64, every element of the output and gradients written
    (NaN-poisoned memory), the lse too."""
    batch, heads_q, heads_kv, len_q, len_k, dim, dim_v = shape
    gen = torch.Generator().manual_seed(len_q + dim_v)
    q = torch.randn(batch, heads_q, len_q, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, heads_kv, len_k, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, heads_kv, len_k, dim_v, generator=gen, dtype=torch.float64)
    dout = torch.randn(batch, heads_q, len_q, dim_v, generator=gen, dtype=torch.float64)
    leaves = [t.to("cuda", dtype).requires_grad_() for t in (q, k, v)]
    options = dict(options, enable_gqa=heads_q != heads_kv)
    grad_out = dout.to("cuda", dtype)
    names = kernel_names(
        lambda: torch.autograd.grad(flashattn_ext.attention_with_lse(*leaves, **options)[0], leaves, grad_out))
    assert any("sm90" in n and "attention_forward_kernel" in n for n in names), names
    assert any("sm90" in n and "attention_backward_mla_kernel" in n for n in names), names
    poison_cuda_allocator(POISON_BYTES)
    out, lse = flashattn_ext.attention_with_lse(*leaves, **options)
    grads = torch.autograd.grad(out, leaves, grad_out)
    exact = [t.clone().requires_grad_() for t in (q, k, v)]
    want_out, _ = naive_attention(*exact, **options)
    want_grads = torch.autograd.grad(want_out, exact, dout)
    rounded = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    base_out, _ = naive_attention(*rounded, **options)
    base_grads = torch.autograd.grad(base_out, rounded, dout.to(dtype))
    for name, g, b, w in zip(("out", "dq", "dk", "dv"), (out, *grads), (base_out, *base_grads), (want_out, *want_grads)):
        assert torch.isfinite(g).all(), f"{name}: not every element written"
        ours, naive = relative_error(g.cpu(), w), relative_error(b, w)
        assert ours <= 2 * naive + ERROR_FLOOR[dtype], f"{name}: {ours:.3g} vs {naive:.3g}"
    # The lse against float64 on the rounded inputs: their rounding alone moves it by some 1e-3 at d=192.
    _, rounded_lse = naive_attention(*(t.to(dtype).double() for t in (q, k, v)), **options)
    seen = torch.isfinite(rounded_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), seen)
    assert (lse.cpu()[seen].double() - rounded_lse[seen]).abs().max().item() < 1e-3


@on_paths("sm90")
@pytest.mark.parametrize("mode", SM90_MODES)
def test_sequence_major_strides(path, mode):
    """(B, N, H, D) storage read in place through the tensor maps' strides."""
    shape = (2, 4, 2, 333, 700, 128)
    q, k, v = random_inputs(shape, torch.bfloat16, seq_major=True, seed=5)
    out, lse = poisoned_forward(q, k, v, mode)
    want_out, _ = float64_reference(q, k, v, mode)
    assert relative_error(out, want_out) <= 2 * sdpa_error_of(q, k, v, mode, want_out) + ERROR_FLOOR[torch.bfloat16]
