"""torch's context parallel (ring attention over NCCL) on several GPUs of one host: attention forward +
backward TFLOP/s per GPU with flashattn_ext active as torch's flash-attention implementation, and with
torch's own cuDNN attention, against one GPU's own throughput on its share of the tokens.

One process a GPU (spawned). Each rank makes its shard of q, k, v and dO directly (random; the ring's
work depends on the layout, not the values), inside torch's `context_parallel` with head-tail load
balancing (causal), so that the whole sequence never sits on one GPU.

    python3 benchmarks/bench_context_parallel.py                       # every GPU, 8k 64k 128k tokens a GPU
    python3 benchmarks/bench_context_parallel.py --world 2 --tokens 8192 16384

FLOPs per GPU: the whole causal sequence's 2 * 2 * B * H * N^2 * D (forward, halved for causal) times
3.5 (forward and backward), over the GPUs. Correctness is tests/test_context_parallel.py's.
"""
import argparse
import socket
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from bench_timing import REPO  # noqa: F401  (puts this checkout first on sys.path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def causal_flops(batch: int, heads: int, length: int, dim: int) -> float:
    """Forward + backward FLOPs of causal attention over `length` tokens: 3.5x the forward's 2 B H N^2 D."""
    return 3.5 * 2.0 * batch * heads * length * length * dim


def time_step(fn, reps: int) -> float:
    """Median seconds of fn (a forward + backward), all ranks starting together."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def run(rank: int, world: int, port: int, args) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options
    from torch.nn.attention import (SDPBackend, activate_flash_attention_impl, restore_flash_attention_impl,
                                    sdpa_kernel)

    import flashattn_ext  # noqa: F401  (registers "flashattn_ext")

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cuda", (world,))
    _cp_options.enable_load_balance = True
    b, hq, hkv, d = 1, args.heads, args.kv_heads, args.dim
    if rank == 0:
        print(f"{world} x {torch.cuda.get_device_name()}; B={b}, GQA {hq}:{hkv}, D={d}, bf16, causal; "
              "forward + backward TFLOP/s per GPU")
        print("| tokens a GPU | whole sequence | one GPU, its tokens (ours) | CP, flashattn_ext | CP, cuDNN |")
        print("|---|---|---|---|---|")
    for tokens in args.tokens:
        q, k, v, dout = (torch.randn(b, h, tokens, d, device="cuda", dtype=torch.bfloat16, requires_grad=i < 3)
                         for i, h in enumerate((hq, hkv, hkv, hq)))

        def step():
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hq != hkv)
            torch.autograd.grad(out, (q, k, v), dout)

        results = {}
        for name, backend, activate in (("ours", SDPBackend.FLASH_ATTENTION, True),
                                        ("cudnn", SDPBackend.CUDNN_ATTENTION, False)):
            if activate:
                activate_flash_attention_impl("flashattn_ext")
            try:
                if name == "ours":
                    results["single"] = time_step(step, args.reps)  # this GPU's tokens alone, no ring
                # The sequence the shards belong to (a placeholder buffer gives CP its length).
                whole = torch.empty(tokens * world, device="cuda")
                with context_parallel(mesh, buffers=[whole], buffer_seq_dims=[0], no_restore_buffers={whole}):
                    results[name] = time_step(step, args.reps)
            except RuntimeError as error:  # (a backend that does not take the call: say so, go on)
                results[name] = None
                if rank == 0:
                    print(f"{name} at {tokens} tokens a GPU: {str(error).splitlines()[0]}", flush=True)
            finally:
                if activate:
                    restore_flash_attention_impl()
        if rank == 0:
            per_gpu = causal_flops(b, hq, tokens * world, d) / world / 1e12
            single = causal_flops(b, hq, tokens, d) / 1e12 / results["single"]
            cells = [f"{per_gpu / results[name]:.0f}" if results[name] else "-" for name in ("ours", "cudnn")]
            print(f"| {tokens} | {tokens * world} | {single:.0f} | {cells[0]} | {cells[1]} |", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=torch.cuda.device_count())
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 65536, 131072], help="tokens a GPU")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    mp.spawn(run, args=(args.world, free_port(), args), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
