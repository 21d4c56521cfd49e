"""The registered ops themselves: gradcheck, opcheck, autograd wiring and argument errors."""
import subprocess
import sys

import pytest
import torch

from torch.nn.attention.bias import causal_lower_right

import flashattn_ext
from helpers import CUDA_REASON, on_paths, random_qkv, seq_major_qkv

ops = torch.ops.flashattn_ext


def forward_args(q, k, v, is_causal=False, lower_right=False, scale=0.5):
    return (q, k, v, None, 0.0, is_causal, lower_right, scale)


@on_paths("cpu", "cuda")
@pytest.mark.parametrize(
    "mode,heads_kv,len_q,len_k",
    [
        ("full", 2, 5, 9),
        ("causal", 2, 9, 5),
        ("causal_lower_right", 1, 9, 5),  # GQA, and rows that see no key
        ("causal_lower_right", 2, 5, 9),
    ],
)
def test_gradcheck(mode, heads_kv, len_q, len_k, path):
    q, k, v = random_qkv((2, 2, len_q, 6), (2, heads_kv, len_k, 6), (2, heads_kv, len_k, 7), torch.float64, path.device)
    is_causal, lower_right = mode != "full", mode == "causal_lower_right"

    def out_of_op(q, k, v):
        return ops.attention_forward(*forward_args(q, k, v, is_causal, lower_right))[0]

    assert torch.autograd.gradcheck(out_of_op, (q, k, v))


@on_paths("cpu", "cuda")
def test_gradcheck_through_a_float_mask(path):
    device = path.device
    q, k, v = random_qkv((1, 2, 5, 6), (1, 2, 7, 6), (1, 2, 7, 6), torch.float64, device)
    mask = torch.randn(1, 1, 5, 7, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, mask: flashattn_ext.scaled_dot_product_attention(q, k, v, attn_mask=mask), (q, k, v, mask)
    )


@on_paths("cpu", "cuda")
def test_opcheck_with_masks(path):
    device = path.device
    q, k, v = random_qkv((2, 4, 33, 16), (2, 2, 17, 16), (2, 2, 17, 16), torch.float64, device)
    bool_mask = (torch.rand(33, 17, device=device) > 0.2).expand(2, 4, 33, 17)
    float_mask = torch.randn(2, 1, 33, 17, dtype=torch.float64, device=device).expand(2, 4, 33, 17)
    for mask in (bool_mask, float_mask):
        args = (q, k, v, mask, 0.0, False, False, 0.5)
        torch.library.opcheck(ops.attention_forward.default, args)
    q, k, v = (t.detach() for t in (q, k, v))
    out, lse, rng_state = ops.attention_forward(q, k, v, float_mask, 0.0, False, False, 0.5)
    torch.library.opcheck(
        ops.attention_backward.default,
        (torch.randn_like(out), q, k, v, out, lse, rng_state, float_mask, 0.0, False, False, 0.5, True),
    )


@on_paths("cpu", "cuda")
def test_gradcheck_shim_with_views(path):
    q, k, v = seq_major_qkv(1, 11, 2, 8, path.device, seed=3)
    assert torch.autograd.gradcheck(
        lambda q, k, v: flashattn_ext.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v)
    )


@on_paths("cpu", "cuda")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck_forward(dtype, path):
    q, k, v = random_qkv((2, 4, 33, 16), (2, 2, 17, 16), (2, 2, 17, 16), dtype, path.device)
    torch.library.opcheck(ops.attention_forward.default, forward_args(q, k, v, is_causal=True))


@on_paths("cpu", "cuda")
def test_opcheck_backward(path):
    device = path.device
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = random_qkv((2, 4, 33, 16), (2, 2, 17, 16), (2, 2, 17, 16), dtype, device)
    q, k, v = (t.detach() for t in (q, k, v))
    out, lse, rng_state = ops.attention_forward(*forward_args(q, k, v))
    grad_out = torch.randn_like(out)
    torch.library.opcheck(
        ops.attention_backward.default, (grad_out, q, k, v, out, lse, rng_state, None, 0.0, False, False, 0.5, False)
    )


