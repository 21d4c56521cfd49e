"""Context parallelism on several GPUs of one host (NCCL): attention forward + backward TFLOP/s per GPU
of flashattn_ext.distributed.context_parallel_attention ("ext_cp"), and of torch's context parallel with
SDPA on flashattn_ext (active as torch's flash-attention implementation, "ours") or on torch's cuDNN
attention ("cudnn"), against one GPU's own throughput on its share of the tokens; and, with --numerics,
the error of the unsharded result against float64 at each number of GPUs.

One process a GPU (spawned). For speed, each rank makes its shard of q, k, v and dO directly (random;
the work depends on the layout, not the values) in the head-tail layout (torch's CP with its load
balancing, and ext_cp's "head_tail"), so that the whole sequence never sits on one GPU.

    python3 benchmarks/bench_context_parallel.py                       # every GPU, 8k 64k 128k tokens a GPU
    python3 benchmarks/bench_context_parallel.py --world 2 --tokens 8192 16384 --backends ours
    python3 benchmarks/bench_context_parallel.py --numerics --world 1 2 4   # error against float64
    python3 benchmarks/bench_context_parallel.py --documents 8192 --tokens 65536   # packed documents
    python3 benchmarks/bench_context_parallel.py --window 4096 --tokens 32768      # a sliding window

FLOPs per GPU: the whole causal sequence's 2 * 2 * B * H * N^2 * D (forward, halved for causal) times
3.5 (forward and backward), over the GPUs. The numerics run takes one sequence (--numerics-tokens in
all, seeded), runs it through CP on each world size (world 1: the plain call, no ring), and gives the
largest error of out, dQ, dK, dV relative to the largest float64 value.
"""
import argparse
import math

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from bench_timing import free_port, median_step_seconds  # (puts this checkout first on sys.path)

# "ours" and "cudnn": torch's context_parallel with SDPA on flashattn_ext (active) or on cuDNN;
# "ext_cp": flashattn_ext.distributed.context_parallel_attention on the same shards (head-tail).
BACKENDS = ("ext_cp", "ours", "cudnn")


def causal_flops(batch: int, heads: int, length: int, dim: int) -> float:
    """Forward + backward FLOPs of causal attention over `length` tokens: 3.5x the forward's 2 B H N^2 D."""
    return 3.5 * 2.0 * batch * heads * length * length * dim


def time_step(fn, reps: int) -> float:
    """Median seconds of fn (a forward + backward) after 2 warm-up calls, all ranks starting together."""
    return median_step_seconds(fn, reps, warmup=2)


def sdpa_backend(name: str):
    """(SDPA backend, whether flashattn_ext must be active) of a backend's name (ext_cp: none)."""
    from torch.nn.attention import SDPBackend
    return {"ours": (SDPBackend.FLASH_ATTENTION, True), "cudnn": (SDPBackend.CUDNN_ATTENTION, False),
            "ext_cp": (None, False)}[name]


class Active:
    """flashattn_ext active as torch's flash attention inside the block, when `on`."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        if self.on:
            from torch.nn.attention import activate_flash_attention_impl
            activate_flash_attention_impl("flashattn_ext")

    def __exit__(self, *exc):
        if self.on:
            from torch.nn.attention import restore_flash_attention_impl
            restore_flash_attention_impl()


def attention_step(q, k, v, dout, backend, causal: bool = True):
    """out and (dq, dk, dv) of one SDPA call on `backend`; backend None: context_parallel_attention on
    this rank's head-tail shards."""
    from torch.nn.attention import sdpa_kernel
    from flashattn_ext.distributed import context_parallel_attention
    if backend is None:
        out = context_parallel_attention(q, k, v, layout="head_tail", is_causal=causal,
                                         enable_gqa=q.shape[1] != k.shape[1])
    else:
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    return out, torch.autograd.grad(out, (q, k, v), dout)


def init_rank(rank: int, world: int, port: int):
    import flashattn_ext  # noqa: F401  (registers "flashattn_ext")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._attention import _cp_options

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    _cp_options.enable_load_balance = True  # head-tail, for causal calls
    return init_device_mesh("cuda", (world,))


