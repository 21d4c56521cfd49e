"""Attention speed and memory: flashattn_ext against torch SDPA's backends, side by side.

Every cell of the speed tables is forward / backward TFLOP/s, the mean over rounds
(2 by default, the providers' order reversed each round) of the median of 5 to 50
timed calls after warm-up (CUDA events; wall clock on CPU), on random normal inputs
of shape (B, H, N, D) that require grad. FLOPs follow the FlashAttention papers:
forward 4*B*H*N*N*D, halved when causal; backward 2.5x the forward. The forward is
timed with autograd recording; the backward is torch.autograd.grad(out, (q, k, v),
dout) on one saved forward. A provider that raises (for example NotImplementedError)
gets "—" for that cell; the first error of each provider is listed under the tables.
Providers and format mirror /work/shared/anchors.md, so the numbers compare.

The peak-memory table is the extra allocated memory of one forward and backward,
upstream gradient included, at B=1, H=16, D=128, non-causal.

Results go to <out>/bench_<date>_<device>.md and .png (the PNG needs matplotlib),
and each table row is printed to stdout as soon as it is measured.

Usage (from the repository root):
    python3 benchmarks/bench_attention.py                 # full grid, about 2 minutes on an H100
    python3 benchmarks/bench_attention.py --quick         # bf16, D=128, N in {4096, 16384}
    python3 benchmarks/bench_attention.py --dims 128 --seqlens 4096 --causal on --providers ext cudnn
    python3 benchmarks/bench_attention.py --device cpu --out /tmp/benchout   # tiny smoke test
    python3 benchmarks/bench_attention.py --quick --dropout 0 0.1 --providers ext cudnn   # dropout's cost
    python3 benchmarks/bench_attention.py --quick --causal off --masks none padding padding_half float

With --dropout, every (D, N, causal) row is measured once per dropout_p, one after the other, and the
tables gain a dropout column (the plot shows the first value's rows only). --masks does the same with
attn_mask (non-causal rows only: SDPA takes no mask with is_causal): "padding", a bool (B, 1, 1, N)
key-padding mask that hides nothing; "padding_half", the same hiding each sequence's second half of
keys; "padding_half_lowest", the same as an additive mask of the dtype's lowest value (finfo.min, as
some transformers versions build); "float", a float (N, N) mask of normal noise in the inputs' dtype; "padding_spread", right
padding with the batch's lengths spread from N down to N / 4; "padding_rows", the same as a
(B, 1, N, N) mask with every row materialized (transformers' BERT passes this form). A masked cell counts the
unmasked call's FLOPs, so that its TFLOP/s compare as speed: work a mask lets a kernel skip shows.
"""
import argparse
import datetime
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench_timing import MAX_REPS, MIN_REPS, REPO, WARMUP_CALLS, median_seconds

try:
    from flashattn_ext import scaled_dot_product_attention as ext_attention
    from flashattn_ext import set_dropout_bits
except (ImportError, OSError) as import_error:  # still measure torch's backends; the ext's cells say why not
    def ext_attention(*args, _error=import_error, **kwargs):
        raise _error

    def set_dropout_bits(bits):
        pass

try:  # FlashAttention-4's sm90 kernels compiled ahead of time (benchmarks/fa4/README.md: how to put them on sys.path)
    from fa4_aot import flash_attn_func as fa4_flash_attn_func
except ImportError as fa4_import_error:
    def fa4_flash_attn_func(*args, _error=fa4_import_error, **kwargs):
        raise _error


def fa4_attention(q, k, v, attn_mask=None, is_causal=False, dropout_p=0.0):
    """FlashAttention-4 on (B, H, N, D) views of (B, N, H, D) tensors (its own layout: no copy)."""
    if attn_mask is not None or dropout_p > 0:
        raise NotImplementedError("FlashAttention-4 (compiled ahead of time): no attn_mask or dropout")
    out = fa4_flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=is_causal)
    return out.transpose(1, 2)


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16"}
DASH = "—"
MATH_MAX_N = 4096  # SDPA math holds N x N scores: 64 GiB at N=16384