@on_paths("cpu", "cuda")
def test_opcheck_and_gradcheck_with_alibi(path):
    """ALiBi's slopes as an (Hq,) vector expanded to (batch, Hq): read in place through stride 0."""
    device = path.device
    q, k, v = random_qkv((2, 4, 33, 16), (2, 2, 17, 16), (2, 2, 17, 16), torch.float64, device)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device=device).expand(2, 4)
    args = (q, k, v, None, 0.0, True, True, 0.5, -1, -1, 0.0, slopes)
    torch.library.opcheck(ops.attention_forward.default, args)
    assert torch.autograd.gradcheck(lambda q, k, v: ops.attention_forward(q, k, v, *args[3:])[0], (q, k, v))
    q, k, v = (t.detach() for t in (q, k, v))
    out, lse, rng_state = ops.attention_forward(q, k, v, *args[3:])
    torch.library.opcheck(
        ops.attention_backward.default,
        (torch.randn_like(out), q, k, v, out, lse, rng_state, None, 0.0, True, True, 0.5, False, -1, -1, 0.0, slopes),
    )


@on_paths("cpu", "cuda")
def test_opcheck_and_gradcheck_varlen(path):
    """The packed-batch ops: an empty sequence, GQA, causal bottom-right, int64 bounds."""
    device = path.device
    q = torch.randn(12, 4, 8, dtype=torch.float64, device=device, requires_grad=True)
    k, v = (torch.randn(15, 2, 8, dtype=torch.float64, device=device, requires_grad=True) for _ in range(2))
    cu_q, cu_k = torch.tensor([0, 5, 5, 12], device=device), torch.tensor([0, 9, 11, 15], device=device)
    args = (cu_q, cu_k, 7, 9, True, True, 0.5)
    torch.library.opcheck(ops.varlen_forward.default, (q, k, v, *args))
    assert torch.autograd.gradcheck(lambda q, k, v: ops.varlen_forward(q, k, v, *args)[0], (q, k, v))
    q, k, v = (t.detach() for t in (q, k, v))
    out, lse = ops.varlen_forward(q, k, v, *args)
    torch.library.opcheck(ops.varlen_backward.default, (torch.randn_like(out), q, k, v, out, lse, *args))


@on_paths("cpu", "cuda")
def test_opcheck_with_dropout(path):
    device = path.device
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    q, k, v = random_qkv((2, 4, 33, 16), (2, 2, 17, 16), (2, 2, 17, 16), dtype, device)
    torch.library.opcheck(ops.attention_forward.default, (q, k, v, None, 0.3, True, False, 0.5))
    q, k, v = (t.detach() for t in (q, k, v))
    out, lse, rng_state = ops.attention_forward(q, k, v, None, 0.3, True, False, 0.5)
    assert rng_state.shape == (3,) and rng_state.dtype == torch.int64 and rng_state.device == q.device
    torch.library.opcheck(
        ops.attention_backward.default,
        (torch.randn_like(out), q, k, v, out, lse, rng_state, None, 0.3, True, False, 0.5, False),
    )
    torch.library.opcheck(ops.dropout_mask.default, (rng_state, 0.3, 2, 4, 33, 17, 5, 20))


@on_paths("cpu", "cuda")
def test_lse_is_not_differentiable_and_only_needed_grads_flow(path):
    q, k, v = random_qkv((1, 2, 8, 4), (1, 2, 8, 4), (1, 2, 8, 4), torch.float64, path.device)
    v.requires_grad_(False)
    out, lse = flashattn_ext.attention_with_lse(q, k, v)
    assert out.requires_grad and not lse.requires_grad
    out.sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is None