def run_speed(rank: int, world: int, port: int, args) -> None:
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_rank(rank, world, port)
    b, hq, hkv, d = 1, args.heads, args.kv_heads, args.dim
    if rank == 0:
        print(f"{world} x {torch.cuda.get_device_name()}; B={b}, GQA {hq}:{hkv}, D={d}, bf16, causal; "
              "forward + backward TFLOP/s per GPU (efficiency: CP's per GPU over one GPU's on its tokens)")
        print("| tokens a GPU | whole sequence | one GPU, its tokens (ours) | "
              + " | ".join(f"CP, {name}" for name in args.backends) + " |")
        print("|---|---|---|" + "---|" * len(args.backends), flush=True)
    for tokens in args.tokens:
        q, k, v, dout = (torch.randn(b, h, tokens, d, device="cuda", dtype=torch.bfloat16, requires_grad=i < 3)
                         for i, h in enumerate((hq, hkv, hkv, hq)))
        seconds = {}
        backend, _ = sdpa_backend("ours")
        with Active(True):
            seconds["single"] = time_step(lambda: attention_step(q, k, v, dout, backend), args.reps)
        for name in args.backends:
            backend, active = sdpa_backend(name)
            # The sequence the shards belong to (a placeholder buffer gives CP its length).
            whole = torch.empty(tokens * world, device="cuda")
            try:
                if backend is None:
                    seconds[name] = time_step(lambda: attention_step(q, k, v, dout, None), args.reps)
                    continue
                with Active(active), context_parallel(mesh, buffers=[whole], buffer_seq_dims=[0],
                                                      no_restore_buffers={whole}):
                    seconds[name] = time_step(lambda: attention_step(q, k, v, dout, backend), args.reps)
            except RuntimeError as error:  # (a backend that does not take the call: say so, go on)
                seconds[name] = None
                if rank == 0:
                    print(f"{name} at {tokens} tokens a GPU: {str(error).splitlines()[0]}", flush=True)
        if rank == 0:
            per_gpu = causal_flops(b, hq, tokens * world, d) / world / 1e12
            single = causal_flops(b, hq, tokens, d) / 1e12 / seconds["single"]
            cells = []
            for name in args.backends:
                if seconds[name] is None:
                    cells.append("-")
                else:
                    rate = per_gpu / seconds[name]
                    cells.append(f"{rate:.0f} ({rate / single:.1%}; {seconds[name]:.3f} s)")
            print(f"| {tokens} | {tokens * world} | {single:.0f} | " + " | ".join(cells) + " |", flush=True)
        del q, k, v, dout
        torch.cuda.empty_cache()
    dist.destroy_process_group()


def window_flops(heads: int, length: int, window: int, dim: int) -> float:
    """Forward + backward FLOPs of causal attention over `length` tokens, each seeing its last `window`
    keys: causal_flops' count of (query, key) pairs, here sum_i min(i + 1, window)."""
    pairs = window * length - window * (window - 1) // 2 if length >= window else length * (length + 1) // 2
    return 3.5 * 4.0 * heads * pairs * dim


def run_bounded(rank: int, world: int, port: int, args) -> None:
    """context_parallel_attention where each query sees a bounded span of keys, against one GPU's same
    call over its share of the tokens: packed documents of --documents tokens (causal within each; the
    head-tail layout; one GPU: varlen_attention over its share of the same documents), or a causal window
    of --window keys (the contiguous layout, which balances it; one GPU: the windowed call on its tokens)."""
    import flashattn_ext
    from flashattn_ext.distributed import context_parallel_attention

    init_rank(rank, world, port)
    hq, hkv, d = args.heads, args.kv_heads, args.dim
    what = (f"documents of {args.documents} tokens (causal, head-tail)" if args.documents else
            f"a causal window of {args.window} keys (contiguous)")
    if rank == 0:
        print(f"{world} x {torch.cuda.get_device_name()}; {what}, GQA {hq}:{hkv}, D={d}, bf16; forward + backward "
              "TFLOP/s per GPU")
        print("| tokens a GPU | whole sequence | one GPU, its tokens | CP, ext_cp |\n|---|---|---|---|", flush=True)
    for tokens in args.tokens:
        q, k, v, dout = (torch.randn(1, h, tokens, d, device="cuda", dtype=torch.bfloat16, requires_grad=i < 3)
                         for i, h in enumerate((hq, hkv, hkv, hq)))
        if args.documents:
            length = args.documents
            packed = [t.detach()[0].transpose(0, 1).contiguous().requires_grad_(i < 3)  # (tokens, heads, D)
                      for i, t in enumerate((q, k, v, dout))]
            own = torch.arange(0, tokens + 1, length, device="cuda", dtype=torch.int32)
            flops = causal_flops(1, hq, length, d) * tokens / length  # a GPU's share, both ways

            def single():
                out = flashattn_ext.varlen_attention(*packed[:3], own, own, length, length, is_causal=True)
                torch.autograd.grad(out, packed[:3], packed[3])

            options = {"layout": "head_tail", "cu_seqlens": list(range(0, tokens * world + 1, length))}
        else:
            window = (args.window - 1, 0)
            # a GPU's share of the whole sequence's pairs (its first rank's start sees fewer keys)
            flops = window_flops(hq, tokens * world, args.window, d) / world

            def single():
                out, _ = flashattn_ext.attention_with_lse(q, k, v, is_causal=True, enable_gqa=hq != hkv,
                                                          window=window)
                torch.autograd.grad(out, (q, k, v), dout)

            options = {"layout": "contiguous", "window": window}

        def sharded():
            out = context_parallel_attention(q, k, v, is_causal=True, enable_gqa=hq != hkv, **options)
            torch.autograd.grad(out, (q, k, v), dout)

        seconds = (time_step(single, args.reps), time_step(sharded, args.reps))
        if rank == 0:
            single_flops = flops if args.documents else window_flops(hq, tokens, args.window, d)
            rates = [single_flops / seconds[0] / 1e12, flops / seconds[1] / 1e12]
            print(f"| {tokens} | {tokens * world} | {rates[0]:.0f} | {rates[1]:.0f} ({rates[1] / rates[0]:.1%}; "
                  f"{seconds[1]:.3f} s) |", flush=True)
    dist.destroy_process_group()


