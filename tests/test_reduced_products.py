"""The CPU forward's 16-bit tile products in the inputs' dtype (ReducedProducts in csrc/cpu/products.h).

They run where oneDNN has VNNI kernels for the dtype (AMX); FLASHATTN_EXT_CPU_REDUCED_GEMM=1, read once per
process, makes them run on any CPU. test_forced_reduced_products reruns this file's accuracy checks, the
CPU parity sweep, the exact zeros of rows that see one key (the backward recomputes the scores as the
forward made them) and the thread-count test (the forward's shared key/value tiles) in a subprocess with
it set; in this process the checks test whichever path the CPU takes.
The shapes cross the path's edges: several key tiles, keys and value columns that fill no whole block of
64, odd head dims (padded to even), one query row, GQA, masks and a negative scale (applied to the float scores).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashattn_ext
from helpers import ERROR_FLOOR, relative_error

FORCE_VARIABLE = "FLASHATTN_EXT_CPU_REDUCED_GEMM"

# (batch, heads_q, heads_kv, len_q, len_k, head_dim, head_dim_v, mask, scale)
CASES = {
    "causal-tiles": (1, 2, 2, 200, 200, 64, 64, "causal", None),
    "odd-dims": (2, 2, 2, 130, 300, 33, 65, None, None),
    "gqa-bool-mask": (1, 4, 2, 70, 70, 80, 16, "bool", None),
    "one-row-float-mask": (1, 3, 3, 1, 129, 16, 16, "float", None),
    "negative-scale": (1, 2, 1, 96, 257, 128, 128, None, -0.7),
}


def inputs(case, dtype):
    batch, heads_q, heads_kv, len_q, len_k, dim, dim_v, mask_kind, _ = CASES[case]
    gen = torch.Generator().manual_seed(sum(map(ord, case)))

    def randn(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)

    q, k = randn(batch, heads_q, len_q, dim), randn(batch, heads_kv, len_k, dim)
    v = randn(batch, heads_kv, len_k, dim_v)
    if mask_kind == "bool":
        mask = torch.rand((len_q, len_k), generator=gen) > 0.3
        mask[:, 0] = True  # every row sees a key
    elif mask_kind == "float":
        mask = randn(heads_q, len_q, len_k)
    else:
        mask = None
    return q, k, v, mask, randn(batch, heads_q, len_q, dim_v)


def run(fn, case, q, k, v, mask, grad_out):
    """(out, dq, dk, dv) of fn called as SDPA on fresh leaves."""
    _, heads_q, heads_kv, *_, mask_kind, scale = CASES[case]
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, attn_mask=mask, is_causal=mask_kind == "causal", scale=scale, enable_gqa=heads_q != heads_kv)
    return (out.detach(), *torch.autograd.grad(out, leaves, grad_out))


def sdpa_math(*args, **kwargs):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(*args, **kwargs)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_reduced_products_accuracy(dtype, case):
    """Values and gradients within twice torch SDPA's own error against float64, plus ERROR_FLOOR."""
    q, k, v, mask, grad_out = inputs(case, dtype)
    got = run(flashattn_ext.scaled_dot_product_attention, case, q, k, v, mask, grad_out)
    upcast = [t if t is None or t.dtype == torch.bool else t.double() for t in (q, k, v, mask, grad_out)]
    want = run(sdpa_math, case, *upcast)
    baseline = run(F.scaled_dot_product_attention, case, q, k, v, mask, grad_out)
    for name, g, b, w in zip(("out", "dq", "dk", "dv"), got, baseline, want):
        ours_error, sdpa_error = relative_error(g, w), relative_error(b, w)
        assert ours_error <= 2 * sdpa_error + ERROR_FLOOR[dtype], (
            f"{case} {dtype} {name}: error {ours_error:.3g} vs torch SDPA's {sdpa_error:.3g} "
            f"({FORCE_VARIABLE}={os.environ.get(FORCE_VARIABLE)})"
        )


@pytest.mark.skipif(os.environ.get(FORCE_VARIABLE) == "1", reason=f"{FORCE_VARIABLE}=1: the checks run in this process")
def test_forced_reduced_products():
    """This file's accuracy checks, the CPU parity sweep, the one-key rows' zeros and the thread counts' splits,
    the reduced products forced."""
    tests = Path(__file__).parent
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not cuda",
        f"{tests / 'test_reduced_products.py'}::test_reduced_products_accuracy", str(tests / "test_parity.py"),
        f"{tests / 'test_attention.py'}::test_a_row_that_sees_one_key_gets_exact_zero_gradients",
        f"{tests / 'test_attention.py'}::test_cpu_any_thread_count",
    ]  # fmt: skip
    result = subprocess.run(command, env={**os.environ, FORCE_VARIABLE: "1"}, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]