@on_paths("cpu", "cuda")
@pytest.mark.parametrize("case", ["causal_gqa", "lower_right", "float_mask", "bool_mask", "dropout"])
def test_gradgradcheck(case, path):
    """Second derivatives (gradgradcheck, float64) through every kind of call, including a float
    mask's and dropout's (the same mask on every call: the seed is fixed inside)."""
    device = path.device
    q, k, v = random_qkv((1, 4, 6, 5), (1, 2, 7, 5), (1, 2, 7, 3), torch.float64, device)
    mask = None
    if case == "float_mask":
        mask = torch.randn(6, 7, dtype=torch.float64, device=device, requires_grad=True)
    elif case == "bool_mask":
        mask = torch.rand(1, 1, 6, 7, device=device) > 0.3
        mask[..., 0] = True

    def attention(q, k, v, *maybe_mask):
        torch.manual_seed(0)
        out, _ = flashattn_ext.attention_with_lse(
            q, k, v, attn_mask=maybe_mask[0] if maybe_mask else mask, dropout_p=0.4 if case == "dropout" else 0.0,
            is_causal=case in ("causal_gqa", "lower_right"), causal_lower_right=case == "lower_right",
            enable_gqa=True,
        )
        return out

    inputs = (q, k, v, mask) if case == "float_mask" else (q, k, v)
    assert torch.autograd.gradgradcheck(attention, inputs)


def _qkv(shape_q=(1, 2, 8, 4), shape_k=(1, 2, 8, 4), shape_v=(1, 2, 8, 4), dtype=torch.float32):
    return tuple(torch.randn(shape, dtype=dtype) for shape in (shape_q, shape_k, shape_v))


BAD_SHIM_CALLS = [
    # (name, call, exception, message)
    ("rank", lambda: flashattn_ext.scaled_dot_product_attention(*_qkv((8,), (8,), (8,))), RuntimeError,
     "query must have at least 2 dimensions"),
    ("not a tensor", lambda: flashattn_ext.scaled_dot_product_attention([[1.0]], *_qkv()[1:]), TypeError,
     "query must be a torch.Tensor"),
    ("dtype mismatch", lambda: flashattn_ext.scaled_dot_product_attention(*_qkv()[:2], _qkv()[2].double()),
     RuntimeError, "same dtype"),
    ("integer dtype", lambda: flashattn_ext.scaled_dot_product_attention(*(t.long() for t in _qkv())), TypeError,
     "query must be float16, bfloat16, float32 or float64"),
    ("device mismatch", lambda: flashattn_ext.scaled_dot_product_attention(*_qkv()[:2], _qkv()[2].to("meta")),
     RuntimeError, "same device"),
    ("head dim", lambda: flashattn_ext.scaled_dot_product_attention(*_qkv((1, 2, 8, 4), (1, 2, 8, 5))),
     RuntimeError, "key head dim 5 does not match query head dim 4"),
    ("key/value length", lambda: flashattn_ext.scaled_dot_product_attention(*_qkv((1, 2, 8, 4), (1, 2, 8, 4), (1, 2, 9, 4))),
     RuntimeError, "key has sequence length 8 but value has 9"),
    ("heads without gqa", lambda: flashattn_ext.scaled_dot_product_attention(*_qkv((1, 4, 8, 4), (1, 2, 8, 4), (1, 2, 8, 4))),
     RuntimeError, "heads of query, key and value do not broadcast"),
    ("gqa heads", lambda: flashattn_ext.scaled_dot_product_attention(*_qkv((1, 4, 8, 4), (1, 3, 8, 4), (1, 3, 8, 4)), enable_gqa=True),
     RuntimeError, "enable_gqa"),
    ("batch", lambda: flashattn_ext.scaled_dot_product_attention(*_qkv((2, 2, 8, 4), (3, 2, 8, 4), (3, 2, 8, 4))),
     RuntimeError, "batch dimensions of query, key and value do not broadcast"),
    ("mask with causal", lambda: flashattn_ext.scaled_dot_product_attention(*_qkv(), attn_mask=torch.ones(8, 8, dtype=torch.bool), is_causal=True),
     RuntimeError, "attn_mask must be None when is_causal=True"),
    ("mask dtype", lambda: flashattn_ext.scaled_dot_product_attention(*_qkv(), attn_mask=torch.ones(8, 8, dtype=torch.int32)),
     TypeError, "attn_mask must be bool or have query's dtype Float, got Int"),
    ("mask shape", lambda: flashattn_ext.scaled_dot_product_attention(*_qkv(), attn_mask=torch.ones(8, 7, dtype=torch.bool)),
     RuntimeError, r"attn_mask of shape \(8, 7\) does not broadcast to \(1, 2, 8, 8\)"),
    ("mask type", lambda: flashattn_ext.scaled_dot_product_attention(*_qkv(), attn_mask=[[True]]),
     TypeError, "attn_mask must be a torch.Tensor or None"),
    ("causal bias size", lambda: flashattn_ext.scaled_dot_product_attention(*_qkv(), attn_mask=causal_lower_right(8, 9)),
     RuntimeError, "CausalBias for 8 queries and 9 keys, but there are 8 and 8"),
    ("dropout range", lambda: flashattn_ext.scaled_dot_product_attention(*_qkv(), dropout_p=1.5), ValueError,
     r"dropout_p must be in \[0, 1\]"),
    ("scale", lambda: flashattn_ext.scaled_dot_product_attention(*_qkv(), scale=float("nan")), ValueError,
     "scale must not be NaN"),
]


