"""Host check of the ahead-of-time FlashAttention-4 kernels, on a CPU host without cutlass (pack.sh's last step).

fa4_aot's FA4AOT.fwd and bwd run with fake CUDA tensors: DLPack capsules with the right shape,
strides and dtype and bogus device pointers. Every kernel call must pass TVM-FFI's argument,
shape and dtype checks and stop only at the CUDA runtime (no driver here), and the wrapper must
call exactly the kernels of the configuration that the tensors' dtype, head dim, causal and
GQA ratio name. Each configuration is checked at N=4096 and at N=1000 (not a multiple of the
tiles). Negative controls: an lse of the wrong rank and an fp16 kernel given bf16 tensors must be
rejected by the argument checks, and float32 inputs by the wrapper.

Usage: PYTHONPATH=<dir with tvm_ffi> python3 hostcheck.py [--kernels DIR] [--mode calls|fwd|bwd]
    calls (the default): the per-call check above; exits 1 unless every configuration passes.
    fwd, bwd: only run FA4AOT.fwd (bwd) once per configuration and print the error it stops at.
"""
import argparse
import ctypes
import itertools
import os
import shutil
import sys
import tempfile

import torch
import tvm_ffi

import fa4_aot

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
B, N, H = 4, 4096, 16
DLPACK_CUDA = 2  # kDLCUDA


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


PyCapsule_New = ctypes.pythonapi.PyCapsule_New
PyCapsule_New.restype = ctypes.py_object
PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
# DLPack (type code, bits) of each dtype the kernels take
DLPACK_DTYPES = {torch.bfloat16: (4, 16), torch.float16: (2, 16), torch.float32: (2, 32), torch.int32: (0, 32)}
_keep_alive = []  # the ctypes structures behind capsules and the loaded modules: the kernels hold pointers to them


class FakeCuda:
    """Stands in for a contiguous CUDA torch tensor: its shape, strides and dtype, with a bogus device pointer."""
    _next_address = 0x7f0000000000
    is_cuda = True
    device = "cuda"

    def __init__(self, *shape, dtype):
        meta = torch.empty(*shape, dtype=dtype, device="meta")
        self.shape, self.strides, self.dtype = tuple(meta.shape), meta.stride(), dtype
        self.address = FakeCuda._next_address
        FakeCuda._next_address += 1 << 32  # far apart: no two tensors overlap

    def contiguous(self):
        return self

    def dim(self):
        return len(self.shape)

    def __dlpack_device__(self):
        return (DLPACK_CUDA, 0)

    def __dlpack__(self, *args, **kwargs):
        code, bits = DLPACK_DTYPES[self.dtype]
        ndim = len(self.shape)
        shape = (ctypes.c_int64 * ndim)(*self.shape)
        strides = (ctypes.c_int64 * ndim)(*self.strides)
        managed = DLManagedTensor(DLTensor(self.address, DLDevice(DLPACK_CUDA, 0), ndim, DLDataType(code, bits, 1),
                                           shape, strides, 0), None, None)
        _keep_alive.extend([shape, strides, managed])
        return PyCapsule_New(ctypes.addressof(managed), b"dltensor", None)


class FakeTorch:
    """torch, except that the allocations fa4_aot makes return FakeCuda tensors."""

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, *shape, dtype=None, device=None):
        return FakeCuda(*shape, dtype=dtype)

    zeros = empty

    def empty_like(self, t):
        return FakeCuda(*t.shape, dtype=t.dtype)


def qkv(cfg, seqlen, dtype=None):
    """Fake q, k, v and a maker of more (B, seqlen, heads, head_dim) tensors for one configuration."""
    def make(heads):
        return FakeCuda(B, seqlen, heads, cfg["head_dim"], dtype=dtype or DTYPES[cfg["dtype"]])
    hkv = H // cfg["qhead_per_kvhead"]
    return make(H), make(hkv), make(hkv), make


def fake_lse(seqlen, *extra_dims):
    return FakeCuda(B, H, seqlen, *extra_dims, dtype=torch.float32)


def run_whole(lib, mode):
    """fwd or bwd once per configuration, reporting where it stops (on a host without a GPU it must stop)."""
    for key, cfg in sorted(lib.manifest["configs"].items()):
        q, k, v, make = qkv(cfg, N)
        try:
            if mode == "fwd":
                lib.fwd(q, k, v, cfg["causal"])
            else:
                lib.bwd(q, k, v, make(H), make(H), fake_lse(N), cfg["causal"])
            print(key, mode, "returned without error (unexpected on a GPU-less host)")
        except Exception as e:
            print(key, mode, "->", type(e).__name__, str(e).splitlines()[0][:300])


