"""Decoding speed (issue 12's bar): flashattn_ext.decode_attention against SDPA on the same call, and the
rate it reads the cache at against a device-to-device copy's.

One query token per sequence, bf16, GQA 32:8, head dim 128, B=64 (fewer where the cache would not fit),
every sequence's cache full, contiguous and paged (blocks of 16 and 256 keys, shuffled). Times are the
median of 20 calls (CUDA events) after 3 warm-up calls, ours and SDPA's calls interleaved (so that
the GPU's clock drift hits both alike). SDPA gets the same keys as one contiguous (B, 8, L, 128)
tensor and enable_gqa=True; its default dispatch picks the backend.

    python3 benchmarks/bench_decode.py [--lengths 8192 32768 131072] [--out DIR]
"""
import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

# bench_timing puts the repository on sys.path, so this checkout's flashattn_ext is the one imported.
from bench_timing import interleaved_median_cuda_events, median_cuda_events
import flashattn_ext

HEADS_Q, HEADS_KV, DIM = 32, 8, 128


def median_ms(fn, calls=20, warmup=3):
    for _ in range(warmup):
        fn()
    return median_cuda_events(fn, calls) * 1e3


def copy_gbps(nbytes=2 << 30):
    source = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    ms = median_ms(lambda: target.copy_(source))
    return 2 * nbytes / ms / 1e6  # read and written


def paged_caches(caches, block_size):
    """(B, H, L, D) caches as vLLM-layout blocks (num_blocks, block_size, H, D) in a shuffled order, with
    their (B, L // block_size) int32 block table: block order[i] holds the i-th block of the sequences laid
    end to end."""
    batch, heads, length, dim = caches[0].shape
    per_sequence = length // block_size
    order = torch.randperm(batch * per_sequence, device=caches[0].device)
    paged = tuple(torch.empty(batch * per_sequence, block_size, heads, dim, device=t.device, dtype=t.dtype).index_copy_(
        0, order, t.view(batch, heads, per_sequence, block_size, dim).permute(0, 2, 3, 1, 4)
        .reshape(batch * per_sequence, block_size, heads, dim)) for t in caches)
    return paged, order.view(batch, per_sequence).to(torch.int32)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    free = torch.cuda.mem_get_info()[0]
    copy = copy_gbps()
    lines = [f"# Decoding: flashattn_ext.decode_attention against SDPA ({torch.cuda.get_device_name()}, "
             f"torch {torch.__version__})", "", f"Device-to-device copy: {copy:.0f} GB/s (read + written).", "",
             "| L | B | cache | ours ms | ours GB/s | of copy | SDPA ms | SDPA / ours |", "|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for length in args.lengths:
        cache_bytes = 2 * HEADS_KV * length * DIM * 2  # K and V of one sequence
        # Room for K, V, a paged copy of each and a temporary.
        batch = min(args.batch, max(1, int(free * 0.25) // cache_bytes))
        query = torch.randn(batch, HEADS_Q, 1, DIM, device="cuda", dtype=torch.bfloat16)
        keys = torch.randn(batch, HEADS_KV, length, DIM, device="cuda", dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        lengths = torch.full((batch,), length, device="cuda", dtype=torch.int32)

        def sdpa():
            return F.scaled_dot_product_attention(query, keys, values, enable_gqa=True)

        for block in (None, 16, 256):
            if block is None:
                caches, table = (keys, values), None
            else:
                caches, table = paged_caches((keys, values), block)
            ours = flashattn_ext.decode_attention(query, *caches, lengths, block_table=table)
            assert (ours.float() - sdpa().float()).abs().max().item() < 3e-2, "decode_attention disagrees with SDPA"
            fns = [lambda: flashattn_ext.decode_attention(query, *caches, lengths, block_table=table), sdpa]
            ms, sdpa_ms = (seconds * 1e3 for seconds in interleaved_median_cuda_events(fns, 20))
            gbps = batch * cache_bytes / ms / 1e6
            line = (f"| {length} | {batch} | {'contiguous' if block is None else f'paged {block}'} | {ms:.3f} | "
                    f"{gbps:.0f} | {gbps / copy:.2f} | {sdpa_ms:.3f} | {sdpa_ms / ms:.2f} |")
            print(line, flush=True)
            lines.append(line)
            del caches
        del keys, values
        torch.cuda.empty_cache()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_decode.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
