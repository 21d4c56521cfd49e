"""A BERT-base-shaped masked-LM training step on right-padded batches: stock SDPA against
flashattn_ext, through the drop-in swap and through the transformers backend (issue 44's bar).

    python3 benchmarks/bench_bert.py --out benchmarks/results/training/bert.md
    python3 benchmarks/bench_bert.py --seqlens 2048 --steps 5     # quicker
    python3 benchmarks/bench_bert.py --model llama                # a causal decoder of the same size

--model llama: transformers' LlamaForCausalLM of the same sizes (12 heads of dim 64, MHA), the causal
LM loss on the real tokens; transformers builds the causal (B, 1, N, N) mask with the padding in it.

transformers' BertForMaskedLM, hidden 768, 12 heads (head dim 64), intermediate 3072, 4 layers,
random init, bf16 weights and inputs, AdamW. A batch holds 4 sequences right-padded to N, their
lengths spread evenly from N down to N / 4; transformers builds the (B, 1, N, N) boolean mask that
SDPA receives. A step is forward (with the masked-LM loss on the real tokens), backward and the
optimizer's step. Providers:
  - sdpa: attn_implementation="sdpa", torch's SDPA picking its backend;
  - swap: the same model with torch.nn.functional.scaled_dot_product_attention replaced by
    flashattn_ext.scaled_dot_product_attention (the drop-in swap);
  - backend: attn_implementation="fa_ext" (flashattn_ext.register_with_transformers()).
Each provider's model starts from the same weights; the providers are timed in rounds, each round in
the opposite order of the one before, and a cell is the median over all rounds of the step time
(CUDA events) after warm-up steps. The loss of the first step is printed beside it: the providers
compute the same function, so they agree to bf16 rounding.
"""
import argparse
import contextlib
import copy
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

import flashattn_ext

PROVIDERS = ("sdpa", "swap", "backend")


def make_batch(batch: int, n: int, vocab: int, device):
    gen = torch.Generator().manual_seed(n)
    lengths = torch.linspace(n, n / 4, batch).round().long()
    real = torch.arange(n)[None, :] < lengths[:, None]
    ids = torch.randint(0, vocab, (batch, n), generator=gen)
    labels = ids.masked_fill(~real, -100)
    return ids.to(device), real.long().to(device), labels.to(device)


@contextlib.contextmanager
def swapped_sdpa(active: bool):
    """torch.nn.functional.scaled_dot_product_attention is flashattn_ext's while active."""
    original = F.scaled_dot_product_attention
    if active:
        torch.nn.functional.scaled_dot_product_attention = flashattn_ext.scaled_dot_product_attention
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def build_models(n: int, layers: int, device, model_kind: str = "bert"):
    import transformers

    sizes = dict(hidden_size=768, num_attention_heads=12, num_hidden_layers=layers, intermediate_size=3072,
                 max_position_embeddings=n)
    torch.manual_seed(0)
    if model_kind == "llama":
        base = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=30522, **sizes))
    else:
        base = transformers.BertForMaskedLM(transformers.BertConfig(**sizes))
    base = base.to(device, torch.bfloat16)
    models = {}
    for provider in PROVIDERS:
        model = copy.deepcopy(base)
        model.config._attn_implementation = flashattn_ext.register_with_transformers() \
            if provider == "backend" else "sdpa"
        models[provider] = model
    return models


def timed_steps(model, optimizer, batch, steps: int, swap: bool):
    ids, real, labels = batch
    times, losses = [], []
    with swapped_sdpa(swap):
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = model(input_ids=ids, attention_mask=real, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            end.record()
            losses.append(loss.detach())
            times.append((start, end))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in times], [x.item() for x in losses]


def measure(n: int, args, device):
    models = build_models(n, args.layers, device, args.model)
    optimizers = {p: torch.optim.AdamW(m.parameters(), lr=1e-5, foreach=True) for p, m in models.items()}
    batch = make_batch(4, n, models["sdpa"].config.vocab_size, device)
    first_loss, times = {}, {p: [] for p in PROVIDERS}
    for p in PROVIDERS:  # warm-up (and the first step's loss, on the shared initial weights)
        _, losses = timed_steps(models[p], optimizers[p], batch, args.warmup, p == "swap")
        first_loss[p] = losses[0]
    order = list(PROVIDERS)
    for _ in range(args.rounds):
        for p in order:
            step_times, _ = timed_steps(models[p], optimizers[p], batch, args.steps, p == "swap")
            times[p] += step_times
        order.reverse()
    medians = {p: statistics.median(t) for p, t in times.items()}
    return medians, first_loss


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", nargs="+", type=int, default=[2048, 8192])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per provider and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--model", choices=["bert", "llama"], default="bert")
    parser.add_argument("--out", type=Path, help="markdown table to write")
    args = parser.parse_args()
    device = torch.device("cuda")
    import transformers

    lines = [
        f"# {'BERT-base' if args.model == 'bert' else 'Llama (BERT-base sizes)'}-shaped training step: stock SDPA "
        "against flashattn_ext",
        "",
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"bf16, 4 right-padded sequences (lengths N to N/4), {args.layers} layers. Command: "
        f"`python3 benchmarks/bench_bert.py --model {args.model} --seqlens {' '.join(map(str, args.seqlens))} "
        f"--steps {args.steps} --rounds {args.rounds}`. Median step time (ms) over {args.steps * args.rounds} "
        "steps; the ratio is to stock SDPA's; the first step's loss beside it.",
        "",
        "| N | sdpa | swap | backend | swap / sdpa | backend / sdpa | first loss (sdpa / swap / backend) |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in args.seqlens:
        medians, loss = measure(n, args, device)
        lines.append(
            f"| {n} | {medians['sdpa']:.2f} | {medians['swap']:.2f} | {medians['backend']:.2f} | "
            f"{medians['swap'] / medians['sdpa']:.2f} | {medians['backend'] / medians['sdpa']:.2f} | "
            f"{loss['sdpa']:.4f} / {loss['swap']:.4f} / {loss['backend']:.4f} |")
        print(lines[-1], flush=True)
        torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