def numerics_problem(args):
    """The seeded full q, k, v, dO (bf16) and the float64 out, dq, dk, dv."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, d = args.numerics_tokens, args.dim
    q, k, v, dout = (torch.randn(1, h, n, d, device="cuda", generator=gen).bfloat16()
                     for h in (args.heads, args.kv_heads, args.kv_heads, args.heads))
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    group = args.heads // args.kv_heads
    out = F.scaled_dot_product_attention(leaves[0], leaves[1].repeat_interleave(group, 1),
                                         leaves[2].repeat_interleave(group, 1), is_causal=True,
                                         scale=1 / math.sqrt(d))
    want = [out.detach(), *torch.autograd.grad(out, leaves, dout.double())]
    return (q, k, v, dout), want


def errors(got, want):
    return [((g.double() - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want)]


def run_numerics(rank: int, world: int, port: int, args) -> None:
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    mesh = init_rank(rank, world, port)
    full, want = numerics_problem(args)
    for name in args.backends:
        backend, active = sdpa_backend(name)
        if backend is None:
            from flashattn_ext.distributed import shard_sequence, unshard_sequence
            q, k, v, dout = (shard_sequence(t, 2) for t in full)
            out, grads = attention_step(*(t.requires_grad_() for t in (q, k, v)), dout, None)
            got = [unshard_sequence(t, 2) for t in (out.detach(), *grads)]
            if rank == 0:
                print(numerics_row(name, world, errors(got, want)), flush=True)
            continue
        shards = [t.clone() for t in full]
        with Active(active), context_parallel(mesh, buffers=shards, buffer_seq_dims=[2] * 4):
            q, k, v, dout = shards
            out, grads = attention_step(*(t.requires_grad_(i < 3) for i, t in enumerate((q, k, v))), dout, backend)
            for t in (q, k, v):
                t.requires_grad_(False)  # (the context restores the buffers in place on exit)
            got = context_parallel_unshard(mesh, [out.detach(), *grads], [2] * 4)
        if rank == 0:
            print(numerics_row(name, world, errors(got, want)), flush=True)
    dist.destroy_process_group()


def numerics_row(name: str, world: int, errs) -> str:
    return f"| {name} | {world} | " + " | ".join(f"{e:.2e}" for e in errs) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, nargs="+", default=[torch.cuda.device_count()])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 65536, 131072], help="tokens a GPU")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--numerics", action="store_true", help="error against float64 at each --world")
    parser.add_argument("--numerics-tokens", type=int, default=8192, help="the numerics run's whole sequence")
    parser.add_argument("--documents", type=int, help="packed documents of this many tokens (ext_cp only)")
    parser.add_argument("--window", type=int, help="a causal window of this many keys (ext_cp only)")
    args = parser.parse_args()
    if args.numerics:
        print(f"{torch.cuda.get_device_name()}; causal, B=1, GQA {args.heads}:{args.kv_heads}, D={args.dim}, "
              f"N={args.numerics_tokens}, bf16; largest error relative to the largest float64 value")
        print("| backend | GPUs | out | dq | dk | dv |\n|---|---|---|---|---|---|", flush=True)
    for world in args.world:
        if args.numerics and world == 1:  # one GPU: the plain call
            import flashattn_ext  # noqa: F401
            full, want = numerics_problem(args)
            for name in args.backends:
                backend, active = sdpa_backend(name)
                if backend is None:  # (no one-GPU form: the plain call is the "ours" row)
                    continue
                with Active(active):
                    q, k, v, dout = full
                    out, grads = attention_step(*(t.clone().requires_grad_() for t in (q, k, v)), dout, backend)
                print(numerics_row(name, 1, errors([out, *grads], want)), flush=True)
            del full, want
            torch.cuda.empty_cache()
            continue
        run = run_numerics if args.numerics else run_bounded if args.documents or args.window else run_speed
        mp.spawn(run, args=(world, free_port(), args), nprocs=world, join=True)


if __name__ == "__main__":
    main()
