"""One forward and one backward of flashattn_ext per (head dim, causal) cell at a benchmark
shape, for Nsight Compute to profile (not a benchmark: nothing is timed here).

    ncu --section SpeedOfLight --section WarpStateStats -k regex:sm90 python3 benchmarks/ncu_workload.py
    python3 benchmarks/ncu_workload.py --dims 128 --causal off      # one cell
    python3 benchmarks/ncu_workload.py --deterministic              # the backward in deterministic mode
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (this checkout's build, not another install)
import flashattn_ext  # noqa: E402

BATCH, HEADS, SEQLEN = 4, 16, 4096


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--causal", nargs="+", choices=["off", "on"], default=["off", "on"])
    parser.add_argument("--deterministic", action="store_true", help="torch.use_deterministic_algorithms(True)")
    args = parser.parse_args(argv)
    torch.use_deterministic_algorithms(args.deterministic)
    for head_dim in args.dims:
        for causal in (c == "on" for c in args.causal):
            q, k, v = (
                torch.randn(BATCH, HEADS, SEQLEN, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(3)
            )
            out = flashattn_ext.scaled_dot_product_attention(q, k, v, is_causal=causal)
            out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
