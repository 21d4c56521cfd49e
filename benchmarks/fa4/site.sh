# Sourced on the GPU machine (no network) by use.sh and ncu_backward.sh: installs the package's apache-tvm-ffi
# wheel (and typing_extensions if torch's Python lacks it) into $FA4_SITE (/tmp/fa4site) unless it is there,
# then exports PYTHONPATH (the site and benchmarks/fa4) and FA4_AOT_KERNELS. Returns 2 without the package
# (benchmarks/fa4/pkg, built by pack.sh on the CPU host and carried by the device call).
FA4_HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PKG=${FA4_PKG:-$FA4_HERE/pkg}
SITE=${FA4_SITE:-/tmp/fa4site}
if [ ! -f "$PKG/kernels/manifest.json" ]; then
  echo "no $PKG/kernels/manifest.json: run benchmarks/fa4/pack.sh on the host and carry benchmarks/fa4/pkg"
  return 2
fi
if ! PYTHONPATH="$SITE" python3 -c "import tvm_ffi" 2>/dev/null; then
  rm -rf "$SITE"
  python3 -m pip install -q --no-index --no-deps --target "$SITE" "$PKG"/wheels/apache_tvm_ffi-*.whl
  python3 -c "import typing_extensions" 2>/dev/null || \
    python3 -m pip install -q --no-index --no-deps --target "$SITE" "$PKG"/wheels/typing_extensions-*.whl
fi
export PYTHONPATH="$SITE:$FA4_HERE:${PYTHONPATH:-}"
export FA4_AOT_KERNELS="$PKG/kernels"
