"""A transformers Llama trained on one long sequence under context parallelism (flashattn_ext.distributed,
over NCCL) against the same model on one GPU: loss, every parameter's gradient, and the step time.

First the reference: the model on GPU 0 alone, over the whole sequence (attn_implementation "fa_ext",
our kernels), its loss and gradients saved to --scratch. Then one process a GPU, each running the same
model (same seed) on its head-tail shard of the tokens, with their positions in the whole sequence
(`register_with_transformers`); the loss is each rank's share and the gradients are summed over the
ranks. Rank 0 compares: the loss's relative difference, and each parameter's largest gradient difference
relative to its largest reference value (the table gives the worst parameter). Step time: median of
--steps forward + backward steps after one warm-up, CUDA events.

    python3 benchmarks/check_model_context_parallel.py --world 4 --tokens 131072
    python3 benchmarks/check_model_context_parallel.py --world 4 --tokens 524288 --layers 1 --hidden 1024 \
        --head-dim 128 --vocab 2048   # 512k tokens: what one H100 holds for the reference
    python3 benchmarks/check_model_context_parallel.py --world 2 --tokens 16384 --layers 1 --hidden 1024
    python3 benchmarks/check_model_context_parallel.py --device cpu --world 2 --tokens 256 --layers 1 \
        --hidden 128 --heads 4 --kv-heads 2 --vocab 256      # a smoke run on the CPU (gloo, float32)
"""
import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench_timing import free_port, median_step_seconds  # (puts this checkout first on sys.path)


def build(args, attn_implementation: str):
    """The model on args.device (bf16 on the GPU, float32 on the CPU), the same weights in every process."""
    import transformers
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(3.5 * args.hidden),
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim or args.hidden // args.heads, max_position_embeddings=args.tokens, use_cache=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.to(args.device, torch.bfloat16 if args.device == "cuda" else torch.float32)


def problem(args):
    """Token ids, next-token labels (-100 at the end) and positions of the whole sequence, on the GPU."""
    tokens = torch.randint(args.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(1)).to(args.device)
    labels = torch.cat([tokens[:, 1:], torch.full((1, 1), -100, device=args.device)], dim=1)
    return tokens, labels, torch.arange(args.tokens, device=args.device)[None]


def step(model, tokens, labels, positions, count):
    logits = model(input_ids=tokens, position_ids=positions).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                                             reduction="sum") / count
    loss.backward()
    return loss.detach()


def reference(args) -> None:
    import flashattn_ext
    name = flashattn_ext.register_with_transformers()
    model = build(args, name)
    tokens, labels, positions = problem(args)
    loss = step(model, tokens, labels, positions, args.tokens - 1)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    def again():
        model.zero_grad(set_to_none=True)
        step(model, tokens, labels, positions, args.tokens - 1)

    seconds = median_step_seconds(again, args.steps, args.device)
    torch.save({"loss": loss.cpu(), "grads": {n: g.cpu() for n, g in grads.items()}, "seconds": seconds},
               args.scratch)
    print(f"one GPU: loss {loss.item():.6f}, step {seconds:.3f} s", flush=True)


def context_parallel(rank: int, world: int, port: int, args) -> None:
    from flashattn_ext.distributed import register_with_transformers, shard_sequence

    if args.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    try:
        model = build(args, register_with_transformers(layout="head_tail"))
        tokens, labels, positions = (shard_sequence(t, 1) for t in problem(args))
        loss = step(model, tokens, labels, positions, args.tokens - 1)
        dist.all_reduce(loss)
        for p in model.parameters():
            dist.all_reduce(p.grad)  # the ranks' shares, as data parallelism sums them
        if rank == 0:
            want = torch.load(args.scratch)
            errors = {n: ((p.grad.float() - want["grads"][n].to(args.device).float()).abs().max()
                          / want["grads"][n].float().abs().max().clamp_min(1e-30)).item()
                      for n, p in model.named_parameters()}

        def again():
            model.zero_grad(set_to_none=True)
            step(model, tokens, labels, positions, args.tokens - 1)

        seconds = median_step_seconds(again, args.steps, args.device)
        if rank == 0:
            worst = max(errors, key=errors.get)
            loss_error = abs(loss.item() - want["loss"].item()) / abs(want["loss"].item())
            print(f"| {world} | {args.tokens} | {want['loss'].item():.6f} | {loss.item():.6f} | {loss_error:.1e} | "
                  f"{errors[worst]:.2e} ({worst}) | {want['seconds']:.3f} | {seconds:.3f} | "
                  f"{want['seconds'] / seconds / world:.1%} |", flush=True)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--world", type=int, default=torch.cuda.device_count())
    parser.add_argument("--tokens", type=int, default=131072, help="the whole sequence")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, help="default: hidden / heads (a smaller hidden keeps d=128 at 512k "
                        "tokens on one GPU)")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/check_model_context_parallel.pt"))
    args = parser.parse_args()
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"{where}: transformers Llama, {args.layers} layers, hidden {args.hidden}, GQA "
          f"{args.heads}:{args.kv_heads}, d={args.head_dim or args.hidden // args.heads}, vocab {args.vocab}, "
          f"{'bf16' if args.device == 'cuda' else 'float32'}; forward + backward of "
          "one sequence")
    reference(args)
    if args.device == "cuda":
        torch.cuda.empty_cache()
    print("| GPUs | tokens | loss, one GPU | loss, CP | loss difference | worst gradient difference | "
          "step, one GPU (s) | step, CP (s) | per-GPU efficiency |\n|---|---|---|---|---|---|---|---|---|",
          flush=True)
    mp.spawn(context_parallel, args=(args.world, free_port(), args), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
