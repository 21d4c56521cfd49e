#!/usr/bin/env bash
# On the GPU machine (no network): install the package's apache-tvm-ffi wheel (and typing_extensions
# if torch's Python lacks it) into /tmp/fa4site (site.sh), then run check.py: a smoke test of every exported
# configuration against SDPA, and FA4's forward and backward TFLOP/s at B=4, N=4096, H=16.
# benchmarks/fa4/pkg/ (built by pack.sh on the CPU host) is git-ignored, so the device call carries it:
#   run(command="bash benchmarks/fa4/use.sh", carry=["benchmarks/fa4/pkg"])
# Then, in the same call, bench_attention.py can time FA4 (see README.md):
#   PYTHONPATH=/tmp/fa4site:$PWD/benchmarks/fa4 python3 benchmarks/bench_attention.py --providers ext cudnn fa4
# Environment: FA4_PKG (the package; benchmarks/fa4/pkg), FA4_SITE (/tmp/fa4site), FA4_TIMEOUT (400 s).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/site.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
python3 -c "import torch, tvm_ffi; print('torch', torch.__version__, 'tvm_ffi', tvm_ffi.__version__, 'dlpack-exchange', hasattr(torch.Tensor, '__dlpack_c_exchange_api__'))"
timeout "${FA4_TIMEOUT:-400}" python3 "$HERE/check.py"
