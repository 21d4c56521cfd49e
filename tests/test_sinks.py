"""Attention sinks (gpt-oss's learned per-head logit, `sinks=` of attention_with_lse): out, lse and the
gradients of q, k, v and the sinks against a float64 reference that appends the sink as one more
column of scores with a value of 0, with the options that shape the scores beside it."""
import pytest
import torch

import flashattn_ext
from helpers import cuda_test, kernel_names, on_paths, relative_error

TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def reference(q, k, v, sinks, attn_mask=None, is_causal=False, window=None, softcap=None, bottom_right=False):
    """(out, lse) in float64 with the sinks as an extra score column: q (B, Hq, L, E), k and v
    (B, Hkv, S, E) with Hkv dividing Hq; attn_mask bool (True takes part) or float, broadcasting to
    (B, Hq, L, S); is_causal and window aligned top-left (bottom_right: bottom-right)."""
    q, k, v, sinks = (t.double() for t in (q, k, v, sinks))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    rows, cols = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None, :]
    if bottom_right:
        rows = rows + k.shape[2] - q.shape[2]
    hidden = torch.zeros(q.shape[2], k.shape[2], dtype=torch.bool)
    if is_causal:
        hidden |= cols > rows
    if window is not None:
        hidden |= (cols < rows - window[0]) | (cols > rows + window[1])
    scores = scores.masked_fill(hidden.to(scores.device), float("-inf"))
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                  else scores + attn_mask.double())
    sink_column = sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    logits = torch.cat([scores, sink_column], dim=-1)
    probabilities = torch.softmax(logits, dim=-1)[..., :-1]
    return probabilities @ v, torch.logsumexp(logits, dim=-1)


CASES = {
    "plain": dict(),
    "causal_gqa": dict(is_causal=True, heads_kv=2),
    "bool_mask": dict(mask="bool"),
    "float_mask": dict(mask="float"),
    "window_softcap": dict(window=(5, 3), softcap=3.0),
}


def inputs(device, dtype, heads_kv=4, mask=None, seed=0, len_q=37, len_k=45):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, len_q, 32, generator=gen)
    k = torch.randn(2, heads_kv, len_k, 32, generator=gen)
    v = torch.randn(2, heads_kv, len_k, 32, generator=gen)
    # Sinks of the scores' size, and one far above them: that head's rows weigh their keys little.
    sinks = torch.tensor([0.5, -1.0, 2.0, 6.0])
    attn_mask = None
    if mask == "bool":
        attn_mask = torch.rand(2, 1, len_q, len_k, generator=gen) > 0.3
        attn_mask[0, 0, 3] = False  # a row that sees no key: out 0, lse the sink
    elif mask == "float":
        attn_mask = torch.randn(2, 4, len_q, len_k, generator=gen)
    tensors = [t.to(device, dtype) for t in (q, k, v, sinks)]  # (sinks in the model's dtype, as its parameter)
    if attn_mask is not None:
        attn_mask = attn_mask.to(device, dtype if attn_mask.is_floating_point() else torch.bool)
    return tensors, attn_mask


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@on_paths("cpu", "cuda")
def test_forward_and_gradients_match_float64(path, dtype, case):
    device = path.device
    options = dict(CASES[case])
    heads_kv, mask = options.pop("heads_kv", 4), options.pop("mask", None)
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("the CUDA kernels take 16-bit types (float64 runs the ATen fallback, tested on the CPU)")
    if device == "cuda" and dtype == torch.float32:
        dtype = torch.float16
    (q, k, v, sinks), attn_mask = inputs(device, dtype, heads_kv, mask)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
    out, lse = flashattn_ext.attention_with_lse(*leaves[:3], attn_mask=attn_mask, enable_gqa=heads_kv != 4,
                                                sinks=leaves[3], **options)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(device, dtype)
    out.backward(grad)

    reference_leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v, sinks)]
    want_out, want_lse = reference(*reference_leaves, attn_mask=None if attn_mask is None else attn_mask.cpu(),
                                   **options)
    want_out.backward(grad.cpu().double())
    assert relative_error(out.detach().cpu(), want_out.detach()) <= TOLERANCE[dtype]
    assert (lse.detach().cpu().double() - want_lse.detach()).abs().max().item() <= 1e-4
    for name, got, want in zip(("q", "k", "v", "sinks"), leaves, reference_leaves):
        assert relative_error(got.grad.cpu(), want.grad) <= 2 * TOLERANCE[dtype], name
    assert leaves[3].grad.dtype == sinks.dtype
    if mask == "bool":  # the row that sees no key
        assert torch.all(out[0, :, 3].detach() == 0)
        assert torch.allclose(lse[0, :, 3].detach().cpu().double(), sinks.cpu().double())