@dataclass(frozen=True)
class Provider:
    key: str  # name on the command line
    label: str  # column name, as in anchors.md
    attention: Callable
    backend: Optional[SDPBackend] = None  # SDPA backend forced while it runs
    max_n: int = sys.maxsize  # longer sequences are skipped
    env: Optional[Tuple[str, str]] = None  # an environment variable set while it runs
    seq_major: bool = False  # its inputs stored (B, N, H, D), passed as (B, H, N, D) views
    by_default: bool = True  # timed without --providers

    def context(self):
        if self.env is not None:
            return environment(*self.env)
        return sdpa_kernel(self.backend) if self.backend is not None else nullcontext()


@contextmanager
def environment(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


# Column order of anchors.md, with flashattn_ext where its extra kernel stands.
GPU_PROVIDERS = [
    Provider("cudnn", "SDPA cuDNN", F.scaled_dot_product_attention, SDPBackend.CUDNN_ATTENTION),
    Provider("fa4", "FlashAttention-4", fa4_attention, seq_major=True, by_default=False),
    Provider("flash", "SDPA flash (FA2)", F.scaled_dot_product_attention, SDPBackend.FLASH_ATTENTION),
    Provider("ext", "flashattn_ext", ext_attention),
    # Our mma.sync kernels where the Hopper ones would run (the same on other GPUs).
    Provider("ext-sm80", "flashattn_ext sm80", ext_attention, env=("FLASHATTN_EXT_KERNELS", "sm80")),
    Provider("efficient", "SDPA mem-efficient", F.scaled_dot_product_attention, SDPBackend.EFFICIENT_ATTENTION),
    Provider("math", "SDPA math", F.scaled_dot_product_attention, SDPBackend.MATH, MATH_MAX_N),
    # Whatever backend torch picks (with an attn_mask, not always cuDNN).
    Provider("default", "SDPA default", F.scaled_dot_product_attention),
]
CPU_PROVIDERS = [
    Provider("ext", "flashattn_ext", ext_attention),
    Provider("default", "SDPA default", F.scaled_dot_product_attention),
    Provider("math", "SDPA math", F.scaled_dot_product_attention, SDPBackend.MATH),
]


@dataclass(frozen=True)
class Setup:
    """What one device mode measures."""
    providers: List[Provider]
    tokens: int  # B * N, kept constant across N
    heads: Dict[int, int]  # head dim -> number of heads
    dims: Tuple[int, ...]
    seqlens: Tuple[int, ...]
    memory_seqlens: Tuple[int, ...]  # empty: no memory table
    budget_s: float  # time spent on the timed calls of one cell
    rounds: int = 2  # rounds over the providers per cell (see measure_row)


GPU = Setup(GPU_PROVIDERS, 16384, {64: 32, 128: 16, 256: 8}, (64, 128), (512, 1024, 2048, 4096, 8192, 16384),
            (1024, 4096, 16384), 0.15)
CPU = Setup(CPU_PROVIDERS, 512, {64: 2, 128: 2, 256: 2}, (64, 128), (128, 256), (), 0.05)
QUICK = dict(dtypes=["bf16"], dims=[128], seqlens=[4096, 16384])


class CudaContextLost(RuntimeError):
    """A CUDA error that poisons every later call (an illegal memory access, say)."""


@dataclass
class Row:
    dtype: str
    d: int
    n: int
    b: int
    h: int
    causal: bool
    tflops: Dict[str, Tuple[Optional[float], Optional[float]]]  # label -> (forward, backward)
    dropout: float = 0.0
    mask: str = "none"


@dataclass
class Report:
    title: str
    header: List[str]  # lines under the title: device, versions, command, method
    providers: List[Provider]
    memory_dtype: str
    dropout_column: bool = False  # whether the speed tables show each row's dropout_p
    mask_column: bool = False  # and its attn_mask
    rows: List[Row] = field(default_factory=list)
    memory: Dict[int, Dict[str, Optional[float]]] = field(default_factory=dict)  # N -> label -> MiB
    notes: Dict[str, str] = field(default_factory=dict)  # first error per provider, and other notes


# ----------------------------------------------------------------------------- measuring

def make_inputs(b: int, h: int, n: int, d: int, dtype: torch.dtype, device: torch.device, seq_major: bool = False):
    """q, k, v of shape (B, H, N, D), requiring grad; seq_major: views of (B, N, H, D) tensors."""
    if seq_major:
        return [torch.randn(b, n, h, d, dtype=dtype, device=device, requires_grad=True).transpose(1, 2)
                for _ in range(3)]
    return [torch.randn(b, h, n, d, dtype=dtype, device=device, requires_grad=True) for _ in range(3)]


MASKS = ("none", "padding", "padding_half", "padding_half_lowest", "float", "padding_spread", "padding_rows")


def make_mask(kind: str, b: int, n: int, dtype: torch.dtype, device: torch.device) -> Optional[torch.Tensor]:
    """The attn_mask that --masks names (see the module docstring); None for "none"."""
    if kind == "float":
        return torch.randn(n, n, dtype=dtype, device=device)
    if kind == "padding_half_lowest":  # padding_half as an additive mask of finfo(dtype).min, as some transformers build
        bias = torch.zeros(b, 1, 1, n, dtype=dtype, device=device)
        bias[..., n // 2:] = torch.finfo(dtype).min
        return bias
    if kind.startswith("padding"):
        keep = torch.ones(b, 1, 1, n, dtype=torch.bool, device=device)
        if kind == "padding_half":
            keep[..., n // 2:] = False
        if kind in ("padding_spread", "padding_rows"):  # right padding, lengths from N down to N / 4
            lengths = torch.linspace(n, n / 4, b, device=device).round().long()
            keep = (torch.arange(n, device=device) < lengths[:, None]).view(b, 1, 1, n)
        if kind == "padding_rows":  # every row materialized, as transformers' BERT passes it
            keep = keep.expand(b, 1, n, n).contiguous()
        return keep
    return None


def forward_flops(b: int, h: int, n: int, d: int, causal: bool) -> float:
    return 4 * b * h * n * n * d / (2 if causal else 1)


def attempt(report: Report, provider: Provider, device: torch.device, fn: Callable):
    """fn()'s result, or None if it raises; the provider's first error goes to the report."""
    try:
        return fn()
    except Exception as error:  # noqa: BLE001 - any failure of a provider is one "—" cell
        if provider.label not in report.notes:
            first_line = (str(error).strip().splitlines() or [""])[0][:300]
            report.notes[provider.label] = f"{type(error).__name__}: {first_line}"
            print(f"  [{provider.label}] {report.notes[provider.label]}", file=sys.stderr, flush=True)
    if device.type == "cuda":  # here the error's frames, and their tensors, are gone
        _check_cuda_context(provider)
        torch.cuda.empty_cache()
    return None


def _check_cuda_context(provider: Provider) -> None:
    try:
        torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - whatever a poisoned context raises
        raise CudaContextLost(f"after {provider.label}: {error}") from error


def time_forward_backward(provider: Provider, q, k, v, causal: bool, dropout: float, mask, device,
                          budget_s: float, report: Report):
    """(forward seconds, backward seconds) per call; None where the provider fails."""
    def forward():
        return provider.attention(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout)

    def backward_seconds():
        out = forward()
        dout = torch.randn_like(out)
        return median_seconds(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
                              device, budget_s)

    with provider.context():
        fwd = attempt(report, provider, device, lambda: median_seconds(forward, device, budget_s))
        bwd = attempt(report, provider, device, backward_seconds) if fwd is not None else None
    return fwd, bwd


def measure_row(report: Report, setup: Setup, dtype: str, d: int, n: int, causal: bool, dropout: float,
                mask_kind: str, device) -> Row:
    """One cell per provider: setup.rounds rounds over the providers, each in the opposite order of the
    round before (the GPU's clock drifts over a cell's seconds: whoever ran last ran slower, up to 10% a
    cell), with the budget split between them; a cell is the mean of its rounds' medians."""
    # (A padded head dim takes the heads of the one it runs padded to.)
    b, h = max(1, setup.tokens // n), setup.heads[min(x for x in setup.heads if x >= d)]
    providers = [p for p in report.providers if n <= p.max_n]
    inputs = {layout: make_inputs(b, h, n, d, DTYPES[dtype], device, layout)
              for layout in {p.seq_major for p in providers}}
    mask = make_mask(mask_kind, b, n, DTYPES[dtype], device)
    flops = forward_flops(b, h, n, d, causal)
    seconds: Dict[str, List[Tuple[Optional[float], Optional[float]]]] = {p.label: [] for p in providers}
    for round_index in range(setup.rounds):
        for provider in providers if round_index % 2 == 0 else providers[::-1]:
            seconds[provider.label].append(
                time_forward_backward(provider, *inputs[provider.seq_major], causal, dropout, mask, device,
                                      setup.budget_s / setup.rounds, report))

    def mean_or_none(values):
        return None if any(value is None for value in values) else statistics.mean(values)

    row = Row(dtype, d, n, b, h, causal, {p.label: (None, None) for p in report.providers}, dropout, mask_kind)
    for provider in providers:
        fwd = mean_or_none([fwd for fwd, _ in seconds[provider.label]])
        bwd = mean_or_none([bwd for _, bwd in seconds[provider.label]])
        row.tflops[provider.label] = (
            flops / fwd / 1e12 if fwd else None,
            2.5 * flops / bwd / 1e12 if bwd else None,
        )
    return row


def peak_extra_mib(provider: Provider, n: int, dtype: torch.dtype, device: torch.device) -> float:
    """Extra peak memory of one forward and backward, upstream gradient included, in MiB."""
    q, k, v = make_inputs(1, 16, n, 128, dtype, device, provider.seq_major)

    def forward_backward():
        out = provider.attention(q, k, v)
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))

    with provider.context():
        forward_backward()  # one-time allocations (workspaces, handles) are not the call's
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        forward_backward()
        torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def measure_memory(report: Report, setup: Setup, device: torch.device) -> None:
    print(f"\n## Peak memory\n\n{memory_caption(report)}\n", flush=True)
    for line in memory_table_head(report):
        print(line, flush=True)
    for n in setup.memory_seqlens:
        report.memory[n] = {
            provider.label: attempt(report, provider, device,
                                    lambda: peak_extra_mib(provider, n, DTYPES[report.memory_dtype], device))
            if n <= provider.max_n else None
            for provider in report.providers
        }
        torch.cuda.empty_cache()
        print(memory_table_line(report, n), flush=True)


# ----------------------------------------------------------------------------- markdown

def fmt_tflops(value: Optional[float]) -> str:
    if value is None:
        return DASH
    return f"{value:.0f}" if value >= 10 else f"{value:.2g}"


def fmt_cell(pair: Tuple[Optional[float], Optional[float]]) -> str:
    if pair == (None, None):
        return DASH
    return " / ".join(fmt_tflops(value) for value in pair)


def speed_table_head(report: Report) -> List[str]:
    labels = [provider.label for provider in report.providers]
    columns = ["D", "N", "B x H", "causal", *(["dropout"] if report.dropout_column else []),
               *(["mask"] if report.mask_column else []), *labels]
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def speed_table_line(report: Report, row: Row) -> str:
    cells = [str(row.d), str(row.n), f"{row.b} x {row.h}", "yes" if row.causal else "no"]
    cells += [f"{row.dropout:g}"] if report.dropout_column else []
    cells += [row.mask] if report.mask_column else []
    cells += [fmt_cell(row.tflops[provider.label]) for provider in report.providers]
    return "| " + " | ".join(cells) + " |"


def memory_caption(report: Report) -> str:
    return (f"Peak extra memory for one forward and backward (MiB), {DTYPE_NAMES[report.memory_dtype]}, "
            "B=1, H=16, D=128, non-causal, upstream gradient allocated inside the measured region:")


def memory_table_head(report: Report) -> List[str]:
    columns = ["N", *(provider.label for provider in report.providers)]
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def memory_table_line(report: Report, n: int) -> str:
    values = report.memory[n]
    cells = [str(n)] + [DASH if values[p.label] is None else f"{values[p.label]:.0f}" for p in report.providers]
    return "| " + " | ".join(cells) + " |"


def markdown(report: Report) -> str:
    lines = [f"# {report.title}", "", *report.header]
    for dtype in dict.fromkeys(row.dtype for row in report.rows):
        lines += ["", f"## {DTYPE_NAMES[dtype]}", "", *speed_table_head(report)]
        lines += [speed_table_line(report, row) for row in report.rows if row.dtype == dtype]
    if report.memory:
        lines += ["", "## Peak memory", "", memory_caption(report), "", *memory_table_head(report)]
        lines += [memory_table_line(report, n) for n in report.memory]
    if report.notes:
        lines += ["", *notes_lines(report)]
    return "\n".join(lines) + "\n"


def notes_lines(report: Report) -> List[str]:
    return ["## Failures and notes", ""] + [f"- {label}: `{message}`" for label, message in report.notes.items()]


# ----------------------------------------------------------------------------- plot

def plot(report: Report, path: Path, stamp: str) -> bool:
    """TFLOP/s against N for the first dtype, one panel per (D, causal, direction), and memory.
    Returns whether a PNG was written."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr, flush=True)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first_dtype = report.rows[0].dtype if report.rows else None
    rows = [row for row in report.rows if row.dtype == first_dtype and row.dropout == report.rows[0].dropout
            and row.mask == report.rows[0].mask]
    panels = [(d, causal, direction) for d in dict.fromkeys(row.d for row in rows)
              for causal in dict.fromkeys(row.causal for row in rows) for direction in (0, 1)]
    count = len(panels) + bool(report.memory)
    if count == 0:
        return False
    ncols = min(3, count)
    nrows = math.ceil(count / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 3.8 * nrows), squeeze=False)
    axes = list(axes.flat)
    for ax, (d, causal, direction) in zip(axes, panels):
        selected = [row for row in rows if row.d == d and row.causal == causal]
        series = {p.label: [(row.n, row.tflops[p.label][direction]) for row in selected] for p in report.providers}
        name = ("forward", "backward")[direction]
        title = f"{DTYPE_NAMES[first_dtype]}, D={d}, {'causal' if causal else 'non-causal'}, {name}"
        _draw(ax, series, title, "TFLOP/s")
    if report.memory:
        series = {p.label: [(n, values[p.label]) for n, values in report.memory.items()] for p in report.providers}
        _draw(axes[len(panels)], series, "peak extra memory, B=1, H=16, D=128", "MiB", log_y=True)
    for ax in axes[count:]:
        ax.set_visible(False)
    handles = {}
    for ax in axes[:count]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=len(handles))
    fig.suptitle(f"{report.title}\n{stamp}")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _draw(ax, series: Dict[str, List[Tuple[int, Optional[float]]]], title: str, ylabel: str,
          log_y: bool = False) -> None:
    for label, points in series.items():
        points = [(n, value) for n, value in points if value is not None]
        if points:
            ax.plot(*zip(*points), marker="o", label=label)
    ns = sorted({n for points in series.values() for n, _ in points})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    if log_y:
        ax.set_yscale("log")
    ax.minorticks_off()
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("N (sequence length)")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)


# ----------------------------------------------------------------------------- run

def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.machine()} ({torch.get_num_threads()} threads)"


def device_slug(device: torch.device, quick: bool) -> str:
    """The device's name as a file-name part (results are named by date and this)."""
    return re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-") + ("-quick" if quick else "")


def cudnn_version() -> str:
    version = torch.backends.cudnn.version()
    if not version:
        return "n/a"
    base = 10000 if version >= 90000 else 1000  # cuDNN 9 encodes 9.19.0 as 91900, cuDNN 8 8.9.7 as 8907
    return f"{version // base}.{version % base // 100}"


def git_commit() -> str:
    """The commit measured: $FLASHATTN_EXT_COMMIT where set (a copy of the tree on another machine
    may carry stale git metadata, so set it where the tree came from), else git describe."""
    if os.environ.get("FLASHATTN_EXT_COMMIT"):
        return os.environ["FLASHATTN_EXT_COMMIT"]
    try:
        result = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"],
                                capture_output=True, text=True, timeout=10)
    except OSError:
        return "unknown"
    return result.stdout.strip() or "unknown"


def new_report(args, setup: Setup, device: torch.device, today: str) -> Report:
    timing = "CUDA events" if device.type == "cuda" else "time.perf_counter, tiny smoke-test sizes"
    header = [
        f"Measured {today} on one {device_name(device)} (torch {torch.__version__}, cuDNN {cudnn_version()}), "
        f"flashattn_ext at commit {git_commit()}.",
        f"Command: `{' '.join(shlex.quote(arg) for arg in ['python3', *sys.argv])}`",
        "",
        f"Each cell is forward / backward TFLOP/s: the providers are timed in {setup.rounds} rounds, each in "
        "the opposite order of the one before, and a cell is the mean of its rounds' medians of "
        f"{MIN_REPS} to {MAX_REPS} timed calls ({timing}) after {WARMUP_CALLS} warm-up calls, "
        f"about {setup.budget_s} s of timed calls per cell, on random normal inputs; B = max(1, {setup.tokens} // N). "
        "The forward is timed with autograd recording; the backward is "
        "`torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)` on one saved forward.",
        "FLOPs follow the FlashAttention papers: forward 4·B·H·N²·D, halved when causal; backward 2.5× the forward.",
        *([f"flashattn_ext's dropout draws {args.dropout_bits}-bit numbers (`set_dropout_bits`)."]
          if args.dropout != [0.0] else []),
        "Providers: flashattn_ext, and torch's SDPA with one backend forced by `torch.nn.attention.sdpa_kernel` "
        f"(math only up to N={MATH_MAX_N}). — means the provider failed (see the notes) or was skipped.",
    ]
    providers = [p for p in setup.providers if (p.key in args.providers if args.providers else p.by_default)]
    if any(p.key == "fa4" for p in providers):
        header.append("FlashAttention-4: flash-attn-4 4.0.0b36's sm90 kernels compiled ahead of time "
                      "(benchmarks/fa4/pack.sh), on (B, N, H, D) tensors, its own layout.")
    return Report("Attention: flashattn_ext against torch SDPA", header, providers, args.dtypes[0],
                  dropout_column=args.dropout != [0.0], mask_column=args.masks != ["none"])


def run_grid(report: Report, setup: Setup, args, device: torch.device, md_path: Path) -> None:
    """Measure the speed tables row by row, printing each row and rewriting the markdown as it goes."""
    deadline = time.monotonic() + args.time_limit
    for dtype in args.dtypes:
        print(f"\n## {DTYPE_NAMES[dtype]}\n", flush=True)
        for line in speed_table_head(report):
            print(line, flush=True)
        for d in args.dims:
            for n in args.seqlens:
                for causal in args.causal:
                    for dropout in args.dropout:
                        for mask in args.masks if not causal else ["none"]:
                            if time.monotonic() > deadline:
                                report.notes["time limit"] = (f"--time-limit {args.time_limit:g} s reached; later "
                                                              "rows not run")
                                return
                            row = measure_row(report, setup, dtype, d, n, causal, dropout, mask, device)
                            report.rows.append(row)
                            print(speed_table_line(report, row), flush=True)
                            md_path.write_text(markdown(report))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--quick", action="store_true", help="bf16, D=128, N in {4096, 16384}")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), help="default: bf16 fp16")
    parser.add_argument("--dims", nargs="+", type=int,
                        help="head dims, multiples of 8 up to 256 (80 and 96 run padded kernels); default: 64 128")
    parser.add_argument("--seqlens", nargs="+", type=int, help="sequence lengths N")
    parser.add_argument("--causal", choices=["off", "on", "both"], default="both")
    parser.add_argument("--providers", nargs="+", choices=sorted({p.key for p in GPU_PROVIDERS + CPU_PROVIDERS}),
                        help="default: all of the device's providers")
    parser.add_argument("--budget", type=float, help="seconds of timed calls per cell (default 0.15, CPU 0.05)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds over the providers per cell, alternating their order (default 2)")
    parser.add_argument("--time-limit", type=float, default=200,
                        help="seconds after which no new row starts (default 200); the memory table still runs")
    parser.add_argument("--dropout", nargs="+", type=float, default=[0.0],
                        help="dropout_p values, each row measured once per value (default 0)")
    parser.add_argument("--dropout-bits", type=int, choices=[8, 16], default=8,
                        help="bits of flashattn_ext's dropout numbers (flashattn_ext.set_dropout_bits; default 8)")
    parser.add_argument("--masks", nargs="+", choices=MASKS, default=["none"],
                        help="attn_mask kinds, each non-causal row measured once per kind (default none)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory table")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "training")
    return parser.parse_args(argv)


