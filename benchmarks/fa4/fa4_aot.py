"""FlashAttention-4's SM90 kernels (flash-attn-4 4.0.0b36, CuTe DSL), compiled ahead of time, for the benchmarks.

The GPU machines have no network and no compiler, and FA4 compiles its kernels at the first call
through nvidia-cutlass-dsl (a 181 MB MLIR library). pack.sh compiles them on a CPU host instead
(export.py) and links each into one .so; this module loads them with apache-tvm-ffi and needs
nothing else but torch and the CUDA runtime torch already loads.

It replays FA4's own dense (not varlen) call sequence from flash_attn/cute/interface.py:
    forward:  flash_fwd_sm90
    backward: preprocess -> flash_bwd_sm90 -> postprocess dQ (and dK, dV for GQA)
Batch, sequence lengths and head counts are free. The dtype (bfloat16 or float16), head dim, causal
and query heads per key/value head pick the kernels: manifest.json keys d{D}_c{causal}_g{Hq/Hkv},
with "_fp16" appended for float16. The kernels are read from $FA4_AOT_KERNELS, else from
pkg/kernels next to this file (where pack.sh puts them).
"""
import json
import math
import os

import torch
import tvm_ffi

DEFAULT_KERNEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pkg", "kernels")
# torch dtype -> suffix of its manifest keys (bfloat16 has none: its keys predate float16's)
DTYPE_KEY_SUFFIX = {torch.bfloat16: "", torch.float16: "_fp16"}


