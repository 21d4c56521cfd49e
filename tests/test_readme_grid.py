"""README.md's support grid ("What runs where") against the routing table (csrc/cuda/route.h, asked
through flashattn_ext.kernel_route): each cell the table decides is read as a claim about the calls
ROW_CALLS lists for its row, and each claim is checked against the family the table names for the call on
the column's kernel path. The CPU column runs anywhere; the Hopper and Ampere columns need a GPU.

Not checked here: the ATen fallback's column (the table sends it every call on request, whatever the
cell), the decode kernels' column (its cells describe decode_attention, an op the table does not route,
as much as the SDPA calls the table sends there), and the rows of attention sinks, packed batches and
double backward (kernel_route takes no sinks and no packed batch; double backward is never routed)."""
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

import pytest
import torch

import flashattn_ext
from helpers import deterministic_algorithms, on_paths

README = Path(__file__).resolve().parent.parent / "README.md"

# The grid's columns by the kernel path that runs them; kernel_route names each path's family as the path.
COLUMN_OF_PATH = {"cpu": "CPU", "sm90": "Hopper (H100, H200)", "sm80": "Ampere and newer"}
FOOTNOTE_MARKS = re.compile("[¹²³⁴⁵⁶⁷⁸⁹]")


def read_grid(text):
    """{row: {column: cell}} of the table under "## What runs where", footnote marks dropped."""
    section = text.split("## What runs where", 1)[1]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    split = lambda line: [cell.strip() for cell in line.strip("|").split("|")]  # noqa: E731
    columns = split(lines[0])[1:]
    grid = {}
    for line in lines[2:]:  # (after the header and its |---| line)
        label, *cells = split(line)
        grid[label] = {column: FOOTNOTE_MARKS.sub("", cell).strip() for column, cell in zip(columns, cells)}
    return grid


@dataclass(frozen=True)
class Call:
    """One attention call as kernel_route sees it: batch 2, 4 query heads (2 key/value heads with GQA), 128
    queries and 128 keys (no decoding step's shape), in dtype at head_dim (head_dim_v for the values)."""

    dtype: torch.dtype = torch.bfloat16
    head_dim: int = 64
    head_dim_v: Optional[int] = None
    enable_gqa: bool = False
    is_causal: bool = False
    causal_lower_right: bool = False
    mask: Optional[str] = None  # "bool" or "float"
    dropout_p: float = 0.0
    window: Optional[tuple] = None
    softcap: Optional[float] = None
    alibi: bool = False
    backward: bool = False
    deterministic: bool = False

    def __str__(self):
        changed = (f"{f.name}={getattr(self, f.name)}" for f in fields(self) if getattr(self, f.name) != f.default)
        return f"Call({', '.join(changed)})"


# The calls that decide each row's cells.
ROW_CALLS = {
    "dtypes": [Call(dtype=dtype) for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16)],
    "head dims": [Call(head_dim=dim, backward=backward) for dim in (8, 36, 64, 200, 256, 264)
                  for backward in (False, True)] + [Call(head_dim=64, head_dim_v=32)],
    "forward, backward": [Call(), Call(backward=True)],
    "causal (either alignment), GQA": [Call(is_causal=True), Call(is_causal=True, causal_lower_right=True),
                                       Call(enable_gqa=True), Call(enable_gqa=True, is_causal=True, backward=True)],
    "bool or float `attn_mask`": [Call(mask=kind, head_dim=dim, backward=backward) for kind in ("bool", "float")
                                  for dim in (64, 128, 256) for backward in (False, True)],
    "dropout": [Call(dropout_p=0.1), Call(dropout_p=0.1, backward=True), Call(dropout_p=0.1, head_dim=256)],
    "sliding window": [Call(window=(32, 0), is_causal=True), Call(window=(32, 8), backward=True)],
    "softcap, ALiBi": [Call(softcap=30.0), Call(softcap=30.0, backward=True), Call(alibi=True),
                       Call(alibi=True, is_causal=True, backward=True), Call(softcap=30.0, mask="bool"),
                       Call(softcap=30.0, dropout_p=0.1), Call(alibi=True, mask="float"),
                       Call(alibi=True, dropout_p=0.1)],
    "deterministic backward": [Call(backward=True, deterministic=True),
                               Call(backward=True, deterministic=True, mask="bool", dropout_p=0.1),
                               Call(backward=True, deterministic=True, head_dim=256),
                               Call(backward=True, deterministic=True, is_causal=True, enable_gqa=True)],
}

