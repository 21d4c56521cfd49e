"""The routing table (csrc/cuda/route.h), asked through flashattn_ext.kernel_route: which kernel family
takes a call, and why."""
import pytest
import torch
import torch.nn.functional as F

import flashattn_ext
from helpers import cuda_test, deterministic_algorithms, kernel_names, on_paths, random_inputs, relative_error


def qkv(device, dtype, heads_q=4, heads_kv=4, len_q=256, len_k=256, dim=128):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(2, heads_q, len_q, dim, generator=gen).to(device, dtype),
            torch.randn(2, heads_kv, len_k, dim, generator=gen).to(device, dtype),
            torch.randn(2, heads_kv, len_k, dim, generator=gen).to(device, dtype))


def test_cpu_route(monkeypatch):
    monkeypatch.delenv("FLASHATTN_EXT_KERNELS", raising=False)  # (.ci/run runs the tests again with =aten)
    q, k, v = qkv("cpu", torch.float32)
    assert flashattn_ext.kernel_route(q, k, v, is_causal=True)[0] == "cpu"
    assert flashattn_ext.kernel_route(q, k, v, backward=True)[0] == "cpu"
    monkeypatch.setenv("FLASHATTN_EXT_KERNELS", "aten")
    family, reason = flashattn_ext.kernel_route(q, k, v)
    assert family == "aten" and "FLASHATTN_EXT_KERNELS=aten" in reason


def test_route_checks_the_call_as_the_op_does():
    q, k, v = qkv("cpu", torch.float32)
    with pytest.raises(RuntimeError, match="key head dim 64 does not match query head dim 128"):
        flashattn_ext.kernel_route(q, k[..., :64], v)


def hopper():
    return torch.cuda.get_device_capability()[0] == 9


@cuda_test
def test_cuda_routes(monkeypatch):
    monkeypatch.delenv("FLASHATTN_EXT_KERNELS", raising=False)
    bf16 = torch.bfloat16
    route = flashattn_ext.kernel_route
    q, k, v = qkv("cuda", bf16)
    dense = "sm90" if hopper() else "sm80"
    assert route(q, k, v, is_causal=True)[0] == dense
    assert route(q, k, v, is_causal=True, backward=True)[0] == dense
    # Row 1: what no kernel takes.
    family, reason = route(*qkv("cuda", torch.float32))
    assert family == "aten" and "float16 and bfloat16" in reason
    family, reason = route(*qkv("cuda", bf16, dim=36))
    assert family == "aten" and "multiples of 8" in reason
    # Row 2: a decoding step's shape (4 query heads a key head, 1 token: 4 rows; 8 tokens: 32 rows), also
    # with a bool mask; not with an additive one or top-left causal alignment, nor with 9 tokens (36 rows).
    step = qkv("cuda", bf16, heads_q=16, len_q=1, len_k=3000)
    assert route(*step, enable_gqa=True)[0] == "decode"
    assert route(*step, enable_gqa=True, is_causal=True, causal_lower_right=True)[0] == "decode"
    assert route(*step, enable_gqa=True, is_causal=True)[0] == dense
    assert route(*step, enable_gqa=True, attn_mask=torch.ones(1, 3000, dtype=torch.bool, device="cuda"))[0] == "decode"
    assert route(*step, enable_gqa=True, attn_mask=torch.zeros(1, 3000, dtype=bf16, device="cuda"))[0] == dense
    assert route(*qkv("cuda", bf16, heads_q=16, len_q=8, len_k=3000), enable_gqa=True)[0] == "decode"
    assert route(*qkv("cuda", bf16, heads_q=16, len_q=9, len_k=3000), enable_gqa=True)[0] == dense
    # Row 3: deterministic mode.
    with deterministic_algorithms():
        family, reason = route(q, k, v, backward=True)
        assert family == dense and "deterministic" in reason
        family, reason = route(q, k, v, window=(64, 0), backward=True)
        assert family == "aten" and "sliding window" in reason
    # Values of another head dim: MLA's 192 / 128 on Hopper, forward (also in a decoding step's shape) and
    # backward (not in deterministic mode); else the ATen fallback.
    mla = (*qkv("cuda", bf16, dim=192)[:2], qkv("cuda", bf16)[2])
    assert route(*mla, is_causal=True)[0] == ("sm90" if hopper() else "aten")
    assert route(*(t[:, :, :1] if i == 0 else t for i, t in enumerate(mla)))[0] == ("sm90" if hopper() else "aten")
    assert route(*mla, is_causal=True, backward=True)[0] == ("sm90" if hopper() else "aten")
    with deterministic_algorithms():
        family, reason = route(*mla, is_causal=True, backward=True)
        assert family == "aten" and "value head dims" in reason
    family, reason = route(*mla, dropout_p=0.1, backward=True)
    assert family == "aten" and "value head dims" in reason
    assert route(*qkv("cuda", bf16, dim=64)[:2], qkv("cuda", bf16, dim=32)[2])[0] == "aten"
    # Rows 5 and 6 where the Hopper kernels are turned off.
    monkeypatch.setenv("FLASHATTN_EXT_KERNELS", "sm80")
    family, reason = route(q, k, v, softcap=30.0)
    assert family == "aten" and "softcap" in reason
    family, reason = route(q, k, v)
    assert family == "sm80" and "FLASHATTN_EXT_KERNELS=sm80" in reason
    monkeypatch.setenv("FLASHATTN_EXT_KERNELS", "dense")
    assert route(*step, enable_gqa=True)[0] == dense