def check_calls(lib, scratch_dir) -> bool:
    copies = itertools.count()
    results = []

    def fresh(name):
        # a fresh copy for each call: a library whose CUDA init failed (no driver) can hang when called again
        copy = os.path.join(scratch_dir, f"{name}_{next(copies)}.so")
        shutil.copy(os.path.join(lib.dir, name + ".so"), copy)
        module = tvm_ffi.load_module(copy)
        _keep_alive.append(module)
        return module["func"]

    def checked(name):
        fn = fresh(name)

        def call(*args):
            try:
                fn(*args)
                outcome = "returned"
            except RuntimeError as e:
                reached = "CUDA runtime reached" if "Cuda Runtime Error" in str(e) else str(e)[:200]
                outcome = f"OK(args accepted; {reached})"
            except Exception as e:
                outcome = f"ARG-ERROR {type(e).__name__} {str(e)[:300]}"
            results.append(f"{name}:{outcome}")
        return call

    lib._fn = checked
    failed = []
    for key, cfg in sorted(lib.manifest["configs"].items()):
        gqa = cfg["qhead_per_kvhead"] > 1
        for seqlen in (N, 1000):
            q, k, v, make = qkv(cfg, seqlen)
            results.clear()
            lib.fwd(q, k, v, cfg["causal"])
            lib.bwd(q, k, v, make(H), make(H), fake_lse(seqlen), cfg["causal"])
            want = [cfg["fwd"], cfg["bwd_pre"], cfg["bwd"]] + cfg["bwd_post"][:3 if gqa else 1]
            used = [r.split(":")[0] for r in results]
            ok = all("OK(" in r for r in results) and sorted(used) == sorted(want)
            if not ok:
                failed.append(f"{key} N={seqlen}")
            print(key, cfg["dtype"], f"N={seqlen}", "ALL-OK" if ok else (list(results), want), len(results), "calls")

    def fwd_args(cfg, q_dtype, lse):
        q, k, v, make = qkv(cfg, N, q_dtype)
        return (q, k, v, make(H), lse, 0.1, None, None, None, None, None, None, None, None, None, (None, None),
                None, None)

    configs = lib.manifest["configs"]
    results.clear()
    cfg = configs["d128_c0_g1"]
    lib._fn(cfg["fwd"])(*fwd_args(cfg, None, fake_lse(N, 1)))
    print("negative control (lse of rank 4):", results)
    controls_ok = results[0].split(":", 1)[1].startswith("ARG-ERROR")
    fp16_keys = sorted(key for key, c in configs.items() if c["dtype"] == "fp16")
    if fp16_keys:
        results.clear()
        cfg = configs[fp16_keys[0]]
        lib._fn(cfg["fwd"])(*fwd_args(cfg, torch.bfloat16, fake_lse(N)))
        print(f"negative control 2 ({fp16_keys[0]} fwd with bf16 tensors):", results)
        controls_ok &= results[0].split(":", 1)[1].startswith("ARG-ERROR")
    try:
        lib.fwd(*[FakeCuda(1, 256, H, 128, dtype=torch.float32) for _ in range(3)])
        print("wrapper accepted float32 (unexpected)")
        controls_ok = False
    except (TypeError, AssertionError, KeyError) as e:
        print("wrapper rejects float32 ->", type(e).__name__, e)

    failed_keys = {f.split()[0] for f in failed}
    print(f"host check: {len(configs) - len(failed_keys)}/{len(configs)} configs pass every call"
          + (f" (failed: {', '.join(failed)})" if failed else "")
          + "; negative controls " + ("rejected" if controls_ok else "NOT rejected"))
    return not failed and controls_ok


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", help="kernel directory (default: $FA4_AOT_KERNELS, else pkg/kernels here)")
    parser.add_argument("--mode", choices=("calls", "fwd", "bwd"), default="calls")
    args = parser.parse_args()
    fa4_aot.torch = FakeTorch()
    lib = fa4_aot.FA4AOT(args.kernels)
    if args.mode != "calls":
        run_whole(lib, args.mode)
        return
    with tempfile.TemporaryDirectory(prefix="fa4_hostcheck_") as scratch_dir:
        ok = check_calls(lib, scratch_dir)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
