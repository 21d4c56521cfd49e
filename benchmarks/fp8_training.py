"""Training with FP8 attention (issue 47, item 2's loss-curve bar): a small Llama-style decoder (bench_model.py's,
head dim 128; float32 weights, bfloat16 autocast on CUDA, gradients clipped to norm 1) learns Python source text
byte by byte for --steps steps, three times from the same weights on the same batches, changing only the
attention, which takes q, k and v in bfloat16:

- "bf16": flashattn_ext.scaled_dot_product_attention, the reference curve;
- "fp8": flashattn_ext.fp8.scaled_dot_product_attention_fp8 on the bfloat16 q, k, v: quantized to e4m3 per
  (sequence, key/value head), the e4m3 forward (on a Hopper GPU, its kernel), gradients straight through;
- "SDPA": torch.nn.functional.scaled_dot_product_attention, another bfloat16 kernel: how far two 16-bit
  attentions' curves drift apart anyway.

The text is the running Python's standard library (.py files in sorted order, up to --corpus-mb), so it needs no
download. The loss reported a step is the mean of the last --window steps' losses (each step sees a new batch),
averaged over --seeds (each seed: other initial weights and batches); the table gives it every --every steps,
and for each seed and for the averaged curves the largest and the mean relative gap of each curve to bf16's
after the first window, and that of the last 50 steps' mean loss. The bar: the fp8 curve within 1% of bf16's
over 200 steps; SDPA's curve shows how far another 16-bit attention strays by chance (two curves that differ
in rounding drift apart, and the GPU backwards' atomic dQ makes a seed's curve differ run to run unless
--deterministic).

    python3 benchmarks/fp8_training.py [--steps 200] [--seeds 0 1 2] [--deterministic] [--out FILE]
    python3 benchmarks/fp8_training.py --device cpu --steps 30 --layers 1 --d-model 256 --seq 128 --batch 4
"""
import argparse
import copy
import datetime
import os
import sys
import sysconfig
from pathlib import Path
from typing import Dict

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import device_name, git_commit  # noqa: E402  (also puts this checkout first on sys.path)
from bench_model import Decoder  # noqa: E402
import flashattn_ext  # noqa: E402
from flashattn_ext.fp8 import scaled_dot_product_attention_fp8  # noqa: E402


def in_bfloat16(attention):
    """attention(q, k, v, is_causal, enable_gqa) on q, k, v in bfloat16 (autocast leaves the rotated q and k in
    float32), its out in v's dtype (bfloat16 under autocast)."""
    def call(q, k, v, is_causal, enable_gqa):
        dtype = v.dtype
        q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
        return attention(q, k, v, is_causal=is_causal, enable_gqa=enable_gqa).to(dtype)
    return call


def fp8_attention(q, k, v, is_causal, enable_gqa):
    return scaled_dot_product_attention_fp8(q, k, v, is_causal=is_causal)  # (GQA needs no flag here)


PROVIDERS = {"bf16": in_bfloat16(flashattn_ext.scaled_dot_product_attention), "fp8": in_bfloat16(fp8_attention),
             "SDPA": in_bfloat16(F.scaled_dot_product_attention)}