@on_paths("sm90")
def test_hopper_backward_takes_what_its_forward_takes(path, monkeypatch):
    """No call whose forward runs the Hopper kernels falls back to sm80 for its backward (issue 44
    item 1): every head dim (the padded 80 and 96 included), dropout (at 256 too), a mask (up to 128,
    with dropout), a window, softcap, ALiBi."""
    monkeypatch.delenv("FLASHATTN_EXT_KERNELS", raising=False)
    route = flashattn_ext.kernel_route
    calls = 0
    for dim in (40, 64, 72, 80, 96, 104, 128, 192, 256):
        q, k, v = qkv("cuda", torch.bfloat16, dim=dim)
        mask = torch.rand(2, 1, 1, 256, device="cuda") > 0.2
        slopes = torch.rand(4, device="cuda")
        for options in ({}, {"dropout_p": 0.1}, {"is_causal": True}, {"attn_mask": mask},
                        {"attn_mask": mask, "dropout_p": 0.1}, {"window": (32, 0)}, {"softcap": 30.0},
                        {"alibi_slopes": slopes, "is_causal": True}):
            if route(q, k, v, **options)[0] != "sm90":
                continue
            calls += 1
            family, reason = route(q, k, v, backward=True, **options)
            assert family == "sm90", (dim, options, reason)
    assert calls >= 60  # (the forward takes nearly all: a mask only up to head dim 128)


# Which kernels the Hopper GPU's calls run, by their names in the profiler (path sm90).
@on_paths("sm90")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_hopper_kernels_run_by_default_and_can_be_turned_off(path, head_dim, monkeypatch):
    """On sm_90 the forward and the backward launch the sm90 kernels; FLASHATTN_EXT_KERNELS=sm80
    selects the mma.sync kernels, and both agree to rounding."""
    q, k, v = random_inputs((1, 4, 4, 512, 512, head_dim), torch.bfloat16, seed=2)
    q.requires_grad_()
    run = lambda: flashattn_ext.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    names = kernel_names(lambda: run().sum().backward())
    assert any("sm90" in n and "attention_forward_kernel" in n for n in names), names
    assert any("sm90" in n and "attention_backward" in n for n in names), names
    monkeypatch.setenv("FLASHATTN_EXT_KERNELS", "sm80")
    names_sm80 = kernel_names(lambda: run().sum().backward())
    assert not any("sm90" in n for n in names_sm80) and any("sm80" in n for n in names_sm80), names_sm80
    sm80_out = run().detach()
    monkeypatch.delenv("FLASHATTN_EXT_KERNELS")
    assert relative_error(run().detach(), sm80_out) < 1e-2


@on_paths("sm90")
@pytest.mark.parametrize(
    "case",
    ["mask_rows_unaligned", "mask_head_dim_256", "negative_scale", "stride_zero_batch"],
)
def test_calls_the_hopper_kernel_leaves_to_sm80(path, case):
    """What the Hopper forward does not cover still runs, on the mma.sync kernels, correctly."""
    q, k, v = random_inputs((2, 2, 2, 200, 300, 256 if case == "mask_head_dim_256" else 64), torch.bfloat16, seed=3)
    kwargs = {}
    if case == "mask_rows_unaligned":  # rows of 300 bools: not whole 16-byte pieces
        kwargs["attn_mask"] = torch.rand(200, 300, device="cuda") > 0.2
    if case == "mask_head_dim_256":  # rows of 304 bools: whole 16-byte pieces
        kwargs["attn_mask"] = torch.rand(200, 304, device="cuda") > 0.2
        k, v = torch.cat([k, k[:, :, :4]], dim=2), torch.cat([v, v[:, :, :4]], dim=2)
    if case == "negative_scale":
        kwargs["scale"] = -0.1
    if case == "stride_zero_batch":
        k = k[:1].expand(2, -1, -1, -1)
        v = v[:1].expand(2, -1, -1, -1)
    names = kernel_names(lambda: flashattn_ext.scaled_dot_product_attention(q, k, v, **kwargs))
    assert not any("sm90" in n for n in names), names
    out = flashattn_ext.scaled_dot_product_attention(q, k, v, **kwargs)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kwargs)
    assert relative_error(out, want) < 2e-2
