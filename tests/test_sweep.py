"""A seeded randomized sweep against the float64 reference, and the GPU-only properties that a
sweep of small problems cannot reach: a second GPU, CUDA graphs, launch grids above 65535 and
element offsets above 2^31, and determinism.

Each sweep case is drawn from random.Random(seed) with the seed in the test id, so that
``pytest tests/test_sweep.py -k cuda-seed17`` reruns one case; every assertion message prints
the case it drew.
"""
import math
import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import bias as sdpa_bias

import flashattn_ext
from helpers import ERROR_FLOOR, cuda_test, naive_attention, on_paths, on_paths_each, poison_cuda_allocator
from helpers import deterministic_algorithms, relative_error

LENGTHS = (1, 7, 63, 64, 65, 127, 128, 129, 255, 257, 1000)
CUDA_ONLY_LENGTHS = (2048, 2049)
FAVOURED_HEAD_DIMS = (64, 96, 128, 256)
MODES = ("full", "causal", "causal_lower_right")
GRAD_OUT_LAYOUTS = ("contiguous", "transposed", "broadcast")
SEEDS_BY_PATH = {"cpu": range(12), "cuda": range(40)}  # one case a seed
# CPU CI runs on 2 cores: its cases stay small enough for the sweep to take seconds.
CPU_MAX_LENGTH, CPU_MAX_HEAD_DIM = 300, 128
NAMES = ("out", "dq", "dk", "dv")
# Poison of this many float32 per input element: several times out, the gradients and any workspace.
POISON_FACTOR = 4


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    batch: int
    heads_kv: int
    group: int  # query heads per key/value head
    len_q: int
    len_k: int
    head_dim: int  # of query, key and value alike
    mode: str  # one of MODES; "causal" is aligned top-left, as in torch SDPA
    seq_major: bool = False  # q, k, v are (B, N, H, D) memory seen as (B, H, N, D)
    grad_out: str = "contiguous"  # one of GRAD_OUT_LAYOUTS; "broadcast": the stride-0 gradient of out.sum()

    @property
    def heads_q(self):
        return self.heads_kv * self.group

    @property
    def is_causal(self):
        return self.mode != "full"

    @property
    def lower_right(self):
        return self.mode == "causal_lower_right"

    @property
    def enable_gqa(self):
        return self.group > 1

    @property
    def dead_rows(self):
        """The leading query rows that see no key: bottom-right alignment with len_q > len_k."""
        return max(self.len_q - self.len_k, 0) if self.lower_right else 0


def draw_case(device, seed):
    """One case from random.Random(seed): only the seed is needed to reproduce it."""
    rng = random.Random(seed)
    on_cpu = device == "cpu"
    max_head_dim = CPU_MAX_HEAD_DIM if on_cpu else 256
    favoured = [d for d in FAVOURED_HEAD_DIMS if d <= max_head_dim]
    lengths = [n for n in LENGTHS if n <= CPU_MAX_LENGTH] if on_cpu else LENGTHS + CUDA_ONLY_LENGTHS
    return Case(
        dtype=rng.choice([torch.float16, torch.bfloat16] + ([torch.float32] if on_cpu else [])),
        batch=rng.randint(1, 3),
        heads_kv=rng.randint(1, 4),
        group=rng.choice((1, 2, 4)),
        len_q=rng.choice(lengths),
        len_k=rng.choice(lengths),
        head_dim=rng.choice(favoured) if rng.random() < 0.5 else rng.randrange(8, max_head_dim + 1, 8),
        mode=rng.choice(MODES),
        seq_major=rng.random() < 0.5,
        grad_out=rng.choice(GRAD_OUT_LAYOUTS),
    )


def make_inputs(case, device, seed):
    """Leaf q, k, v and the upstream gradient, drawn in float64, rounded to the case's dtype and laid out as it says."""
    gen = torch.Generator().manual_seed(seed)

    def randn(heads, length, seq_major):
        shape = (case.batch, length, heads, case.head_dim) if seq_major else (case.batch, heads, length, case.head_dim)
        t = torch.randn(shape, generator=gen, dtype=torch.float64).to(device=device, dtype=case.dtype)
        return t.transpose(1, 2) if seq_major else t

    q = randn(case.heads_q, case.len_q, case.seq_major).requires_grad_()
    k, v = (randn(case.heads_kv, case.len_k, case.seq_major).requires_grad_() for _ in range(2))
    if case.grad_out == "broadcast":
        grad_out = torch.ones((), dtype=case.dtype, device=device).expand(q.shape)
    else:
        grad_out = randn(case.heads_q, case.len_q, case.grad_out == "transposed")
    return q, k, v, grad_out


def random_on_cuda(shapes, dtype, seed):
    """Random tensors made on the GPU, for inputs too large to draw in float64 on the host."""
    gen = torch.Generator("cuda").manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=dtype, device="cuda") for shape in shapes]


def leaves(*tensors):
    """Fresh autograd leaves on the same memory (views keep their strides)."""
    return [t.detach().requires_grad_() for t in tensors]


