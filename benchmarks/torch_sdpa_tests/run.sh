#!/usr/bin/env bash
# PyTorch's own flash-attention SDPA tests (test/test_transformers.py, see README.md for the version) on the GPU,
# twice: with flashattn_ext activated as torch's flash-attention implementation (FLASHATTN_EXT_ACTIVATE=1) and
# with torch's own FA2 (FLASHATTN_EXT_ACTIVATE=0, the baseline), then a comparison of the two.
#
#   bash benchmarks/torch_sdpa_tests/run.sh              # from the repo root; both runs (ext, then base), ~6 min at most
#   RUNS=ext bash benchmarks/torch_sdpa_tests/run.sh     # only one of them (ext | base)
#   bash benchmarks/torch_sdpa_tests/run.sh --print-k    # print the -k selection and exit
#   EXTRA_K='and head_dim_64_' ...               # narrow the selection further (appended to -k)
#   TEST_FILE=test_transformers_2026-03.py SELECTION=selection_2026-03.txt bash ...   # the newer file
#
# Writes to $OUT (default benchmarks/torch_sdpa_tests/out): torch_tests_{ext,base}.xml (junit), torch_tests_{ext,base}.log,
# compare.txt. Each pytest run is stopped by SIGINT after ${PER_RUN_TIMEOUT:-170}s (pytest then still writes its
# junit xml and summary), and killed 20s later if it hangs.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
TEST_FILE="${TEST_FILE:-test_transformers.py}"     # beside this script
SELECTION="${SELECTION:-selection.txt}"            # its -k expression, beside this script
K="$(tr '\n' ' ' < "$HERE/$SELECTION" | tr -s ' ') ${EXTRA_K:-}"
if [ "${1:-}" = "--print-k" ]; then echo "$K"; exit 0; fi
cd "$REPO"
OUT="${OUT:-$HERE/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTORCH_TESTING_DEVICE_ONLY_FOR=cuda   # instantiate only the CUDA variants of the device-generic classes
RUNS="${RUNS:-ext base}"
PER_RUN_TIMEOUT="${PER_RUN_TIMEOUT:-170}"

python3 - <<'PY' 2>&1 | tee "$OUT/env.txt"
import torch
print("torch", torch.__version__, torch.version.git_version, "cuda", torch.version.cuda,
      "cudnn", torch.backends.cudnn.version() if torch.cuda.is_available() else None)
print("gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
      torch.cuda.get_device_capability() if torch.cuda.is_available() else "")
PY

rc_all=0
for run in $RUNS; do
  case "$run" in
    ext)  act=1 ;;
    base) act=0 ;;
    *) echo "unknown run '$run' (ext|base)"; exit 2 ;;
  esac
  echo "=== run $run (FLASHATTN_EXT_ACTIVATE=$act), timeout ${PER_RUN_TIMEOUT}s ==="
  start=$(date +%s)
  FLASHATTN_EXT_ACTIVATE=$act timeout -s INT -k 20 "$PER_RUN_TIMEOUT" \
    python3 -m pytest "$HERE/$TEST_FILE" -k "$K" -q -rfE -p no:cacheprovider -p no:randomly \
      --tb=line --junitxml="$OUT/torch_tests_$run.xml" > "$OUT/torch_tests_$run.log" 2>&1
  rc=$?
  echo "run $run: exit $rc in $(( $(date +%s) - start ))s (124/130: stopped by the timeout; 1: test failures; 5: nothing selected)"
  tail -n 25 "$OUT/torch_tests_$run.log"
  [ $rc -ne 0 ] && rc_all=$rc
done

if [ -f "$OUT/torch_tests_ext.xml" ] || [ -f "$OUT/torch_tests_base.xml" ]; then
  python3 "$HERE/compare.py" "$OUT/torch_tests_ext.xml" "$OUT/torch_tests_base.xml" 2>&1 | tee "$OUT/compare.txt"
fi
exit $rc_all