# How the words of a cell read. A ✓ cell's words say which of the row's calls the path takes (the rest go
# elsewhere); a ✗ cell's say where the calls go instead (no words: anywhere else).
DTYPE_NAMES = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
TAKES_WHEN = {
    "": lambda call: True,
    "always": lambda call: True,
    "a separate dQ pass": lambda call: True,
    "up to D=128": lambda call: call.head_dim <= 128,
    "up to D=128, no mask": lambda call: call.head_dim <= 128 and call.mask is None,
    "no mask, no dropout": lambda call: call.mask is None and call.dropout_p == 0.0,
}
SENT_TO = {"ATen": "aten", "Ampere's": "sm80"}
HEAD_DIM_TERMS = [
    (r"any", lambda call, limit: True),
    (r"up to (\d+)", lambda call, limit: call.head_dim <= limit),
    (r"multiples of 8 up to (\d+)", lambda call, limit: call.head_dim % 8 == 0 and call.head_dim <= limit),
    (r"`Ev == E`", lambda call, limit: call.head_dim_v in (None, call.head_dim)),
]


def unreadable(cell):
    return AssertionError(f"no reading of the grid's cell {cell!r}: teach test_readme_grid.py its words")


def claim(row, cell, call):
    """What the cell says of call: True (the column's kernels take it), False (they leave it), or the
    family the cell sends it to."""
    if row == "dtypes":
        if cell != "all" and not set(cell.split(", ")) <= set(DTYPE_NAMES.values()):
            raise unreadable(cell)
        return cell == "all" or DTYPE_NAMES[call.dtype] in cell.split(", ")
    if row == "head dims":
        return all(head_dim_term_holds(term, call) for term in cell.split(", "))
    if row == "forward, backward":  # a mark a pass
        forward_mark, backward_mark = cell.split()
        return mark_claim(backward_mark if call.backward else forward_mark, call)
    return mark_claim(cell, call)


def head_dim_term_holds(term, call):
    for pattern, holds in HEAD_DIM_TERMS:
        match = re.fullmatch(pattern, term)
        if match:
            return holds(call, int(match.group(1)) if match.groups() else None)
    raise unreadable(term)


def mark_claim(cell, call):
    mark, words = cell[:1], cell[1:].strip()
    if mark == "✓" and words in TAKES_WHEN:
        return TAKES_WHEN[words](call)
    destination = words.removeprefix("→ ")
    if mark == "✗" and (not words or destination in SENT_TO):
        return SENT_TO[destination] if words else False
    raise unreadable(cell)


def route(call, device):
    """(family, reason) of kernel_route for call on device."""
    gen = torch.Generator().manual_seed(0)
    heads_kv, length = (2 if call.enable_gqa else 4), 128

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device, call.dtype)

    q, k = randn(2, 4, length, call.head_dim), randn(2, heads_kv, length, call.head_dim)
    v = randn(2, heads_kv, length, call.head_dim_v or call.head_dim)
    attn_mask = None
    if call.mask == "bool":
        attn_mask = (torch.rand(length, length, generator=gen) > 0.2).to(device)
    elif call.mask == "float":
        attn_mask = randn(length, length)
    options = dict(enable_gqa=call.enable_gqa, is_causal=call.is_causal, causal_lower_right=call.causal_lower_right,
                   attn_mask=attn_mask, dropout_p=call.dropout_p, window=call.window, softcap=call.softcap,
                   alibi_slopes=torch.rand(4, generator=gen).to(device) if call.alibi else None)
    with deterministic_algorithms(call.deterministic):
        return flashattn_ext.kernel_route(q, k, v, backward=call.backward, **options)


GRID = read_grid(README.read_text(encoding="utf-8"))


def test_every_checked_cell_is_in_the_grid_and_readable():
    """Runs without a GPU: the grid has the rows and columns checked, and each of their cells reads as a
    claim about every call of its row."""
    for row, calls in ROW_CALLS.items():
        assert row in GRID, f"README's grid has no row {row!r}"
        for column in COLUMN_OF_PATH.values():
            assert column in GRID[row], f"README's grid has no column {column!r}"
            for call in calls:
                claim(row, GRID[row][column], call)


@on_paths("cpu", "sm90", "sm80")
@pytest.mark.parametrize("row", list(ROW_CALLS))
def test_grid_cell_matches_the_routing_table(path, row, monkeypatch):
    if path.name == "cpu":
        monkeypatch.delenv("FLASHATTN_EXT_KERNELS", raising=False)  # (.ci/run runs the tests again with =aten)
    column = COLUMN_OF_PATH[path.name]
    cell = GRID[row][column]
    for call in ROW_CALLS[row]:
        said = claim(row, cell, call)
        family, reason = route(call, path.device)
        context = f"README's {column!r} cell of {row!r}, {cell!r}, for {call}: the routing table says {family} " \
                  f"({reason})"
        if said is True:
            assert family == path.name, context
        elif said is False:
            assert family != path.name, context
        else:
            assert family == said, context