def ours(case, q, k, v, grad_out, poison=False):
    """flashattn_ext's (out, dq, dk, dv) and lse. With poison, the CUDA allocator is poisoned
    before the forward and before the backward call."""
    q, k, v = leaves(q, k, v)
    poison_bytes = POISON_FACTOR * 4 * (q.numel() + k.numel() + v.numel())
    if poison:
        poison_cuda_allocator(poison_bytes, q.device)
    out, lse = flashattn_ext.attention_with_lse(
        q, k, v, is_causal=case.is_causal, causal_lower_right=case.lower_right, enable_gqa=case.enable_gqa
    )
    if poison:
        poison_cuda_allocator(poison_bytes, q.device)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), grad_out)), lse


def reference(case, q, k, v, grad_out):
    """The naive float64 (out, dq, dk, dv) and lse, on the same rounded inputs."""
    q, k, v = leaves(q.double(), k.double(), v.double())
    out, lse = naive_attention(q, k, v, case.is_causal, case.lower_right, enable_gqa=case.enable_gqa)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), grad_out.double())), lse


def torch_sdpa(case, q, k, v, grad_out):
    """torch SDPA's (out, dq, dk, dv) in the inputs' dtype: its error sets the error budget.

    Bottom-right causal goes through torch's causal_lower_right bias. Where len_q > len_k the
    first len_q - len_k rows see no key, and SDPA may give NaN there, in out and through the
    backward in dk and dv too. So SDPA runs on the other rows only, which see the same keys
    either way, and the dead rows get their defined output, 0: all four tensors stay comparable."""
    q, k, v = leaves(q, k, v)
    if case.lower_right:
        dead = case.dead_rows
        mask = sdpa_bias.causal_lower_right(case.len_q - dead, case.len_k)
        out = F.scaled_dot_product_attention(q[..., dead:, :], k, v, attn_mask=mask, enable_gqa=case.enable_gqa)
        out = F.pad(out, (0, 0, dead, 0))
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=case.is_causal, enable_gqa=case.enable_gqa)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), grad_out))


def assert_finite(got, context):
    """out, dq, dk, dv hold no NaN (an element left unwritten in poisoned memory) and no inf."""
    for name, t in zip(NAMES, got):
        assert torch.isfinite(t).all(), f"{name} is not finite; {context}"


def check_against_reference(case, inputs, got, got_lse, context):
    """Checks our results on inputs (q, k, v, grad_out) against the float64 reference.

    out, dq, dk and dv: finite, and within twice torch SDPA's error in the same dtype plus a
    floor. lse: close on the rows that see keys. Rows that see no key: out = 0, dq = 0, lse = -inf."""
    want, want_lse = reference(case, *inputs)
    baseline = torch_sdpa(case, *inputs)
    problem_scale = max(w.abs().max().item() for w in want)
    assert_finite(got, context)
    for name, g, b, w in zip(NAMES, got, baseline, want):
        assert g.dtype == case.dtype and g.device == inputs[0].device, f"{name}: {g.dtype} on {g.device}; {context}"
        ours_error = relative_error(g, w, zero_scale=problem_scale)
        sdpa_error = relative_error(b, w, zero_scale=problem_scale)
        assert math.isfinite(sdpa_error), f"{name}: torch SDPA's own result is not finite; {context}"
        assert ours_error <= 2 * sdpa_error + ERROR_FLOOR[case.dtype], (
            f"{name}: error {ours_error:.3g} vs torch SDPA's {sdpa_error:.3g}; {context}"
        )
    dead = case.dead_rows
    out, dq = got[0], got[1]
    assert (out[..., :dead, :] == 0).all() and (dq[..., :dead, :] == 0).all(), f"rows that see no key: {context}"
    assert got_lse.dtype == torch.float32 and torch.isneginf(got_lse[..., :dead]).all(), f"lse: {context}"
    torch.testing.assert_close(
        got_lse[..., dead:].double(), want_lse[..., dead:], rtol=1e-4, atol=1e-4, msg=lambda m: f"lse: {m}\n{context}"
    )


@on_paths_each("seed", SEEDS_BY_PATH, ids=lambda seed: f"seed{seed}")
def test_sweep(path, seed):
    case = draw_case(path.device, seed)
    inputs = make_inputs(case, path.device, seed)
    got, lse = ours(case, *inputs, poison=path.device == "cuda")
    check_against_reference(case, inputs, got, lse, f"{path.name} seed {seed}: {case}")


@pytest.mark.parametrize("seed", SEEDS_BY_PATH["cuda"][::2])
@on_paths("deterministic")
def test_sweep_deterministic_backward(path, seed):
    """Every other CUDA sweep case again in deterministic mode, whose backward computes dQ in a
    separate pass instead of with atomics (the default the plain sweep runs)."""
    case = draw_case(path.device, seed)
    inputs = make_inputs(case, path.device, seed)
    with deterministic_algorithms():
        got, lse = ours(case, *inputs, poison=True)
    check_against_reference(case, inputs, got, lse, f"cuda seed {seed}, deterministic: {case}")


