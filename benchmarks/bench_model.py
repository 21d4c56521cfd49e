"""Model-level benchmark: training steps of a small Llama-style decoder, stock SDPA against flashattn_ext.

The model lives in this file: token embedding, pre-norm blocks (RMSNorm, causal attention with
rotary embeddings and n_kv_heads for GQA, SwiGLU MLP), final RMSNorm, LM head, cross-entropy on
random token ids. Attention is a function the model calls with q, k, v shaped (B, H, N, D) and
is_causal=True, enable_gqa=(n_kv_heads < n_heads): torch.nn.functional.scaled_dot_product_attention
(torch picks its backend) or flashattn_ext.scaled_dot_product_attention. Nothing else differs.

For each configuration both providers start from the same weights (deep copies of one model) and
see the same batches. A training step is forward + backward + AdamW (foreach) step + zero_grad, with
the model in bf16 (fp32 on CPU). Step time is the median of --steps timed steps after 3 warm-up steps
(CUDA events; time.perf_counter on CPU); the losses of the first 3 steps are listed side by side and
must agree to the dtype's tolerance (otherwise the exit status is 1). Peak memory is
torch.cuda.max_memory_allocated over the provider's whole run (weights, gradients, AdamW state and
activations), reset per provider. B = --tokens // N, so every step sees the same number of tokens.

Results go to <out>/model_<date>_<device>.md, and each table row is printed as soon as it is measured.

Usage (from the repository root):
    python3 benchmarks/bench_model.py                 # MHA 16:16 and GQA 16:4 at N in {2048, 8192}
    python3 benchmarks/bench_model.py --quick         # the same grid with 2 layers and 5 timed steps
    python3 benchmarks/bench_model.py --seqlens 8192 --kv-heads 4 --layers 8
    python3 benchmarks/bench_model.py --quick --profile --out /tmp/prof   # + a kernel table per provider
    python3 benchmarks/bench_model.py --device cpu --seqlens 128 --layers 1 --d-model 256 --heads 4 --kv-heads 2
"""
import argparse
import copy
import datetime
import gc
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

sys.path.insert(0, str(Path(__file__).resolve().parent))
# (bench_attention also puts REPO on sys.path; its ext_attention raises the import error if the ext is missing)
from bench_attention import REPO, cudnn_version, device_name, device_slug, ext_attention, git_commit  # noqa: E402

PROVIDERS = {"SDPA": F.scaled_dot_product_attention, "flashattn_ext": ext_attention}
WARMUP_STEPS, LOSS_STEPS = 3, 3
DASH = "—"
GPU_DEFAULTS = dict(d_model=2048, heads=16, kv_heads=[16, 4], seqlens=[2048, 8192], layers=4, vocab=32000,
                    tokens=16384, steps=10)
CPU_DEFAULTS = dict(d_model=256, heads=4, kv_heads=[4, 2], seqlens=[128], layers=1, vocab=4096, tokens=256, steps=3)