def config_key(head_dim: int, causal: bool, qhead_per_kvhead: int, dtype: torch.dtype) -> str:
    """The manifest key of one configuration (export.py writes the same keys)."""
    if dtype not in DTYPE_KEY_SUFFIX:
        raise TypeError(f"FA4 AOT kernels take torch.bfloat16 or torch.float16, got {dtype}")
    return f"d{head_dim}_c{int(bool(causal))}_g{qhead_per_kvhead}{DTYPE_KEY_SUFFIX[dtype]}"


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class FA4AOT:
    """The exported kernels of one package: fwd and bwd on (batch, seqlen, heads, head_dim) CUDA tensors."""

    def __init__(self, kernel_dir=None):
        self.dir = kernel_dir or os.environ.get("FA4_AOT_KERNELS") or DEFAULT_KERNEL_DIR
        with open(os.path.join(self.dir, "manifest.json")) as f:
            self.manifest = json.load(f)
        self._loaded = {}  # kernel name -> (module, its function); the module must outlive the function

    def _fn(self, name):
        if name not in self._loaded:
            module = tvm_ffi.load_module(os.path.join(self.dir, name + ".so"))
            self._loaded[name] = (module, module["func"])
        return self._loaded[name][1]

    def config(self, head_dim, causal, qhead_per_kvhead, dtype=torch.bfloat16):
        key = config_key(head_dim, causal, qhead_per_kvhead, dtype)
        try:
            return self.manifest["configs"][key]
        except KeyError:
            raise KeyError(f"no AOT kernel for {key}; exported: {sorted(self.manifest['configs'])}") from None

    @staticmethod
    def _check(q, k, v, *more):
        if q.dtype not in DTYPE_KEY_SUFFIX:
            raise TypeError(f"FA4 AOT kernels take torch.bfloat16 or torch.float16, got {q.dtype}")
        if any(t.dtype != q.dtype for t in (k, v) + more):
            raise TypeError(f"q/k/v (and out/dout) must share one dtype, got "
                            f"{[str(t.dtype) for t in (q, k, v) + more]}")
        assert q.is_cuda and q.dim() == 4, "expects (batch, seqlen, heads, head_dim) CUDA tensors"
        assert q.shape[-1] == k.shape[-1] == v.shape[-1]
        assert q.shape[2] % k.shape[2] == 0

    def fwd(self, q, k, v, causal=False, softmax_scale=None):
        """Returns (out (B, Sq, H, D) in q's dtype, lse (B, H, Sq) float32)."""
        self._check(q, k, v)
        q, k, v = [t.contiguous() for t in (q, k, v)]
        B, Sq, H, D = q.shape
        cfg = self.config(D, causal, H // k.shape[2], q.dtype)
        scale = float(softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D))
        out = torch.empty_like(q)
        lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
        self._fn(cfg["fwd"])(q, k, v, out, lse, scale,
                             None, None, None, None, None, None, None, None,  # varlen, paged, window, sink
                             None, (None, None), None, None)  # block sparsity, aux tensors, scheduler
        return out, lse

    def bwd(self, q, k, v, out, dout, lse, causal=False, softmax_scale=None):
        """Returns (dq, dk, dv)."""
        self._check(q, k, v, out, dout)
        q, k, v, out, dout, lse = [t.contiguous() for t in (q, k, v, out, dout, lse)]
        B, Sq, H, D = q.shape
        Sk, Hkv = k.shape[1], k.shape[2]
        qhead_per_kvhead = H // Hkv
        cfg = self.config(D, causal, qhead_per_kvhead, q.dtype)
        scale = float(softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D))
        # FA4's float32 accumulators are padded to whole tiles
        sq_padded = round_up(Sq, cfg["m_block"])
        sk_padded = round_up(Sk, cfg["n_block"])
        d_padded = round_up(D, cfg["hdim_multiple_of"])
        dev = q.device
        dq_accum = torch.empty(B, H, sq_padded * d_padded, dtype=torch.float32, device=dev)
        dpsum = torch.empty(B, H, sq_padded, dtype=torch.float32, device=dev)
        lse_log2 = torch.empty(B, H, sq_padded, dtype=torch.float32, device=dev)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        # dpsum = rowsum(out * dout), lse_log2 = lse * log2(e), dq_accum zeroed; softmax_scale 1.0 as FA4 passes it
        self._fn(cfg["bwd_pre"])(out, dout, dpsum, lse, lse_log2, dq_accum,
                                 None, None, None, None, None, 1.0, None, None)
        gqa = qhead_per_kvhead > 1
        if gqa:  # several query heads add into one dK, dV: float32 accumulators, converted afterwards
            dk_accum = torch.zeros(B, Hkv, sk_padded * d_padded, dtype=torch.float32, device=dev)
            dv_accum = torch.zeros(B, Hkv, sk_padded * d_padded, dtype=torch.float32, device=dev)
        self._fn(cfg["bwd"])(q, k, v, dout, lse_log2, dpsum, dq_accum,
                             dk_accum if gqa else dk, dv_accum if gqa else dv, scale,
                             None, None, None, None, None, None, None, None, None,
                             (None, None), None, None)
        postprocess = cfg["bwd_post"]  # dQ's kernel, then dK's and dV's (the same kernel or two)
        self._fn(postprocess[0])(dq_accum, dq, scale, None, None, None, None)
        if gqa:
            self._fn(postprocess[1])(dk_accum, dk, scale, None, None, None, None)
            self._fn(postprocess[2])(dv_accum, dv, 1.0, None, None, None, None)
        return dq, dk, dv


class _FA4Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, lib):
        out, lse = lib.fwd(q, k, v, causal, softmax_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.softmax_scale, ctx.lib = causal, softmax_scale, lib
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.lib.bwd(q, k, v, out, dout, lse, ctx.causal, ctx.softmax_scale)
        return dq, dk, dv, None, None, None


_default_lib = None


def flash_attn_func(q, k, v, causal=False, softmax_scale=None):
    """Drop-in for flash_attn.cute.flash_attn_func: bfloat16 or float16, dense, SM90 only."""
    global _default_lib
    if _default_lib is None:
        _default_lib = FA4AOT()
    return _FA4Function.apply(q, k, v, causal, softmax_scale, _default_lib)
