#!/usr/bin/env bash
# One device call's worth of GPU work: build for the GPU present, then run the
# stages named as arguments (default: all), logging each under $OUT; the build
# time and each test and sanitizer stage's result line also go to
# $OUT/summary.txt, printed at the end.
#   bash benchmarks/gpu_check.sh [smoke] [test] [hopper] [sanitize] [sass] [bench] [bench-hopper] [ncu] [bench-full] [bench-window] [bench-varlen] [model] [model-profile]
#                                [cpu-test] [cpu-test-forced] [cpu-bench]
# (smoke: a minute's run of the Hopper kernels, the script stops if it fails or hangs; hopper: their own tests; sanitize: compute-sanitizer's memcheck, racecheck and synccheck,
#  each also a stage of its own, as one call's time limit may not hold all three; sass: counts of the Hopper
#  instructions in the built library; bench-hopper: ours, our sm80 kernels and cuDNN at the quick shapes;
#  ncu: Nsight Compute's speed-of-light and warp stall sections for the sm90 kernels; model: the model-level
#  training-step benchmark; model-profile: the same, and each provider's GPU kernel table; bench-window: the sliding
#  window against full attention, bench-varlen: a packed batch against the dense kernel and padded SDPA (issue 12's
#  bars); the machine's CPU:
#  cpu-test: the CPU tests, cpu-test-forced: the same with FLASHATTN_EXT_CPU_REDUCED_GEMM=1 (the 16-bit products
#  in the inputs' type, which the CPU takes by itself where it has AMX), cpu-bench: bench_cpu.py, 3 rounds, float32,
#  bfloat16 and float16)
# On a copy of the tree whose git metadata may be stale (the device tool's), pass the
# commit, written out where the tree came from, for the benchmark to stamp its results:
#   FLASHATTN_EXT_COMMIT=d09bf03 bash benchmarks/gpu_check.sh bench-full
set -uo pipefail
OUT="${OUT:-/tmp/flashattn_ext_gpu_check}"
mkdir -p "$OUT"
stages="${*:-test sanitize bench}"
export PYTHONUNBUFFERED=1

{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader;
  lscpu | grep -E "Model name|^CPU\(s\)"; echo "amx flags: $(grep -o -w -E 'amx_[a-z0-9]+' /proc/cpuinfo | sort -u | xargs)";
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cpu capability", torch.backends.cpu.get_cpu_capability())'; } \
  | tee "$OUT/device.txt"

echo "== build"
start=$(date +%s)
if ! TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}" MAX_JOBS=16 \
    python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1; then
  tail -n 60 "$OUT/build.log"
  exit 1
fi
echo "built in $(( $(date +%s) - start )) s" | tee "$OUT/summary.txt"
# summary.txt: one line per stage (the device brings back only a few files, and filtered output loses lines).
summarize() { echo "$1: $2" >>"$OUT/summary.txt"; }

status=0
for stage in $stages; do
  echo "== $stage"
  case "$stage" in
    test)
      python3 -m pytest -q -rs -m cuda -p no:cacheprovider tests 2>&1 | tee "$OUT/tests.log" | tail -n 40
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      summarize test "$(grep -E '[0-9]+ (passed|failed)' "$OUT/tests.log" | tail -n 1)" ;;
    smoke)
      # A hang here would otherwise take the rest of the call: stop the script (SIGKILL: a process
      # waiting on a hung kernel does not end on SIGTERM).
      timeout -s KILL 120 python3 benchmarks/smoke_sm90.py 2>&1 | tee "$OUT/smoke.log" | tail -n 20
      [ "${PIPESTATUS[0]}" -eq 0 ] || { summarize smoke "failed or hung"; exit 1; }
      summarize smoke "finished" ;;
    hopper)
      timeout -s KILL 300 python3 -m pytest -q -rs -x -p no:cacheprovider -m sm90 tests 2>&1 | tee "$OUT/hopper.log" | tail -n 40
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      summarize hopper "$(grep -E '[0-9]+ (passed|failed)' "$OUT/hopper.log" | tail -n 1)" ;;
    bench-hopper)
      python3 benchmarks/bench_attention.py --quick --dims 64 128 --providers ext ext-sm80 cudnn flash --out "$OUT" 2>&1 \
        | tee "$OUT/bench.log" | tail -n 30 ;;
    sanitize|memcheck|racecheck|synccheck)
      tools=$stage
      [ "$stage" = sanitize ] && tools="memcheck racecheck synccheck"
      for tool in $tools; do
        compute-sanitizer --tool "$tool" --error-exitcode 1 python3 tests/sanitizer_workload.py \
          >"$OUT/sanitizer_$tool.log" 2>&1 || status=1
        tail -n 3 "$OUT/sanitizer_$tool.log"
        summarize "$tool" "$(tail -n 1 "$OUT/sanitizer_$tool.log")"
      done ;;
    sass)
      # HGMMA: wgmma; UTMALDG / UTMASTG: TMA tensor loads / stores; UBLKRED: bulk reduce-add; HMMA: mma.sync (sm80 kernels).
      # (The whole SASS is too large to bring back from the device: it stays in a temporary file.)
      lib=$(python3 -c 'import flashattn_ext._C as c; print(c.__file__)')
      sass=$(mktemp)
      cuobjdump -sass "$lib" >"$sass" 2>&1 || status=1
      for op in HGMMA UTMALDG UTMASTG UBLKRED SYNCS HMMA; do
        echo "$op $(grep -cE "[[:space:]]$op" "$sass")"
      done | tee "$OUT/sass_counts.txt"
      rm -f "$sass" ;;
    model|model-profile)
      profile=""
      [ "$stage" = model-profile ] && profile=--profile
      python3 benchmarks/bench_model.py $profile --out "$OUT" 2>&1 | tee "$OUT/model.log" | tail -n 30
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    ncu)
      ncu --kernel-name-base mangled --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
        -k regex:sm90 python3 benchmarks/ncu_workload.py >"$OUT/ncu.log" 2>&1 || status=1
      grep -E "attention_|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Stall|Warp Cycles Per Issued" \
        "$OUT/ncu.log" | head -n 80 ;;
    cpu-test|cpu-test-forced)
      forced=
      [ "$stage" = cpu-test-forced ] && forced=1
      FLASHATTN_EXT_CPU_REDUCED_GEMM=$forced python3 -m pytest -q -rs -m "not cuda" -p no:cacheprovider tests 2>&1 \
        | tee "$OUT/$stage.log" | tail -n 30
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      summarize "$stage" "$(grep -E '[0-9]+ (passed|failed)' "$OUT/$stage.log" | tail -n 1)" ;;
    cpu-bench)
      python3 benchmarks/bench_cpu.py --rounds 3 --dtypes float32 bfloat16 float16 --out "$OUT" 2>&1 \
        | tee "$OUT/bench_cpu.log" | tail -n 20
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    bench)
      python3 benchmarks/bench_attention.py --quick --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -n 30 ;;
    bench-full)
      python3 benchmarks/bench_attention.py --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -n 60 ;;
    bench-window)
      python3 benchmarks/bench_window.py --seqlens 32768 8192 --out "$OUT" 2>&1 | tee "$OUT/bench_window.log" | tail -n 10 ;;
    bench-varlen)
      python3 benchmarks/bench_varlen.py --out "$OUT" 2>&1 | tee "$OUT/bench_varlen.log" | tail -n 10 ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
done
echo "== summary"
cat "$OUT/summary.txt"
exit "$status"
