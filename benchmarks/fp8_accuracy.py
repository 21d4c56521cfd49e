"""FP8 attention's error against float64 (issue 47, item 2's accuracy bar): how the quantization method moves
it, on the inputs FA3's paper uses for this (entries N(0, 1), plus N(0, 100) on 0.1% of them: outliers).

Methods: bf16 attention; FP8 with one descale a tensor (FA3's baseline), one a (sequence, key/value head)
(torch's PER_HEAD), one a block of 128 rows (flashattn_ext.fp8.quantize_fp8(per_block=True)), each also with
queries and keys rotated by a random Hadamard matrix first (flashattn_ext.fp8.hadamard_rotation: FA3's
incoherent processing), and with the values rotated too (the output rotated back: O (V R) R^T = O V). Two errors a method:
- "op": flashattn_ext.scaled_dot_product_attention_fp8 on --device. On the CPU it computes in float32 on the
  inputs dequantized: the error of the inputs' quantization alone (and the output's bfloat16 rounding). On a
  Hopper GPU, descales a tensor or a (sequence, head) at head dim 128 run the e4m3 kernel (P in e4m3 as
  emulated next), block descales the inputs dequantized to bfloat16, then the bfloat16 forward;
- "P in e4m3": the same inputs, with the probabilities also cast to e4m3 before P V (times 256 first, as
  FA3/FA4 do; each row's max known, as an online softmax's final max), in float64: what a kernel whose
  tensor cores take e4m3 P adds.
The error is the root-mean-square of (out - float64 out) over the output, as FA3 reports it.

    python3 benchmarks/fp8_accuracy.py [--length 2048] [--heads 4] [--dim 128] [--device cuda] [--out FILE]
"""
import argparse
import math
from pathlib import Path

import torch

import bench_timing  # noqa: F401  (puts this checkout first on sys.path)
import flashattn_ext
from flashattn_ext.fp8 import E4M3_MAX, hadamard_rotation, quantize_fp8

P_SCALE = 256.0


def outlier_inputs(batch, heads, length, dim, gen):
    """FA3's test inputs: N(0, 1) entries, plus N(0, 100) on a Bernoulli(0.001) share of them."""
    def one():
        base = torch.randn(batch, heads, length, dim, generator=gen, dtype=torch.float64)
        outliers = torch.randn(batch, heads, length, dim, generator=gen, dtype=torch.float64) * 10
        return base + outliers * (torch.rand(batch, heads, length, dim, generator=gen) < 0.001)
    return one(), one(), one()


def per_tensor(x):
    """x quantized with one descale for the whole tensor, as (N, H) descales of that value."""
    descale = (x.abs().amax() / E4M3_MAX).float()
    return (x / descale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), descale.expand(x.shape[:2]).clone()


def dequantized(x8, descale):
    rows = descale.double() if descale.dim() == 2 else descale.double().repeat_interleave(128, dim=2)
    rows = rows[:, :, None, None] if descale.dim() == 2 else rows[:, :, : x8.shape[2], None]
    return x8.double() * rows


def attention_p_in_e4m3(q, k, v, scale):
    """softmax(q k^T scale) v in float64, with the unnormalized probabilities (row max subtracted) cast to
    e4m3 at P_SCALE before P V; the row sums from the uncast ones, as a kernel keeps them in float32."""
    scores = q @ k.transpose(-1, -2) * scale
    p = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    p8 = (p * P_SCALE).to(torch.float8_e4m3fn).double() / P_SCALE
    return (p8 @ v) / p.sum(dim=-1, keepdim=True)


def rms(x):
    return x.pow(2).mean().sqrt().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where the op runs (the reference stays on the CPU)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    q, k, v = outlier_inputs(1, args.heads, args.length, args.dim, gen)
    scale = 1 / math.sqrt(args.dim)
    want = torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1) @ v
    device = torch.device(args.device)
    bf16 = flashattn_ext.scaled_dot_product_attention(*(x.bfloat16().to(device) for x in (q, k, v))).cpu().double()
    rotation = hadamard_rotation(args.dim, generator=gen).double()

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [f"# FP8 attention's error against float64 ({where}, torch {torch.__version__})", "",
             f"B = 1, H = {args.heads}, L = {args.length}, D = {args.dim}, not causal; inputs N(0, 1) + "
             f"N(0, 100) x Bernoulli(0.001); seed {args.seed}. RMS of (out - float64 out); ratio: to FP8 with "
             "one descale a tensor (the same column).", "",
             f"bf16 attention: {rms(bf16 - want):.2e}", "",
             "| FP8 method | op (inputs quantized) | ratio | P in e4m3 too (emulated) | ratio |",
             "|---|---|---|---|---|"]
    methods = {"one descale a tensor": per_tensor,
               "one a (sequence, head) (torch's)": quantize_fp8,
               "one a block of 128 rows": lambda x: quantize_fp8(x, per_block=True)}
    baseline = None
    rotations = {"": (False, False), ", Hadamard-rotated q and k": (True, False),
                 ", Hadamard-rotated q, k and v (out rotated back)": (True, True)}
    for suffix, (rotate_qk, rotate_v) in rotations.items():
        for name, quantize in methods.items():
            q_in, k_in = (q @ rotation, k @ rotation) if rotate_qk else (q, k)
            v_in = v @ rotation if rotate_v else v
            (q8, qd), (k8, kd), (v8, vd) = (quantize(x) for x in (q_in, k_in, v_in))
            op = flashattn_ext.scaled_dot_product_attention_fp8(
                q8.to(device), k8.to(device), v8.to(device), q_descale=qd.to(device), k_descale=kd.to(device),
                v_descale=vd.to(device)).cpu().double()
            emulated = attention_p_in_e4m3(dequantized(q8, qd), dequantized(k8, kd), dequantized(v8, vd), scale)
            if rotate_v:  # O (V R) R^T = O V
                op, emulated = op @ rotation.T, emulated @ rotation.T
            errors = rms(op - want), rms(emulated - want)
            baseline = baseline or errors
            label = name + suffix
            lines.append(f"| {label} | {errors[0]:.2e} | {errors[0] / baseline[0]:.2f} | {errors[1]:.2e} | "
                         f"{errors[1] / baseline[1]:.2f} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