@on_paths("cuda", "sm80")
@pytest.mark.parametrize("case", ["causal", "one_key_rows_of_a_mask", "window_of_one_key", "head_dim_256"])
def test_cuda_kernels_take_the_backward_with_sinks(case, path):
    """The CUDA kernels run the backward with sinks (no ATen fallback), rows that see one key
    included: without sinks the kernels zero those rows' dS (exactly 0 there); with a sink it is not
    0. Against the float64 reference, with the sinks' own gradient."""
    if path.name == "sm80" and case in ("window_of_one_key", "head_dim_256"):
        pytest.skip("the sm80 kernels take no window; head dim 256 runs Hopper kernels alone here")
    dim = 256 if case == "head_dim_256" else 64
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, heads, length, dim, generator=gen).cuda().to(torch.bfloat16)
               for heads, length in ((4, 150), (2, 170), (2, 170)))
    sinks = torch.tensor([0.5, -1.0, 2.0, 4.0], device="cuda", dtype=torch.bfloat16)
    options = {"enable_gqa": True}
    if case in ("causal", "head_dim_256"):  # (top-left: row 0 sees key 0 alone)
        options["is_causal"] = True
    if case == "one_key_rows_of_a_mask":
        mask = torch.rand(2, 1, 150, 176, generator=gen) > 0.3  # (rows of 176: whole 16-byte pieces)
        mask[:, :, 5] = False
        mask[:, :, 5, 20] = True  # row 5 sees key 20 alone
        mask[1, :, 6] = False
        mask[1, :, 6, 0] = True  # row 6 of batch 1 sees key 0 alone
        options["attn_mask"] = mask.cuda()[..., :170]
    if case == "window_of_one_key":
        options["window"] = (0, 0)  # every row sees its diagonal key alone
    leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
    grad = torch.randn(2, 4, 150, dim, generator=gen).cuda().to(torch.bfloat16)

    def run():
        for t in leaves:
            t.grad = None
        out, _ = flashattn_ext.attention_with_lse(*leaves[:3], sinks=leaves[3], **options)
        out.backward(grad)

    names = kernel_names(run)
    assert any("attention_backward" in n or "attention_dkdv" in n for n in names), names
    assert not any("softmax" in n.lower() for n in names), names  # (the ATen fallback's)
    reference_leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v, sinks)]
    mask = options.get("attn_mask")
    want_out, _ = reference(*reference_leaves, attn_mask=None if mask is None else mask.cpu(),
                            is_causal=options.get("is_causal", False), window=options.get("window"))
    want_out.backward(grad.cpu().double())
    for name, got, want in zip(("q", "k", "v", "sinks"), leaves, reference_leaves):
        assert relative_error(got.grad.cpu(), want.grad) <= 2 * TOLERANCE[torch.bfloat16], name


def test_gradcheck_in_float64():
    (q, k, v, sinks), _ = inputs("cpu", torch.float64, heads_kv=2, len_q=5, len_k=7)
    leaves = [t.detach().requires_grad_() for t in (q[:1, :, :, :8], k[:1, :, :, :8], v[:1, :, :, :8], sinks)]
    assert torch.autograd.gradcheck(
        lambda q, k, v, s: flashattn_ext.attention_with_lse(q, k, v, is_causal=True, enable_gqa=True, sinks=s)[0],
        leaves)


@on_paths("cpu", "cuda")
def test_no_sink_is_plain_attention(path):
    """Sinks of -inf take no weight: the same out and lse as without sinks."""
    device = path.device
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    (q, k, v, _), _ = inputs(device, dtype)
    out, lse = flashattn_ext.attention_with_lse(q, k, v, is_causal=True,
                                                sinks=torch.full((4,), float("-inf"), device=device))
    want_out, want_lse = flashattn_ext.attention_with_lse(q, k, v, is_causal=True)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("sinks, message", [
    (torch.zeros(3), r"sinks must have shape \(4,\)"),
    (torch.zeros(1, 4), r"sinks must have shape \(4,\)"),
    (torch.zeros(4, dtype=torch.int64), "sinks must be a floating-point tensor"),
    (torch.zeros(4, device="meta"), "sinks is on meta"),
    ([0.0] * 4, "sinks must be a torch.Tensor"),
])
def test_bad_sinks_are_named(sinks, message):
    q = k = v = torch.randn(1, 4, 6, 8)
    with pytest.raises((RuntimeError, TypeError), match=message):
        flashattn_ext.attention_with_lse(q, k, v, sinks=sinks)


def test_double_backward_is_refused():
    (q, k, v, sinks), _ = inputs("cpu", torch.float64, len_q=5, len_k=7)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
    out, _ = flashattn_ext.attention_with_lse(*leaves[:3], sinks=leaves[3])
    with pytest.raises(NotImplementedError, match="double backward of attention with sinks"):
        torch.autograd.grad(out.sum(), leaves, create_graph=True)