def check_head(case, inputs, got, lse, index, context):
    """Checks one (batch, head), by flat index, of a large run against the reference run on that head alone."""
    batch, head = divmod(index, case.heads_q)

    def pick(t):
        return t[batch : batch + 1, head : head + 1]

    check_against_reference(
        case, [pick(t) for t in inputs], [pick(t) for t in got], pick(lse), f"{context}, batch {batch} head {head}"
    )


@cuda_test
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_second_gpu_gives_the_same_answer():
    """Tensors on cuda:1 while cuda:0 is current: the ops must launch on the tensors' device."""
    case = Case(
        torch.bfloat16, batch=2, heads_kv=2, group=2, len_q=257, len_k=129, head_dim=128, mode="causal_lower_right",
        seq_major=True,
    )
    answers = []
    with torch.cuda.device(0):
        for device in ("cuda:0", "cuda:1"):
            inputs = make_inputs(case, device, seed=0)
            got, lse = ours(case, *inputs, poison=True)
            check_against_reference(case, inputs, got, lse, f"{device}: {case}")
            answers.append([t.cpu() for t in (*got, lse)])
        assert torch.cuda.current_device() == 0
    for name, on_0, on_1 in zip((*NAMES, "lse"), *answers):
        torch.testing.assert_close(on_1, on_0, msg=lambda m: f"{name} on cuda:1 vs cuda:0: {m}")


@cuda_test
def test_cuda_graph_replay_matches_eager():
    """Forward and backward capture into one CUDA graph (no host synchronisation, no stray
    allocation), and a replay computes on new values copied into the captured inputs."""
    case = Case(
        torch.float16, batch=2, heads_kv=2, group=2, len_q=257, len_k=129, head_dim=64, mode="causal_lower_right"
    )
    static = make_inputs(case, "cuda", seed=0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graph's documentation does
        for _ in range(3):
            ours(case, *static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, captured_lse = ours(case, *static)
    with torch.no_grad():
        for target, source in zip(static, make_inputs(case, "cuda", seed=1)):
            target.copy_(source)
    graph.replay()
    eager, eager_lse = ours(case, *static)
    for name, replayed, want in zip((*NAMES, "lse"), (*captured, captured_lse), (*eager, eager_lse)):
        torch.testing.assert_close(replayed, want, msg=lambda m: f"{name}, graph replay vs eager: {m}")


@cuda_test
@pytest.mark.parametrize("batch,heads", [(1, 70_000), (70_000, 1)])
def test_more_than_65535_heads(batch, heads):
    """A launch grid's y and z dimensions stop at 65535: every one of batch * heads > 65535 must
    still be computed, wherever the kernels put batch and heads in the grid."""
    case = Case(torch.bfloat16, batch, heads_kv=heads, group=1, len_q=16, len_k=16, head_dim=64, mode="causal")
    inputs = random_on_cuda(4 * [(batch, heads, 16, 64)], case.dtype, seed=0)
    got, lse = ours(case, *inputs, poison=True)
    assert_finite(got, str(case))
    for index in (0, 65_535, 65_536, batch * heads - 1):
        check_head(case, inputs, got, lse, index, str(case))


# (1, heads, 128, 128) with these heads: 2^31 + 2^20 elements per tensor, yet attention costs little.
HEADS_BEYOND_INT32 = 2**17 + 64


@cuda_test
def test_offsets_beyond_int32():
    """Element offsets above 2^31 (byte offsets above 2^32): the last heads of tensors that large
    must be read and written where they are, not where a 32-bit offset wraps to."""
    shape = (1, HEADS_BEYOND_INT32, 128, 128)
    numel = math.prod(shape)
    assert numel > 2**31
    # Eight bf16 tensors of this size (q, k, v, grad_out, out, dq, dk, dv) and a float32 dq accumulator.
    needed = 10 * 2 * numel
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    if free < needed:
        pytest.skip(f"needs {needed / 2**30:.0f} GiB of free GPU memory, has {free / 2**30:.0f} GiB")
    case = Case(
        torch.bfloat16, batch=1, heads_kv=HEADS_BEYOND_INT32, group=1, len_q=128, len_k=128, head_dim=128, mode="full"
    )
    inputs = random_on_cuda(4 * [shape], case.dtype, seed=0)
    got, lse = ours(case, *inputs)  # not poisoned: the tensors already fill half the GPU
    assert_finite(got, str(case))
    for index in (0, HEADS_BEYOND_INT32 - 2, HEADS_BEYOND_INT32 - 1):
        check_head(case, inputs, got, lse, index, str(case))


@cuda_test
def test_deterministic_algorithms_give_bitwise_identical_gradients():
    """Under torch.use_deterministic_algorithms(True), two backward runs agree bit for bit: GQA
    sums dk and dv over query heads, and long sequences sum dq over many key blocks."""
    case = Case(torch.bfloat16, batch=2, heads_kv=2, group=4, len_q=1000, len_k=1000, head_dim=128, mode="causal")
    inputs = make_inputs(case, "cuda", seed=0)
    with deterministic_algorithms():
        first, _ = ours(case, *inputs)
        second, _ = ours(case, *inputs)
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), f"{name} differs between two runs; {case}"
