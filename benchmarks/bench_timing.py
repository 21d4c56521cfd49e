"""Timing for the benchmark scripts: CUDA events (one pair a call) or the wall clock on the CPU, the
median of many calls after warm-up, and interleaved medians for comparing providers under the same
clock drift; and the command line and output of the scripts that print one markdown table. Importing
it puts this checkout first on sys.path, so the scripts measure its flashattn_ext, not another install."""
import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MIN_REPS, MAX_REPS, WARMUP_CALLS = 5, 50, 2


def with_kernels(family: Optional[str], fn: Callable) -> Callable:
    """fn, run with FLASHATTN_EXT_KERNELS=family (None: unset), which flashattn_ext reads at each call; the
    variable as it was afterwards."""
    def call():
        old = os.environ.pop("FLASHATTN_EXT_KERNELS", None)
        if family is not None:
            os.environ["FLASHATTN_EXT_KERNELS"] = family
        try:
            return fn()
        finally:
            os.environ.pop("FLASHATTN_EXT_KERNELS", None)
            if old is not None:
                os.environ["FLASHATTN_EXT_KERNELS"] = old
    return call


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable, device: torch.device, budget_s: float) -> float:
    """Median seconds per call of fn after warm-up, over as many calls as fit in budget_s."""
    for _ in range(WARMUP_CALLS):
        start = time.perf_counter()
        fn()
        synchronize(device)
        estimate = time.perf_counter() - start
    reps = min(MAX_REPS, max(MIN_REPS, round(budget_s / max(estimate, 1e-9))))
    if device.type == "cuda":
        return median_cuda_events(fn, reps)
    return _median_wall_clock(fn, reps)


def median_cuda_events(fn: Callable, reps: int) -> float:
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) / 1e3


def interleaved_median_cuda_events(fns: List[Callable], reps: int, warmup: int = 3) -> List[float]:
    """Each fn's median time in seconds (CUDA events, one a call) after warm-up calls, the fns' calls
    taken in turn: a GPU's clocks drift by several percent within seconds, and interleaved calls see
    the same drift."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
              for _ in fns]
    for rep in range(reps):
        for fn, fn_events in zip(fns, events):
            start, end = fn_events[rep]
            start.record()
            fn()
            end.record()
    torch.cuda.synchronize()
    return [statistics.median(start.elapsed_time(end) for start, end in fn_events) / 1e3 for fn_events in events]


def _median_wall_clock(fn: Callable, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def median_step_seconds(fn: Callable, reps: int, device: str = "cuda", warmup: int = 1) -> float:
    """Median seconds of fn (a whole step) after warm-up calls, each timed alone (CUDA events, or the wall
    clock on the CPU), every rank of an initialized process group starting it together (a barrier)."""
    import torch.distributed as dist
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if dist.is_initialized():
            dist.barrier()
        if device == "cpu":
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def table_arguments(doc: str) -> argparse.Namespace:
    """The command line of a script that prints one markdown table: --reps (timed calls a median) and
    --out (a file that gets the table too); doc's first line describes it."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", type=Path)
    return parser.parse_args()


def save_table(lines: List[str], out: Optional[Path]) -> None:
    """Writes the table's lines to out (its folder made), where one was given."""
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines) + "\n")


def free_port() -> int:
    """A free TCP port on this host, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