@on_paths("cpu", "cuda")
def test_opcheck_with_sinks(path):
    """The ops' schemas, fake kernels and autograd registration agree with sinks given."""
    device = path.device
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    (q, k, v, sinks), _ = inputs(device, dtype, heads_kv=2, len_q=9, len_k=11)
    sinks = sinks.detach().requires_grad_()
    args = (q.requires_grad_(), k, v, None, 0.0, True, False, 0.3)
    torch.library.opcheck(torch.ops.flashattn_ext.attention_forward.default, args, {"sinks": sinks})
    out, lse, rng_state = torch.ops.flashattn_ext.attention_forward(*args, sinks=sinks)
    torch.library.opcheck(
        torch.ops.flashattn_ext.attention_backward.default,
        (torch.randn_like(out), q.detach(), k, v, out.detach(), lse, rng_state, None, 0.0, True, False, 0.3, False),
        {"sinks": sinks.detach()},
    )
    grad_out, out = torch.randn_like(out), out.detach()  # (sinks_backward is a backward's helper: no autograd)
    torch.library.opcheck(torch.ops.flashattn_ext.sinks_backward.default, (grad_out, out, lse, sinks.detach()))
    # The kernels' delta pass (CUDA) and the ATen form agree.
    want = -(torch.exp(sinks.detach().to(lse.dtype).view(1, -1, 1) - lse)
             * (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)).sum((0, 2))
    got = torch.ops.flashattn_ext.sinks_backward(grad_out, out, lse, sinks.detach())
    assert got.dtype == sinks.dtype
    assert relative_error(got.double(), want.double()) < (1e-12 if dtype == torch.float64 else 1e-2)


@pytest.mark.parametrize("block_size", [None, 16], ids=["contiguous", "paged16"])
@on_paths("cpu", "cuda")
def test_decode_attention_with_sinks(path, block_size):
    """decode_attention's sinks: 3 new tokens a sequence (causal, bottom-right) against caches of
    different lengths, one empty (out 0, lse the sink), against the float64 reference."""
    device = path.device
    from test_decode import make_cache, sequence_rows
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    gen = torch.Generator().manual_seed(4)
    key_cache, value_cache, table = make_cache(3, 2, 64, 32, 32, dtype, block_size, gen)
    lengths = [64, 0, 29]
    query = torch.randn(3, 8, 3, 32, generator=gen).to(dtype)
    sinks = torch.randn(8, generator=gen).to(dtype)
    on = lambda t: None if t is None else t.to(device)  # noqa: E731
    out, lse = flashattn_ext.decode_attention(on(query), on(key_cache), on(value_cache), on(torch.tensor(lengths)),
                                              block_table=on(table), is_causal=True, sinks=on(sinks),
                                              return_lse=True)
    for b, length in enumerate(lengths):
        k, v = (sequence_rows(cache, b, length, table)[None] for cache in (key_cache, value_cache))
        want_out, want_lse = reference(query[b : b + 1], k, v, sinks, is_causal=True, bottom_right=True)
        assert relative_error(out[b : b + 1].cpu(), want_out, zero_scale=1.0) <= TOLERANCE[dtype]
        assert (lse[b : b + 1].cpu().double() - want_lse).abs().max().item() <= 1e-4


@cuda_test
def test_decode_rows_poisoned_for_a_bad_length_stay_nan_with_sinks():
    """On CUDA a sequence whose cache_seqlens is past the capacity gets NaN out and lse (decode_attention's
    signal for bad inputs); merging the sinks keeps both NaN, and the other sequences' answers right."""
    from test_decode import make_cache, sequence_rows
    gen = torch.Generator().manual_seed(5)
    key_cache, value_cache, _ = make_cache(3, 2, 64, 32, 32, torch.bfloat16, None, gen)
    query = torch.randn(3, 8, 1, 32, generator=gen).to(torch.bfloat16)
    sinks = torch.randn(8, generator=gen).to(torch.bfloat16)
    lengths = [64, 65, 29]  # sequence 1: one past the capacity
    out, lse = flashattn_ext.decode_attention(query.cuda(), key_cache.cuda(), value_cache.cuda(),
                                              torch.tensor(lengths).cuda(), sinks=sinks.cuda(), return_lse=True)
    assert out[1].isnan().all() and lse[1].isnan().all()
    for b in (0, 2):
        k, v = (sequence_rows(cache, b, lengths[b], None)[None] for cache in (key_cache, value_cache))
        want_out, want_lse = reference(query[b : b + 1], k, v, sinks)
        assert relative_error(out[b : b + 1].cpu(), want_out, zero_scale=1.0) <= TOLERANCE[torch.bfloat16]
        assert (lse[b : b + 1].cpu().double() - want_lse).abs().max().item() <= 1e-4
