"""A decoding step through the SDPA drop-in (issue 44's bar): flashattn_ext.scaled_dot_product_attention on
a few query tokens against a cache, as transformers' sdpa path calls it, against stock SDPA (which picks
cuDNN) on the same call, and against our dense kernels on it (FLASHATTN_EXT_KERNELS=dense, read at each
call): the route to the decode kernels is what this measures.

bf16, enable_gqa where the heads differ; no mask, or (the rows marked "static") the bool (B, 1, L, S) mask of
transformers' static cache, whose capacity S holds 3/8 of it in use (the decode kernels read no key past
the last one it shows). Times: the median of 50 calls (CUDA events, a call
each) after warm-up, the three providers' calls interleaved. Each row first checks our output against
stock SDPA's.

    python3 benchmarks/bench_decode_step.py [--out FILE]
"""
import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_timing import interleaved_median_cuda_events, with_kernels
import flashattn_ext

# (batch, query heads, key heads, head dim, keys, query tokens)
CASES = [
    (16, 32, 8, 128, 4096, 1),  # issue 44's call: transformers' decode step, GQA 32:8, 4k cache
    (16, 32, 8, 128, 4096, 2),
    (16, 32, 8, 128, 4096, 4),
    (16, 32, 8, 128, 4096, 8),  # 32 rows a key head: the Hopper decode kernel's two row groups
    (16, 32, 8, 128, 512, 1),
    (64, 32, 8, 128, 4096, 1),
    (1, 32, 8, 128, 8192, 1),
    (1, 32, 8, 128, 32768, 1),
    (4, 32, 8, 128, 32768, 1),
    (16, 16, 16, 64, 2048, 1),  # MHA at head dim 64
    (16, 16, 16, 64, 2048, 16),
    (16, 32, 8, 128, 4096, 1, "static"),  # a static cache of 4k slots, 1.5k in use
    (16, 32, 8, 128, 4096, 4, "static"),
    (1, 32, 8, 128, 32768, 1, "static"),
]


def static_cache_mask(batch, tokens, keys):
    """transformers' mask of a decoding step in a static cache of `keys` slots, 3/8 of them in use: the
    new tokens are the last in use, each seeing the keys up to its own."""
    used = keys * 3 // 8
    position = torch.arange(used - tokens, used, device="cuda")[:, None]
    mask = torch.arange(keys, device="cuda")[None, :] <= position
    return mask[None, None].expand(batch, 1, tokens, keys).contiguous()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    lines = [f"# A decoding step through the SDPA drop-in ({torch.cuda.get_device_name()}, torch {torch.__version__})",
             "", "| B | Hq:Hkv | D | keys | q tokens | mask | ours ms | dense ms | SDPA ms | SDPA / ours "
             "| dense / ours |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for batch, heads_q, heads_kv, dim, keys, tokens, *mask_kind in CASES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(batch, heads_q, tokens, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(batch, heads_kv, keys, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                for _ in range(2))
        gqa = heads_q != heads_kv
        mask = static_cache_mask(batch, tokens, keys) if mask_kind else None
        ours = lambda: flashattn_ext.scaled_dot_product_attention(q, k, v, mask, enable_gqa=gqa)  # noqa: E731
        dense = with_kernels("dense", ours)
        stock = lambda: F.scaled_dot_product_attention(q, k, v, mask, enable_gqa=gqa)  # noqa: E731
        with torch.no_grad():
            want = stock().float()
            for name, fn in (("ours", ours), ("dense", dense)):
                error = (fn().float() - want).abs().max().item()
                assert error < 2e-2, f"{name} differs from SDPA by {error}"
            ms, dense_ms, sdpa_ms = (t * 1e3 for t in interleaved_median_cuda_events([ours, dense, stock], 50, 5))
        line = (f"| {batch} | {heads_q}:{heads_kv} | {dim} | {keys} | {tokens} | {''.join(mask_kind) or '-'} | "
                f"{ms:.4f} | {dense_ms:.4f} | {sdpa_ms:.4f} | {sdpa_ms / ms:.2f} | {dense_ms / ms:.2f} |")
        lines.append(line)
        print(line, flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
