"""Dense calls with a decoding step's shape (a key/value head's query rows fit two 16-row tiles) run the
decode kernels on CUDA: results and gradients against the float64 reference, with the options the route
takes (GQA, bottom-right causal, windows, softcap, ALiBi, a bool mask alone) and those it leaves to the
dense kernels."""
import math

import pytest
import torch

import flashattn_ext
from helpers import cuda_test, naive_attention, relative_error

TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def decode_kernels_ran(fn):
    """Whether fn's CUDA kernels include a decode kernel (by name)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        fn()
        torch.cuda.synchronize()
    return any("decode" in event.name for event in profile.events())


# (batch, query heads, key heads, query tokens, keys, head dim)
SHAPES = [(3, 32, 8, 1, 1000, 128), (2, 8, 2, 4, 700, 64), (2, 4, 4, 1, 300, 256), (1, 2, 2, 8, 2048, 128),
          (2, 16, 1, 1, 129, 64), (2, 4, 2, 2, 5, 80), (1, 32, 8, 8, 3000, 128), (2, 12, 2, 5, 900, 64)]
OPTIONS = [dict(), dict(is_causal=True, causal_lower_right=True), dict(window=(100, 0), causal_lower_right=True),
           dict(softcap=30.0), dict(alibi=True, causal_lower_right=True)]


@cuda_test
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(o) or "plain")
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_decode_shaped_calls_match_float64(dtype, shape, options):
    batch, heads_q, heads_kv, tokens, keys, dim = shape
    gen = torch.Generator().manual_seed(sum(shape))
    # (Inputs rounded to dtype: the reference sees what the kernels see.)
    q = torch.randn(batch, heads_q, tokens, dim, generator=gen, dtype=torch.float64).to(dtype).double()
    k, v = (torch.randn(batch, heads_kv, keys, dim, generator=gen, dtype=torch.float64).to(dtype).double()
            for _ in range(2))
    grad = torch.randn(batch, heads_q, tokens, dim, generator=gen, dtype=torch.float64).to(dtype).double()
    options = dict(options)
    if options.pop("alibi", False):
        options["alibi_slopes"] = torch.rand(heads_q, generator=gen) * 0.1
    inputs = [t.to("cuda", dtype).requires_grad_() for t in (q, k, v)]
    cuda_options = {name: value.cuda() if isinstance(value, torch.Tensor) else value for name, value in options.items()}
    options_on_cuda = dict(enable_gqa=heads_q != heads_kv, **cuda_options)
    call = lambda: flashattn_ext.attention_with_lse(*inputs, **options_on_cuda)  # noqa: E731
    out, lse = call()
    out.backward(grad.to("cuda", dtype))
    reference = [t.clone().requires_grad_() for t in (q, k, v)]
    want_out, want_lse = naive_attention(*reference, enable_gqa=heads_q != heads_kv, **options)
    want_out.backward(grad)
    assert relative_error(out.detach().cpu(), want_out.detach()) <= TOLERANCE[dtype]
    assert (lse.cpu().double() - want_lse.detach()).abs().max().item() <= 1e-3
    for got, want in zip(inputs, reference):
        assert relative_error(got.grad.cpu(), want.grad) <= 2 * TOLERANCE[dtype]
    assert flashattn_ext.kernel_route(*inputs, **options_on_cuda)[0] == "decode"
    with torch.no_grad():
        assert decode_kernels_ran(call)


def assert_matches_reference(out, lse, want_out, want_lse, dtype):
    """out within dtype's tolerance of the float64 reference; lse -inf exactly where the reference's is
    (rows that see no key, whose out is 0) and within 1e-3 elsewhere."""
    assert relative_error(out.detach().cpu(), want_out.detach().cpu()) <= TOLERANCE[dtype]
    lse, want_lse = lse.detach().cpu().double(), want_lse.detach().cpu()
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    finite = torch.isfinite(want_lse)
    if finite.any():
        assert (lse[finite] - want_lse[finite]).abs().max().item() <= 1e-3


def bool_mask(kind, batch, heads_q, tokens, keys, gen):
    """A bool attn_mask of a decoding step: "static_cache" (transformers' static cache: each sequence's
    first keys, (B, 1, L, S) with every row materialized, causal among the new tokens; in a batch, one
    sequence with no key at all), "left_padded" ((B, 1, 1, S), keys hidden at the front and at
    random), "per_head" ((B, Hq, L, S) at random, some rows seeing no key) or "shared" ((1, 1, 1, S), a
    random tail hidden)."""
    if kind == "static_cache":
        lengths = torch.randint(tokens, keys // 2, (batch,), generator=gen)
        if batch > 1:
            lengths[-1] = 0
        rows = torch.arange(tokens)[:, None] + (lengths[:, None, None] - tokens)  # (B, L, 1): a query's position
        mask = torch.arange(keys)[None, None, :] <= rows
        return mask[:, None].contiguous()
    if kind == "left_padded":
        mask = torch.rand(batch, 1, 1, keys, generator=gen) > 0.2
        mask[:, :, :, : keys // 3] = False
        return mask
    if kind == "per_head":
        mask = torch.rand(batch, heads_q, tokens, keys, generator=gen) > 0.5
        mask[0, 0, -1] = False
        return mask
    mask = torch.ones(1, 1, 1, keys, dtype=torch.bool)
    mask[..., keys // 2 + 1:] = torch.rand(keys - keys // 2 - 1, generator=gen) > 0.9
    return mask


@cuda_test
@pytest.mark.parametrize("mask_kind", ["static_cache", "left_padded", "per_head", "shared"])
@pytest.mark.parametrize("shape", SHAPES[:4] + SHAPES[6:], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_masked_decode_shaped_calls_match_float64(dtype, shape, mask_kind):
    """A bool mask alone (a decoding step with a static cache or a padded batch) takes the decode kernels,
    which read no key past the last one the mask shows a sequence: out and lse against float64, and the
    gradients (the dense backward) too."""
    batch, heads_q, heads_kv, tokens, keys, dim = shape
    gen = torch.Generator().manual_seed(sum(shape) + len(mask_kind))
    q = torch.randn(batch, heads_q, tokens, dim, generator=gen, dtype=torch.float64).to(dtype).double()
    k, v = (torch.randn(batch, heads_kv, keys, dim, generator=gen, dtype=torch.float64).to(dtype).double()
            for _ in range(2))
    grad = torch.randn(batch, heads_q, tokens, dim, generator=gen, dtype=torch.float64).to(dtype).double()
    mask = bool_mask(mask_kind, batch, heads_q, tokens, keys, gen)
    inputs = [t.to("cuda", dtype).requires_grad_() for t in (q, k, v)]
    call = lambda: flashattn_ext.attention_with_lse(*inputs, attn_mask=mask.cuda(),  # noqa: E731
                                                    enable_gqa=heads_q != heads_kv)
    out, lse = call()
    out.backward(grad.to("cuda", dtype))
    reference = [t.clone().requires_grad_() for t in (q, k, v)]
    want_out, want_lse = naive_attention(*reference, attn_mask=mask, enable_gqa=heads_q != heads_kv)
    want_out.backward(grad)
    assert_matches_reference(out, lse, want_out, want_lse, dtype)
    for got, want in zip(inputs, reference):
        assert relative_error(got.grad.cpu(), want.grad) <= 2 * TOLERANCE[dtype]
    assert flashattn_ext.kernel_route(*inputs, attn_mask=mask.cuda(), enable_gqa=heads_q != heads_kv)[0] == "decode"
    with torch.no_grad():
        assert decode_kernels_ran(call)


@cuda_test
def test_masked_decode_reads_the_mask_in_place():
    """A static cache's mask, as transformers builds it ((B, 1, 1, S) expanded from a (B, S) one), a mask
    that hides every key, and one of a single key."""
    q = torch.randn(3, 8, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(3, 2, 5000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lengths = torch.tensor([1, 4097, 0], device="cuda")
    for mask in ((torch.arange(5000, device="cuda") < lengths[:, None])[:, None, None].expand(3, 1, 1, 5000),
                 torch.zeros(1, 1, 1, 5000, dtype=torch.bool, device="cuda")):
        out, lse = flashattn_ext.attention_with_lse(q, k, v, attn_mask=mask, enable_gqa=True)
        want_out, want_lse = naive_attention(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)
        assert_matches_reference(out, lse, want_out, want_lse, torch.bfloat16)


@cuda_test
def test_route_leaves_what_the_decode_kernels_lack():
    """An additive mask, a bool one beside a window or with strided columns, dropout, top-left causal
    alignment with fewer queries than keys, more than 32 query rows a key head, and
    FLASHATTN_EXT_KERNELS=dense keep the dense kernels."""
    q = torch.randn(2, 8, 2, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 300, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    assert decode_kernels_ran(lambda: flashattn_ext.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    mask = torch.rand(2, 1, 2, 300, device="cuda") > 0.3
    assert decode_kernels_ran(lambda: flashattn_ext.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                                 enable_gqa=True))
    additive = torch.zeros(2, 1, 2, 300, device="cuda", dtype=torch.bfloat16).masked_fill(~mask, -math.inf)
    strided = (torch.rand(2, 1, 2, 600, device="cuda") > 0.3)[..., ::2]
    for call in (lambda: flashattn_ext.scaled_dot_product_attention(q, k, v, attn_mask=additive, enable_gqa=True),
                 lambda: flashattn_ext.scaled_dot_product_attention(q, k, v, attn_mask=strided, enable_gqa=True),
                 lambda: flashattn_ext.attention_with_lse(q, k, v, attn_mask=mask, window=(50, 50), enable_gqa=True),
                 lambda: flashattn_ext.scaled_dot_product_attention(q, k, v, dropout_p=0.2, enable_gqa=True),
                 lambda: flashattn_ext.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                 lambda: flashattn_ext.scaled_dot_product_attention(q.repeat(1, 1, 5, 1), k, v, enable_gqa=True)):
        assert not decode_kernels_ran(call)


@cuda_test
def test_dense_kernels_on_request(monkeypatch):
    q = torch.randn(2, 8, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 3000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    call = lambda: flashattn_ext.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    routed = call()
    monkeypatch.setenv("FLASHATTN_EXT_KERNELS", "dense")
    assert not decode_kernels_ran(call)
    assert (call().float() - routed.float()).abs().max().item() < 2e-2
