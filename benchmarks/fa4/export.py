"""Compile FlashAttention-4's SM90 kernels on a CPU host and export them as object files (pack.sh's step 2).

FA4 compiles a kernel at its first call with a given compile key. Here its own Python interface
runs under torch's FakeTensorMode (no GPU: shapes and dtypes only) for one forward and one backward
per configuration, and its compile caches record which compiled functions each configuration uses.
Each of those is exported with JitCompiledFunction.export_to_c (TVM-FFI ABI) to OUTDIR/<name>.o,
named by its role and a hash of its compile key, and manifest.json records, per configuration, the
kernels and the tile sizes that fa4_aot.py needs to replay FA4's call sequence.

Usage: export.py OUTDIR d,causal,hq,hkv[,dtype] ...    (dtype bf16, the default, or fp16)
Manifest keys: d{d}_c{causal}_g{hq/hkv}, with "_fp16" appended for fp16 (fa4_aot.config_key).
"""
import hashlib
import importlib.metadata
import json
import os
import pickle
import sys
import time

# FA4 reads these at import: compile for the H100/H200's sm_90a and its 132 SMs without a GPU present,
# and compile every kernel here rather than take one from FA4's disk cache.
os.environ.setdefault("FLASH_ATTENTION_ARCH", "sm_90")
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", "132")
os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] = "0"

import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
import flash_attn.cute.interface as fa4  # noqa: E402
from flash_attn.cute.cache_utils import JITCache  # noqa: E402
import cutlass  # noqa: E402

from fa4_aot import config_key  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# The kernels are picked for this problem, as FA4 would pick them (see README.md's caveats).
BATCH, SEQLEN = 4, 4096


class RecordingCache(JITCache):
    """FA4's compile cache, noting every key looked up (in call order, repeats included)."""

    def __init__(self):
        super().__init__()
        self.lookups = []

    def __contains__(self, key):
        self.lookups.append(key)
        return JITCache.__contains__(self, key)


def parse_config(text):
    fields = text.split(",")
    if len(fields) not in (4, 5) or (len(fields) == 5 and fields[4] not in DTYPES):
        sys.exit(f"bad config {text!r}: want d,causal,hq,hkv[,dtype] with dtype in {sorted(DTYPES)}")
    return (*map(int, fields[:4]), fields[4] if len(fields) == 5 else "bf16")


def main():
    out_dir = sys.argv[1]
    configs = [parse_config(c) for c in sys.argv[2:]]
    os.makedirs(out_dir, exist_ok=True)

    # role in fa4_aot.py -> the FA4 function whose compile cache holds its kernels
    roles = {"fwd": fa4._flash_attn_fwd, "bwd_pre": fa4._bwd_preprocess,
             "bwd": fa4._flash_attn_bwd, "bwd_post": fa4._bwd_postprocess_convert}
    caches = {}
    for role, fn in roles.items():
        fn.compile_cache = caches[role] = RecordingCache()

    exported = {}  # kernel name -> repr of its compile key

    def export(role, key):
        name = f"{role}_{hashlib.sha256(pickle.dumps(key)).hexdigest()[:12]}"
        if name not in exported:
            compiled = caches[role].cache[key]
            compiled.export_to_c(object_file_path=os.path.join(out_dir, name + ".o"), function_name="func")
            exported[name] = repr(key)
        return name

    manifest = {"arch": "sm_90a", "cutlass_dsl": cutlass.__version__,
                "flash_attn_4": importlib.metadata.version("flash-attn-4"), "configs": {}}
    for head_dim, causal, hq, hkv, dtype in configs:
        start = time.time()
        for cache in caches.values():
            cache.lookups.clear()
        with FakeTensorMode():
            q = torch.empty(BATCH, SEQLEN, hq, head_dim, dtype=DTYPES[dtype], device="cuda")
            k = torch.empty(BATCH, SEQLEN, hkv, head_dim, dtype=DTYPES[dtype], device="cuda")
            v = torch.empty(BATCH, SEQLEN, hkv, head_dim, dtype=DTYPES[dtype], device="cuda")
            out, lse = fa4.flash_attn_func(q, k, v, causal=bool(causal), return_lse=True)
            fa4._flash_attn_bwd(q, k, v, out, torch.empty_like(out), lse, head_dim ** -0.5, bool(causal))
        used = {role: [export(role, key) for key in dict.fromkeys(cache.lookups)] for role, cache in caches.items()}
        # postprocess lookups come in call order: dQ, then (for GQA) dK and dV, which may share one kernel
        postprocess_calls = [export("bwd_post", key) for key in caches["bwd_post"].lookups]
        assert len(used["fwd"]) == 1 and len(used["bwd"]) == 1 and len(used["bwd_pre"]) == 1, used
        tiles = fa4._tile_size_bwd_sm90(head_dim, head_dim, bool(causal), False)
        key = config_key(head_dim, causal, hq // hkv, DTYPES[dtype])
        manifest["configs"][key] = dict(
            head_dim=head_dim, causal=bool(causal), qhead_per_kvhead=hq // hkv, dtype=dtype,
            fwd=used["fwd"][0], bwd_pre=used["bwd_pre"][0], bwd=used["bwd"][0], bwd_post=postprocess_calls,
            m_block=tiles.m_block_size, n_block=tiles.n_block_size,
            hdim_multiple_of=64 if tiles.dKV_swapAB else 32,  # the float32 accumulators' head dim padding
            compiled_for=dict(B=BATCH, N=SEQLEN, hq=hq, hkv=hkv))
        print(f"d={head_dim} causal={causal} hq={hq} hkv={hkv} {dtype}: {time.time() - start:.1f}s {used}", flush=True)
    manifest["kernels"] = exported
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)


if __name__ == "__main__":
    main()
