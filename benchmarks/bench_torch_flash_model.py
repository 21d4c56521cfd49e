"""A transformers Llama model trained through plain SDPA (attn_implementation="sdpa", no patching),
with torch's own kernels and with flashattn_ext activated as torch's flash-attention implementation
(`activate_flash_attention_impl("flashattn_ext")`): which kernels ran (the profiler's names), the
losses side by side, and the step time, on the GPU.

Three runs, from the same random weights (deep copies of one model, bf16) on the same batches: SDPA as
it comes (on Hopper it picks cuDNN), SDPA with flash first in its priority order (torch's FA2), and
flash first with flashattn_ext active. A step is forward + backward (cross-entropy on random token
ids) + AdamW (foreach) + zero_grad. The runs' steps are taken in turn, so all see the same clock
drift; step time is the median of --steps timed steps after 3 warm-up steps (CUDA events). Then one
more step each runs under torch.profiler, and the attention kernels it launched are listed. The exit
status is 1 if the losses differ by more than bf16's rounding (2e-2 relative), or if the active run
launched no flashattn_ext kernel or any of torch's or cuDNN's attention kernels.

    python3 benchmarks/bench_torch_flash_model.py                    # N = 4096 and 8192, 16k tokens a step
    python3 benchmarks/bench_torch_flash_model.py --seqlens 2048 --layers 2
"""
import argparse
import contextlib
import copy
import statistics
import sys
from collections import Counter

import torch
from torch.nn.attention import SDPBackend, activate_flash_attention_impl, restore_flash_attention_impl, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from bench_timing import REPO  # noqa: F401  (puts this checkout first on sys.path)
import flashattn_ext  # noqa: E402,F401  (registers "flashattn_ext" with torch)

WARMUP_STEPS = 3
LOSS_RTOL = 2e-2
# Kernel-name fragments of attention kernels: ours, torch's FA2 and memory-efficient kernels, cuDNN's.
ATTENTION_NAMES = ("flashattn_ext", "flash", "fmha", "cudnn", "attention")
TORCH_KERNELS = ("pytorch_flash", "flash_fwd_kernel", "flash_bwd", "cudnn", "fmha")
# On Hopper, SDPA's own order takes cuDNN before flash; the flash-first order is how a user makes it pick
# the flash backend, and so the activated implementation (README, "torch's SDPA").
FLASH_FIRST = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
               SDPBackend.MATH]


class Run:
    """One model, its optimizer, whether SDPA takes flash first, and whether flashattn_ext is active."""

    def __init__(self, base, flash_first: bool, activate: bool):
        self.model = copy.deepcopy(base)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-4, foreach=True)
        self.flash_first, self.activate = flash_first, activate

    def step(self, tokens) -> torch.Tensor:
        if self.activate:
            activate_flash_attention_impl("flashattn_ext")
        try:
            with sdpa_kernel(FLASH_FIRST, set_priority=True) if self.flash_first else contextlib.nullcontext():
                loss = self.model(input_ids=tokens, labels=tokens).loss
                loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        finally:
            if self.activate:
                restore_flash_attention_impl()
        return loss.detach()


def attention_kernels(run: Run, tokens) -> Counter:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run.step(tokens)
        torch.cuda.synchronize()
    names = Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and any(
                part in event.name.lower() for part in ATTENTION_NAMES):
            names[event.name[:120]] += 1
    return names


def main() -> int:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--tokens", type=int, default=16384, help="tokens a step: B = tokens // N")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}; "
          f"Llama, {args.layers} layers, hidden {args.hidden}, GQA {args.heads}:{args.kv_heads} "
          f"(d={args.hidden // args.heads}), bf16, attn_implementation='sdpa'")
    print("| N | B | stock SDPA step ms | flash first, torch's FA2 | flash first, flashattn_ext active | "
          "active / stock | loss steps 1-3, stock vs active |")
    print("|---|---|---|---|---|---|---|")
    failed = False
    kernel_lists = []
    for n in args.seqlens:
        config = transformers.LlamaConfig(
            vocab_size=32000, hidden_size=args.hidden, intermediate_size=int(2.6875 * args.hidden),
            num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
            max_position_embeddings=n, attn_implementation="sdpa")
        torch.manual_seed(0)
        base = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16)
        runs = {"stock": Run(base, flash_first=False, activate=False),  # SDPA's own pick (cuDNN on Hopper)
                "torch flash": Run(base, flash_first=True, activate=False),  # torch's FA2
                "activated": Run(base, flash_first=True, activate=True)}
        del base
        generator = torch.Generator(device="cuda").manual_seed(1)
        b = max(1, args.tokens // n)
        batches = [torch.randint(config.vocab_size, (b, n), device="cuda", generator=generator)
                   for _ in range(WARMUP_STEPS + args.steps)]
        losses = {name: [] for name in runs}
        events = {name: [] for name in runs}
        for i, tokens in enumerate(batches):
            for name, run in runs.items():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                loss = run.step(tokens)
                end.record()
                if i < WARMUP_STEPS:
                    losses[name].append(loss.item())
                else:
                    events[name].append((start, end))
        torch.cuda.synchronize()
        ms = {name: statistics.median(s.elapsed_time(e) for s, e in events[name]) for name in runs}
        agree = all(abs(a - s) <= LOSS_RTOL * abs(s) for s, a in zip(losses["stock"], losses["activated"]))
        failed |= not agree
        pairs = " ; ".join(f"{s:.4f} vs {a:.4f}" for s, a in zip(losses["stock"], losses["activated"]))
        print(f"| {n} | {b} | {ms['stock']:.1f} | {ms['torch flash']:.1f} | {ms['activated']:.1f} | "
              f"{ms['activated'] / ms['stock']:.3f} | "
              f"{pairs}{'' if agree else ' **MISMATCH**'} |", flush=True)
        for name, run in runs.items():
            kernels = attention_kernels(run, batches[-1])
            kernel_lists.append((n, name, kernels))
            if name == "activated":
                ours = any("flashattn_ext" in k for k in kernels)
                torchs = [k for k in kernels if any(part in k for part in TORCH_KERNELS) and "flashattn_ext" not in k]
                failed |= not ours or bool(torchs)
        del runs
        torch.cuda.empty_cache()
    print("\nAttention kernels of one profiled step (name: launches)")
    for n, name, kernels in kernel_lists:
        print(f"\nN={n}, {name}:")
        for kernel, count in kernels.most_common():
            print(f"- `{kernel}`: {count}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