def corpus(megabytes: float) -> torch.Tensor:
    """The standard library's .py files, in sorted order, as bytes (token ids 0-255), up to megabytes."""
    limit, chunks, size = int(megabytes * 2**20), [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if size >= limit:
            break
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


def train(model: Decoder, text: torch.Tensor, args, seed: int, device) -> list:
    """Each step's loss: a batch of args.batch windows of args.seq + 1 bytes at offsets drawn from one seeded
    generator (the same batches for every provider), forward, backward, AdamW."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, foreach=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / args.warmup))
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(args.steps):
        starts = torch.randint(0, text.numel() - args.seq - 1, (args.batch,), generator=gen)
        windows = torch.stack([text[s:s + args.seq + 1] for s in starts.tolist()]).to(device)
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(windows[:, :-1], windows[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses).float().cpu().tolist()


def smoothed(losses: list, window: int) -> list:
    return [sum(losses[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(losses))]


def curves_of_seed(seed: int, text: torch.Tensor, args, device) -> Dict[str, list]:
    """Each provider's smoothed loss curve, from the same initial weights (drawn from seed) and batches."""
    heads = args.d_model // 128
    torch.manual_seed(seed)
    base = Decoder(256, args.d_model, args.layers, heads, args.kv_heads or heads).to(device)
    curves = {}
    for name, attention in PROVIDERS.items():
        model = copy.deepcopy(base)
        model.attention = attention
        curves[name] = smoothed(train(model, text, args, seed, device), args.window)
        print(f"seed {seed}, {name}: loss {curves[name][0]:.4f} -> {curves[name][-1]:.4f}", flush=True)
    return curves


def gaps_to_bf16(curves: Dict[str, list], args) -> str:
    """Each other curve's largest and mean relative gap to bf16's after the first window, and that of its
    last 50 steps' mean loss."""
    reference, tail = curves["bf16"], min(50, args.steps)
    cells = []
    for name, curve in curves.items():
        if name == "bf16":
            continue
        ratios = [c / r - 1 for c, r in zip(curve[args.window:], reference[args.window:])]
        tail_gap = sum(curve[-tail:]) / sum(reference[-tail:]) - 1
        cells.append(f"{name} {max(map(abs, ratios)):.2%} / {sum(map(abs, ratios)) / len(ratios):.2%} / "
                     f"{tail_gap:+.2%}")
    return ", ".join(cells)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=1024, help="a multiple of 128: heads of dim 128")
    parser.add_argument("--kv-heads", type=int, default=None, help="default: the query heads' count (MHA)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="each: initial weights and batches")
    parser.add_argument("--deterministic", action="store_true",
                        help="torch.use_deterministic_algorithms (warn only): a seed's curves repeat run to run")
    parser.add_argument("--corpus-mb", type=float, default=16.0)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--out", type=Path)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # (before cuBLAS starts: its deterministic mode)
        torch.use_deterministic_algorithms(True, warn_only=True)
    device = torch.device(args.device)
    heads = args.d_model // 128
    text = corpus(args.corpus_mb)
    runs = {seed: curves_of_seed(seed, text, args, device) for seed in args.seeds}
    mean = {name: [sum(values) / len(runs) for values in zip(*(run[name] for run in runs.values()))]
            for name in PROVIDERS}
    reference = mean["bf16"]
    steps = sorted(set(range(args.every - 1, args.steps, args.every)) | {args.steps - 1})
    lines = [
        f"# FP8 attention in training, {datetime.date.today().isoformat()}, {device_name(device)}",
        "",
        f"`python3 benchmarks/fp8_training.py {' '.join(sys.argv[1:])}` at {git_commit()}: {args.layers} layers, "
        f"d_model {args.d_model} ({heads} query heads, {args.kv_heads or heads} key/value heads, dim 128), "
        f"{args.seq} bytes x {args.batch} a step, {'bfloat16 autocast' if device.type == 'cuda' else 'float32'}, "
        f"AdamW lr {args.lr} (warm-up {args.warmup} steps), standard-library Python text"
        f"{', deterministic algorithms' if args.deterministic else ''}. Loss: mean of the last {args.window} steps, "
        f"averaged over seeds {', '.join(map(str, args.seeds))}.",
        "",
        "| step | " + " | ".join(PROVIDERS) + " | fp8 / bf16 | SDPA / bf16 |",
        "|---:|" + "---:|" * (len(PROVIDERS) + 2),
    ]
    for i in steps:
        cells = [f"{mean[name][i]:.4f}" for name in PROVIDERS]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + f" | {mean['fp8'][i] / reference[i]:.4f} | "
                     f"{mean['SDPA'][i] / reference[i]:.4f} |")
    lines += ["", f"Gaps to bf16's curve after step {args.window} (largest / mean / of the last "
              f"{min(50, args.steps)} steps' mean loss):", ""]
    lines += [f"- seed {seed}: {gaps_to_bf16(run, args)}" for seed, run in runs.items()]
    if len(runs) > 1:
        lines.append(f"- the curves averaged over the seeds: {gaps_to_bf16(mean, args)}")
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