@pytest.mark.parametrize("call,exception,message", [case[1:] for case in BAD_SHIM_CALLS], ids=[c[0] for c in BAD_SHIM_CALLS])
def test_bad_arguments_to_the_shim(call, exception, message):
    with pytest.raises(exception, match=message):
        call()


def test_bad_arguments_to_the_ops():
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match=r"query must be 4-d \(batch, heads, seq_len, head_dim\), got 3-d"):
        ops.attention_forward(*forward_args(q[0], k, v))
    with pytest.raises(RuntimeError, match="the 3 key/value heads must divide the 2 query heads"):
        ops.attention_forward(*forward_args(q, *_qkv((1, 3, 8, 4), (1, 3, 8, 4), (1, 3, 8, 4))[1:]))
    with pytest.raises(RuntimeError, match="batch sizes differ"):
        ops.attention_forward(*forward_args(q, k.expand(2, 2, 8, 4), v.expand(2, 2, 8, 4)))
    out, lse, rng_state = ops.attention_forward(*forward_args(q, k, v))
    backward_options = (None, 0.0, False, False, 0.5, False)
    with pytest.raises(RuntimeError, match=r"lse must have shape \[1, 2, 8\]"):
        ops.attention_backward(out, q, k, v, out, lse[:, :, :4], rng_state, *backward_options)
    with pytest.raises(TypeError, match="grad_out must have dtype Float"):
        ops.attention_backward(out.double(), q, k, v, out, lse, rng_state, *backward_options)
    with pytest.raises(RuntimeError, match="compute_grad_attn_mask needs a float attn_mask"):
        ops.attention_backward(out, q, k, v, out, lse, rng_state, *backward_options[:-1], True)
    with pytest.raises(RuntimeError, match="rng_state must be the forward's: 3 int64 values for dropout_p 0.5"):
        ops.attention_backward(out, q, k, v, out, lse, rng_state, None, 0.5, *backward_options[2:])
    rng_state = torch.tensor([0, 0, 8])  # {seed, offset, bits}
    with pytest.raises(ValueError, match=r"dropout_mask rows \[0, 9\) are not within \[0, len_q = 8\]"):
        ops.dropout_mask(rng_state, 0.5, 1, 2, 8, 8, 0, 9)
    with pytest.raises(ValueError, match=r"dropout_mask needs dropout_p in \(0, 1\], got 0"):
        ops.dropout_mask(rng_state, 0.0, 1, 2, 8, 8, 0, 8)
    with pytest.raises(RuntimeError, match="rng_state must be the forward's: its bits are 12, not 8 or 16"):
        ops.dropout_mask(torch.tensor([0, 0, 12]), 0.5, 1, 2, 8, 8, 0, 8)
    with pytest.raises(RuntimeError, match=r"attn_mask must have shape \[1, 2, 8, 8\]"):
        ops.attention_forward(q, k, v, torch.ones(1, 2, 8, 7, dtype=torch.bool), *forward_args(q, k, v)[4:])