# ----------------------------------------------------------------------------- model

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotary(n: int, d: int, device, dtype, theta: float = 10000.0):
    """cos and sin, each (N, D), for rotate-half rotary embeddings."""
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
    angles = torch.outer(torch.arange(n, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d_model // heads
        hidden = 256 * ((8 * d_model // 3 + 255) // 256)  # Llama's SwiGLU width, rounded up to 256
        self.attn_norm, self.mlp_norm = RMSNorm(d_model), RMSNorm(d_model)
        self.wq = nn.Linear(d_model, heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(d_model, 2 * kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, d_model, bias=False)
        self.w_gate_up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.w_down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x, cos, sin, attention: Callable):
        b, n, _ = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.wkv(h).view(b, n, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads < self.heads)
        x = x + self.wo(out.transpose(1, 2).reshape(b, n, -1))
        gate, up = self.w_gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.w_down(F.silu(gate) * up)


class Decoder(nn.Module):
    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, kv_heads: int):
        super().__init__()
        self.attention: Callable = F.scaled_dot_product_attention  # set per provider
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads, kv_heads) for _ in range(layers))
        self.norm = RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        for name, param in self.named_parameters():
            if param.dim() == 2:
                nn.init.normal_(param, std=0.02 / (2 * layers) ** 0.5 if name.endswith(("wo.weight", "w_down.weight"))
                                else 0.02)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        cos, sin = rotary(tokens.shape[1], self.blocks[0].head_dim, x.device, x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin, self.attention)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# ----------------------------------------------------------------------------- measuring

def sdpa_backend(args, n: int, kv_heads: int, device) -> str:
    """The backend stock SDPA picks for the model's attention call (torch's private chooser)."""
    d, dtype = args.d_model // args.heads, args.dtype
    q = torch.empty(1, args.heads, n, d, device=device, dtype=dtype)
    k = torch.empty(1, kv_heads, n, d, device=device, dtype=dtype)
    try:
        return SDPBackend(torch._fused_sdp_choice(q, k, k, is_causal=True, enable_gqa=kv_heads < args.heads)).name
    except Exception:  # noqa: BLE001 - only a note
        return "unknown"


def train(model: Decoder, batches: List[torch.Tensor], device, profile_path: Optional[Path] = None,
          profile_title: str = "") -> Dict:
    """Train on the batches: losses of the first steps, median step seconds of the timed ones, peak MiB.

    With profile_path, two more steps run under torch.profiler afterwards, and its table of GPU kernels
    (CPU ops on the CPU; by self time, both steps together) is appended there under profile_title."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)

    def step(tokens):
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    losses = [step(tokens).item() for tokens in batches[:WARMUP_STEPS]]
    times = []
    for tokens in batches[WARMUP_STEPS:]:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(tokens)
            end.record()
            times.append((start, end))
        else:
            start = time.perf_counter()
            step(tokens)
            times.append(time.perf_counter() - start)
    if device.type == "cuda":
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) / 1e3 for start, end in times]
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = None
    if profile_path is not None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as profiler:
            for tokens in batches[-2:]:
                step(tokens)
            if device.type == "cuda":
                torch.cuda.synchronize()
        sort_by = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        with profile_path.open("a") as file:
            file.write(f"\n## {profile_title}\n\n")
            file.write(profiler.key_averages().table(sort_by=sort_by, row_limit=40, max_name_column_width=110))
    return dict(losses=losses[:LOSS_STEPS], seconds=statistics.median(times), peak=peak)


def measure_row(args, base: Decoder, n: int, device, notes: Dict[str, str]) -> Dict:
    b = max(1, args.tokens // n)
    generator = torch.Generator().manual_seed(1234)
    batches = [torch.randint(args.vocab, (b, n + 1), generator=generator).to(device)
               for _ in range(WARMUP_STEPS + args.steps)]
    row = dict(config=f"{'MHA' if base.blocks[0].kv_heads == args.heads else 'GQA'} "
                      f"{args.heads}:{base.blocks[0].kv_heads}", n=n, b=b, results={})
    for label, attention in PROVIDERS.items():
        model = copy.deepcopy(base).to(device=device, dtype=args.dtype)
        model.attention = attention
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            row["results"][label] = train(model, batches, device, args.profile_path,
                                          f"{label}, {row['config']}, N={n}, B={b}")
        except Exception as error:  # noqa: BLE001 - a failing provider is one row of "—"
            row["results"][label] = None
            first_line = (str(error).strip().splitlines() or [""])[0][:300]
            notes.setdefault(label, f"{type(error).__name__}: {first_line}")
            print(f"  [{label}] {notes[label]}", file=sys.stderr, flush=True)
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    notes[f"SDPA backend, {row['config']}, N={n}"] = sdpa_backend(args, n, base.blocks[0].kv_heads, device)
    return row


def today() -> str:
    return datetime.datetime.now(datetime.timezone.utc).date().isoformat()


def losses_agree(row: Dict, rtol: float) -> Optional[bool]:
    ours, theirs = row["results"]["flashattn_ext"], row["results"]["SDPA"]
    if ours is None or theirs is None:
        return None
    return all(abs(a - b) <= rtol * max(1.0, abs(b)) for a, b in zip(ours["losses"], theirs["losses"]))


# ----------------------------------------------------------------------------- markdown

COLUMNS = ["config", "N", "B", "SDPA step ms", "flashattn_ext step ms", "ratio", "SDPA peak MiB", "ours peak MiB",
           f"loss step 1..{LOSS_STEPS} SDPA vs ours"]


def table_head() -> List[str]:
    return ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]


def table_line(row: Dict, rtol: float) -> str:
    sdpa, ours = row["results"]["SDPA"], row["results"]["flashattn_ext"]
    ms = lambda r: DASH if r is None else f"{r['seconds'] * 1e3:.1f}"  # noqa: E731
    mib = lambda r: DASH if r is None or r["peak"] is None else f"{r['peak']:.0f}"  # noqa: E731
    ratio = DASH if sdpa is None or ours is None else f"{ours['seconds'] / sdpa['seconds']:.3f}"
    if sdpa is None or ours is None:
        losses = " ; ".join(f"{loss:.4f}" for loss in (sdpa or ours or {"losses": []})["losses"]) or DASH
    else:
        losses = " ; ".join(f"{a:.4f} vs {b:.4f}" for a, b in zip(sdpa["losses"], ours["losses"]))
        losses += "" if losses_agree(row, rtol) else " **MISMATCH**"
    cells = [row["config"], str(row["n"]), str(row["b"]), ms(sdpa), ms(ours), ratio, mib(sdpa), mib(ours), losses]
    return "| " + " | ".join(cells) + " |"


def markdown(title: str, header: List[str], rows: List[Dict], notes: Dict[str, str], rtol: float) -> str:
    lines = [f"# {title}", "", *header, "", *table_head(), *(table_line(row, rtol) for row in rows)]
    if notes:
        lines += ["", "## Failures and notes", "", *(f"- {label}: `{message}`" for label, message in notes.items())]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- run

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--quick", action="store_true", help="2 layers and 5 timed steps")
    parser.add_argument("--seqlens", nargs="+", type=int, help="sequence lengths N (default 2048 8192; CPU 128)")
    parser.add_argument("--layers", type=int, help="decoder blocks (default 4; CPU 1)")
    parser.add_argument("--steps", type=int, help="timed steps after the warm-up (default 10; CPU 3)")
    parser.add_argument("--d-model", type=int, help="model width (default 2048; CPU 256)")
    parser.add_argument("--heads", type=int, help="query heads; head_dim = d_model / heads (default 16; CPU 4)")
    parser.add_argument("--kv-heads", nargs="+", type=int,
                        help="key/value heads, one config each (default 16 4; CPU 4 2)")
    parser.add_argument("--vocab", type=int, help="vocabulary size (default 32000; CPU 4096)")
    parser.add_argument("--tokens", type=int, help="tokens per step, B = tokens // N (default 16384; CPU 256)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "training")
    parser.add_argument("--profile", action="store_true",
                        help="after the timed steps, profile two more; every provider's kernel table goes to one file in --out")
    args = parser.parse_args(argv)
    defaults = dict(GPU_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS)
    if args.quick:
        defaults.update(layers=2, steps=5)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.d_model % args.heads or any(args.heads % kv for kv in args.kv_heads):
        parser.error("--d-model must be a multiple of --heads, and --heads of every --kv-heads")
    args.dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device; use --device cpu for the smoke test")
    device = torch.device(args.device)
    rtol = 2e-2 if args.dtype == torch.bfloat16 else 1e-3
    timing = "CUDA events" if device.type == "cuda" else "time.perf_counter, tiny smoke-test sizes"
    header = [
        f"Measured {today()} (UTC) on one {device_name(device)} (torch {torch.__version__}, cuDNN {cudnn_version()}), "
        f"flashattn_ext at commit {git_commit()}.",
        f"Command: `{' '.join(shlex.quote(arg) for arg in ['python3', *sys.argv])}`",
        "",
        f"Llama-style decoder: {args.layers} layers, d_model {args.d_model}, {args.heads} query heads of dim "
        f"{args.d_model // args.heads}, rotary embeddings, SwiGLU MLP, vocab {args.vocab}, weights in "
        f"{str(args.dtype).removeprefix('torch.')}, AdamW (foreach), "
        f"{args.tokens} tokens per step (B = {args.tokens} // N).",
        f"Step time is the median of {args.steps} timed training steps ({timing}) after {WARMUP_STEPS} warm-up steps; "
        "both providers start from the same weights and see the same random batches. "
        "Ratio = flashattn_ext / SDPA (at most 1: ours is no slower). Peak MiB is torch.cuda.max_memory_allocated "
        "over the provider's run, weights, gradients and optimizer state included. "
        f"Losses are those of the first {LOSS_STEPS} (warm-up) steps; **MISMATCH** marks a relative difference "
        f"above {rtol:g}. SDPA is torch's default dispatch; the backend it picks is listed under the table.",
    ]
    title = "Model training step: flashattn_ext against torch SDPA"
    args.out.mkdir(parents=True, exist_ok=True)
    md_path = args.out / f"model_{today()}_{device_slug(device, args.quick)}.md"
    args.profile_path = args.out / f"model_profile_{today()}_{device_slug(device, args.quick)}.txt" if args.profile else None
    if args.profile_path is not None:
        args.profile_path.write_text(f"# {title}: profiles\n")
    print(f"# {title}\n\n" + "\n".join(header) + "\n", flush=True)
    for line in table_head():
        print(line, flush=True)

    rows: List[Dict] = []
    notes: Dict[str, str] = {}
    for kv_heads in args.kv_heads:
        torch.manual_seed(0)
        base = Decoder(args.vocab, args.d_model, args.layers, args.heads, kv_heads)  # fp32 on the CPU
        for n in args.seqlens:
            rows.append(measure_row(args, base, n, device, notes))
            print(table_line(rows[-1], rtol), flush=True)
            md_path.write_text(markdown(title, header, rows, notes, rtol))
        del base
    md_path.write_text(markdown(title, header, rows, notes, rtol))
    if notes:
        print("\n## Failures and notes\n\n" + "\n".join(f"- {k}: `{v}`" for k, v in notes.items()), flush=True)
    print(f"\nwrote {md_path}", flush=True)
    return 1 if any(losses_agree(row, rtol) is False for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