def resolve(args) -> Setup:
    """Fill the defaults the device and --quick imply; return the device's setup."""
    setup = GPU if args.device == "cuda" else CPU
    quick = QUICK if args.quick else {}
    args.dtypes = args.dtypes or quick.get("dtypes", list(DTYPES))
    args.dims = args.dims or quick.get("dims", list(setup.dims))
    args.seqlens = args.seqlens or quick.get("seqlens", list(setup.seqlens))
    args.causal = {"off": [False], "on": [True], "both": [False, True]}[args.causal]
    if args.rounds < 1:
        sys.exit("--rounds must be at least 1")
    return replace(setup, memory_seqlens=() if args.no_memory else setup.memory_seqlens,
                   budget_s=args.budget or setup.budget_s, rounds=args.rounds)


def main(argv=None) -> int:
    args = parse_args(argv)
    setup = resolve(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device; use --device cpu for the smoke test")
    device = torch.device(args.device)
    torch.manual_seed(0)
    set_dropout_bits(args.dropout_bits)
    today = datetime.date.today().isoformat()
    report = new_report(args, setup, device, today)
    if not report.providers:
        sys.exit(f"none of --providers {' '.join(args.providers)} runs on {args.device}")
    args.out.mkdir(parents=True, exist_ok=True)
    variant_part = ("-dropout" if report.dropout_column else "") + ("-masks" if report.mask_column else "")
    md_path = args.out / f"bench_{today}_{device_slug(device, args.quick)}{variant_part}.md"
    print(f"# {report.title}\n\n" + "\n".join(report.header), flush=True)

    status = 0
    try:
        run_grid(report, setup, args, device, md_path)
        if setup.memory_seqlens:
            measure_memory(report, setup, device)
    except CudaContextLost as error:
        report.notes["CUDA context lost"] = f"{error}; the run stopped here. Rerun without that provider."
        status = 1
    md_path.write_text(markdown(report))
    written = [md_path]
    stamp = f"{device_name(device)}, torch {torch.__version__}, cuDNN {cudnn_version()}, {today}"
    if plot(report, md_path.with_suffix(".png"), stamp):
        written.append(md_path.with_suffix(".png"))
    if report.notes:
        print("\n" + "\n".join(notes_lines(report)), flush=True)
    print("\nwrote " + " and ".join(map(str, written)), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