@on_paths("cpu", "cuda")
def test_compiles_without_graph_breaks(path):
    """The shim traces into one graph (fullgraph=True), forward and backward, and matches eager."""
    device = path.device
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = random_qkv((2, 4, 40, 16), (2, 2, 40, 16), (2, 2, 40, 16), dtype, device)

    def attention(q, k, v):
        return flashattn_ext.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    compiled = torch.compile(attention, fullgraph=True, dynamic=True, backend="aot_eager")
    out = compiled(q, k, v)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    want = attention(q, k, v)
    want_grads = torch.autograd.grad(want.sum(), (q, k, v))
    torch.testing.assert_close(out, want)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected)


@on_paths("cpu", "cuda")
def test_compiles_with_dropout_without_graph_breaks(path):
    """Dropout inside a compiled graph draws from torch's generator as eager does: the same seed
    gives eager's values and gradients, another seed another mask."""
    device = path.device
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = random_qkv((2, 4, 40, 16), (2, 4, 40, 16), (2, 4, 40, 16), dtype, device)

    def attention(q, k, v):
        return flashattn_ext.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)

    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")
    results = {}
    for name, fn, seed in (("compiled", compiled, 1), ("eager", attention, 1), ("other seed", compiled, 2)):
        torch.manual_seed(seed)
        out = fn(q, k, v)
        results[name] = (out, *torch.autograd.grad(out.sum(), (q, k, v)))
    for got, expected in zip(results["compiled"], results["eager"]):
        torch.testing.assert_close(got, expected)
    assert not torch.equal(results["compiled"][0], results["other seed"][0])


@on_paths("cpu", "cuda")
def test_compiles_with_masks_without_graph_breaks(path):
    """A float mask that requires grad, and a CausalBias object, trace into one graph too."""
    device = path.device
    q, k, v = random_qkv((2, 4, 40, 16), (2, 4, 40, 16), (2, 4, 40, 16), torch.float32, device)
    mask = torch.randn(40, 40, device=device, requires_grad=True)
    causal = causal_lower_right(40, 40)  # dynamo cannot construct a CausalBias inside the graph

    def attention(q, k, v, mask):
        masked = flashattn_ext.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return masked + flashattn_ext.scaled_dot_product_attention(q, k, v, attn_mask=causal)

    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v, mask)
    grads = torch.autograd.grad(out.sum(), (q, k, v, mask))
    want = attention(q, k, v, mask)
    want_grads = torch.autograd.grad(want.sum(), (q, k, v, mask))
    torch.testing.assert_close(out, want)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_REASON)
def test_error_messages_with_numbers_on_cuda():
    """Errors raised from the library on CUDA tensors, with numbers in their messages, arrive as exceptions.
    A build that linked its own static copy of the C++ runtime crashed formatting those numbers (a
    toolchain whose lib dir held only libstdc++.a); run in a subprocess, so that a crash fails this test."""
    script = """
import torch, flashattn_ext
ops = torch.ops.flashattn_ext
q = torch.randn(1, 2, 8, 4, device="cuda", dtype=torch.float16)
for k, message in ((torch.randn(1, 3, 8, 4, device="cuda", dtype=torch.float16), "the 3 key/value heads must divide the 2 query heads"),
                   (torch.randn(1, 2, 8, 5, device="cuda", dtype=torch.float16), "key head dim 5 does not match query head dim 4")):
    try:
        ops.attention_forward(q, k, k, None, 0.0, False, False, 0.5)
    except (RuntimeError, NotImplementedError) as e:
        assert message in str(e), str(e)
    else:
        raise AssertionError("no error")
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", (result.returncode, result.stderr[-2000:])
