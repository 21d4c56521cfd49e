#!/usr/bin/env bash
# Compile FlashAttention-4's SM90 kernels (flash-attn-4 4.0.0b36) on this CPU host into a package for
# the GPU machine, which has no network and no compiler: benchmarks/fa4/pkg/ (about 6 MB, git-ignored)
# with kernels/*.so and kernels/manifest.json, and wheels/ (apache-tvm-ffi for the device's Python 3.12,
# typing_extensions). On the device it then needs only torch and those files (see README.md, use.sh).
#   bash benchmarks/fa4/pack.sh                                          # the default configs below
#   FA4_CONFIGS="128,1,32,4 64,0,16,16,fp16" bash benchmarks/fa4/pack.sh   # d,causal,hq,hkv[,dtype]
# dtype: bf16 (default) or fp16; only the GQA ratio hq/hkv matters, not the head counts.
# Environment: FA4_OUT (package directory), FA4_WORK (downloads, venv, objects; /tmp/fa4),
# FA4_HOST_PY (a host Python with torch, any CUDA build; python3.11).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${FA4_OUT:-$HERE/pkg}
WORK=${FA4_WORK:-/tmp/fa4}
PY=${FA4_HOST_PY:-python3.11}
BASE="128,0,16,16 128,1,16,16 64,0,16,16 64,1,16,16 128,0,16,4 128,1,16,4 64,0,16,4 64,1,16,4"
CONFIGS=${FA4_CONFIGS:-"$BASE $(for c in $BASE; do printf '%s,fp16 ' "$c"; done)"}   # 8 bf16 + the same 8 in fp16
DSL=4.6.2
PYV=$($PY -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
mkdir -p "$WORK/whl_host" "$WORK/whl_dev"

# 1. the host's build venv: the DSL's cu13 flavour, matching the device's CUDA 13 (torch cu130)
if [ ! -x "$WORK/venv/bin/python" ] || ! "$WORK/venv/bin/python" -c "import cutlass.cute, flash_attn.cute" 2>/dev/null; then
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp $PLAT -d "$WORK/whl_host" \
    nvidia-cutlass-dsl==$DSL nvidia-cutlass-dsl-libs-base==$DSL nvidia-cutlass-dsl-libs-core==$DSL \
    nvidia-cutlass-dsl-libs-cu13==$DSL apache-tvm-ffi==0.1.11 flash-attn-4==4.0.0b36 quack-kernels==0.5.3 einops
  rm -rf "$WORK/venv"
  $PY -m venv --system-site-packages "$WORK/venv"   # the system's torch
  "$WORK/venv/bin/python" -m pip install -q --no-index --no-deps "$WORK"/whl_host/*.whl
fi
SITE=$("$WORK/venv/bin/python" -c "import tvm_ffi, os; print(os.path.dirname(os.path.dirname(tvm_ffi.__file__)))")
# 35 KB, linked into each kernel in place of libcute_dsl_runtime.so (42 MB)
RUNTIME_A=$SITE/nvidia_cutlass_dsl/cu13/lib/libcuda_dialect_runtime_static.a
CUDART_DIR=""
for d in /usr/local/cuda/lib64 "$($PY -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13", "lib"))' 2>/dev/null)"; do
  if [ -e "$d/libcudart.so.13" ]; then CUDART_DIR=$d; break; fi
done
[ -n "$CUDART_DIR" ] || { echo "libcudart.so.13 not found"; exit 1; }

# 2. compile and export (FakeTensorMode, CUTE_DSL_ARCH=sm_90a): one .o a kernel (TVM-FFI ABI) + manifest.json
rm -rf "$WORK/exp"
"$WORK/venv/bin/python" "$HERE/export.py" "$WORK/exp" $CONFIGS 2>&1 | grep -v "Warning\|exe_args\|return super"

# 3. link each object into a .so that needs only libtvm_ffi.so and libcudart.so.13, both of which
#    `import tvm_ffi` and `import torch` have already loaded on the device
if [ -e "$CUDART_DIR/libcudart.so" ]; then CUDART=-lcudart; else CUDART=-l:libcudart.so.13; fi
for o in "$WORK"/exp/*.o; do
  gcc -shared -fPIC -o "${o%.o}.so" "$o" "$RUNTIME_A" -L"$SITE/tvm_ffi/lib" -ltvm_ffi -L"$CUDART_DIR" $CUDART -ldl -lpthread -lrt
done

# 4. assemble the package (the device has Python 3.12)
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT -d "$WORK/whl_dev" \
  apache-tvm-ffi==0.1.11 typing_extensions
rm -rf "$OUT"; mkdir -p "$OUT/kernels" "$OUT/wheels"
cp "$WORK"/exp/*.so "$WORK/exp/manifest.json" "$OUT/kernels/"
cp "$WORK"/whl_dev/apache_tvm_ffi-0.1.11-*.whl "$WORK"/whl_dev/typing_extensions-*.whl "$OUT/wheels/"
du -sh "$OUT"; ls -la "$OUT/wheels"; echo "kernels: $(ls "$OUT"/kernels/*.so | wc -l)"

# 5. host check without cutlass: only tvm_ffi on the path, as on the device (see hostcheck.py)
TVM_FFI_ONLY="$WORK/tvm_ffi_only"; rm -rf "$TVM_FFI_ONLY"; mkdir -p "$TVM_FFI_ONLY"
ln -s "$SITE/tvm_ffi" "$TVM_FFI_ONLY/tvm_ffi"
PYTHONPATH="$TVM_FFI_ONLY" timeout 600 $PY "$HERE/hostcheck.py" --kernels "$OUT/kernels" || { echo "host check FAILED"; exit 1; }
