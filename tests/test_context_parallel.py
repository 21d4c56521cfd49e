"""torch's context parallel (torch.distributed.tensor.experimental.context_parallel) on our kernels:
with flashattn_ext active as torch's flash-attention implementation, the ring attention that CP runs
over NCCL calls our forward and backward on each rank's shard, and the unsharded output and
gradients match a float64 reference. One process a GPU (spawned); needs at least two GPUs."""
import math

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from helpers import free_port, naive_attention, process_group, relative_error

# bf16 results against float64, relative to the largest reference value (as test_torch_flash.py).
TOLERANCE = 2e-2

# (name, heads_q, heads_kv, tokens per GPU, head_dim, is_causal)
CASES = [
    ("causal, GQA 8:2", 8, 2, 512, 128, True),
    ("causal", 4, 4, 384, 64, True),
    ("not causal", 4, 4, 256, 128, False),
]


def run_cases(rank, world, port):
    """One rank: every case through CP, checked against float64 (each rank checks the whole result)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options, context_parallel_unshard
    from torch.nn.attention import SDPBackend, activate_flash_attention_impl, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    import flashattn_ext  # noqa: F401  (registers "flashattn_ext")

    with process_group(rank, world, port, "nccl"):
        activate_flash_attention_impl("flashattn_ext")
        mesh = init_device_mesh("cuda", (world,))
        for name, heads_q, heads_kv, tokens, dim, causal in CASES:
            length = tokens * world
            gen = torch.Generator(device="cuda").manual_seed(0)  # the same full tensors on every rank
            q, k, v, dout = (torch.randn(1, heads, length, dim, device="cuda", generator=gen).bfloat16()
                             for heads in (heads_q, heads_kv, heads_kv, heads_q))
            shards = [t.clone() for t in (q, k, v, dout)]
            # torch's CP balances the load (head-tail) for causal calls only, and refuses it otherwise.
            _cp_options.enable_load_balance = causal
            with context_parallel(mesh, buffers=shards, buffer_seq_dims=[2] * 4):
                q_shard, k_shard, v_shard, dout_shard = shards
                for t in (q_shard, k_shard, v_shard):
                    t.requires_grad_(True)
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        out = F.scaled_dot_product_attention(q_shard, k_shard, v_shard, is_causal=causal,
                                                             enable_gqa=heads_q != heads_kv)
                    out.backward(dout_shard)
                    torch.cuda.synchronize()
                grads = [t.grad for t in (q_shard, k_shard, v_shard)]
                for t in (q_shard, k_shard, v_shard):
                    t.requires_grad_(False)  # (the context restores the buffers in place on exit)
                got = context_parallel_unshard(mesh, [out.detach(), *grads], [2] * 4)
            names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            assert any("flashattn_ext" in n for n in names), (name, "our kernels did not run")

            leaves = [t.double().requires_grad_() for t in (q, k, v)]
            want_out, _ = naive_attention(*leaves, is_causal=causal, enable_gqa=heads_q != heads_kv,
                                          scale=1 / math.sqrt(dim))
            want_out.backward(dout.double())
            for what, g, w in zip(("out", "dq", "dk", "dv"), got, [want_out.detach()] + [t.grad for t in leaves]):
                error = relative_error(g, w)
                assert error < TOLERANCE, (name, what, world, error)


@pytest.mark.cuda
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_runs_ours(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    mp.spawn(run_cases, args=(world, free_port()), nprocs=world, join=True)
