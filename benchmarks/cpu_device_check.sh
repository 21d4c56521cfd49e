#!/usr/bin/env bash
# The CPU kernels on the GPU machine's CPU (16 cores, AMX on Sapphire Rapids): build, then run the stages
# named as arguments (default: all), logging each under $OUT; each stage's result line also goes to
# $OUT/summary.txt, printed at the end.
#   bash benchmarks/cpu_device_check.sh [test] [test-forced] [bench]
# (test: the CPU tests, which include the parity sweep rerun with the reduced-precision products forced;
#  test-forced: every CPU test with FLASHATTN_EXT_CPU_REDUCED_GEMM=1; bench: benchmarks/bench_cpu.py, 3 rounds,
#  float32, bfloat16 and float16)
set -uo pipefail
OUT="${OUT:-/tmp/flashattn_ext_cpu_check}"
mkdir -p "$OUT"
stages="${*:-test test-forced bench}"
export PYTHONUNBUFFERED=1

# AMX flags: amx_bf16 lets the bfloat16 forward run its products in bfloat16 (oneDNN's VNNI kernels);
# float16 needs amx_fp16 (Granite Rapids on), else it keeps the float products.
{ date -u; lscpu | grep -E "Model name|^CPU\(s\)"; echo "amx flags: $(grep -o -w -E 'amx_[a-z0-9]+' /proc/cpuinfo | sort -u | xargs)";
  python3 -c 'import torch; print("torch", torch.__version__, "cpu capability", torch.backends.cpu.get_cpu_capability(), "threads", torch.get_num_threads())'; } \
  | tee "$OUT/device.txt"

echo "== build"
start=$(date +%s)
if ! TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}" MAX_JOBS=16 \
    python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1; then
  tail -n 60 "$OUT/build.log"
  exit 1
fi
echo "built in $(( $(date +%s) - start )) s" | tee "$OUT/summary.txt"
summarize() { echo "$1: $2" >>"$OUT/summary.txt"; }

status=0
for stage in $stages; do
  echo "== $stage"
  case "$stage" in
    test|test-forced)
      forced=
      [ "$stage" = test-forced ] && forced=1
      FLASHATTN_EXT_CPU_REDUCED_GEMM=$forced python3 -m pytest -q -rs -m "not cuda" -p no:cacheprovider tests 2>&1 \
        | tee "$OUT/$stage.log" | tail -n 30
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      summarize "$stage" "$(grep -E '[0-9]+ (passed|failed)' "$OUT/$stage.log" | tail -n 1)" ;;
    bench)
      python3 benchmarks/bench_cpu.py --rounds 3 --dtypes float32 bfloat16 float16 --out "$OUT" 2>&1 \
        | tee "$OUT/bench_cpu.log" | tail -n 20
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      summarize bench "$(grep -c '^| [0-9]' "$OUT/bench_cpu.log") rows: $OUT/bench_cpu.log" ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
done
echo "== summary"
cat "$OUT/summary.txt"
exit "$status"
