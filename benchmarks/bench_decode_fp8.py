"""FP8 KV-cache decoding (issue 47, item 3): flashattn_ext.decode_attention on float8_e4m3fn caches against
the same call on bfloat16 caches, in tokens per second, and the rate each reads its cache at.

One query token per sequence, bf16 queries, GQA 32:8, head dim 128, B = 1 and 64, 32k and 128k keys (fewer
sequences where the caches would not fit), every sequence's cache full, contiguous and paged (vLLM's
layout, blocks of 16 and 256 keys, shuffled), one scale a key/value head. The bf16 cache holds the FP8
cache's values dequantized (exactly: the scales are powers of two), so the two outputs must agree to
bf16's rounding, which each row checks first. Each provider's calls are captured 20 to a CUDA graph and
timed as the median of 15 replays (CUDA events), the providers' replays interleaved (bench_decode_small).

    python3 benchmarks/bench_decode_fp8.py [--lengths 32768 131072] [--batches 1 64] [--out FILE]
"""
import argparse
from pathlib import Path

import torch

from bench_decode_small import graph_times_us  # (it puts this checkout first on sys.path)
import flashattn_ext

HEADS_Q, HEADS_KV, DIM = 32, 8, 128


def fp8_caches(batch, length, block_size, gen):
    """Random e4m3 key and value caches (values up to about 4 x 16 of e4m3's 448), contiguous (B, H, L, D) or
    paged (blocks, block_size, H, D) with a shuffled block table, filled a sequence at a time (no float32
    copy of the whole cache)."""
    if block_size is None:
        shape, table = (batch, HEADS_KV, length, DIM), None
    else:
        blocks = batch * length // block_size
        shape = (blocks, block_size, HEADS_KV, DIM)
        table = torch.randperm(blocks, device="cuda", generator=gen).view(batch, -1).to(torch.int32)
    caches = []
    for _ in range(2):
        cache = torch.empty(shape, device="cuda", dtype=torch.float8_e4m3fn)
        for piece in cache.view(batch, -1):
            piece.copy_(torch.randn(piece.shape, device="cuda", generator=gen).mul_(16))
        caches.append(cache)
    return caches, table


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--caches", nargs="+", default=["contiguous", "16", "256"],
                        help="'contiguous', or a paged cache's block size")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    lines = [f"# FP8 KV-cache decoding: decode_attention on e4m3 caches against bf16 caches "
             f"({torch.cuda.get_device_name()}, torch {torch.__version__})", "",
             "| L | B | cache | bf16 us | FP8 us | bf16 tokens/s | FP8 tokens/s | FP8 / bf16 | bf16 TB/s | FP8 TB/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for length in args.lengths:
        for wanted_batch in args.batches:
            fp8_bytes = 2 * HEADS_KV * length * DIM  # K and V of one sequence
            # Room for the FP8 caches, their bf16 twins and a float32 temporary.
            batch = min(wanted_batch, max(1, int(torch.cuda.mem_get_info()[0] * 0.8) // (3 * fp8_bytes)))
            query = torch.randn(batch, HEADS_Q, 1, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
            lengths = torch.full((batch,), length, device="cuda", dtype=torch.int32)
            scales = [torch.full((HEADS_KV,), 2.0**-4, device="cuda") * 2.0 ** torch.arange(HEADS_KV, device="cuda")
                      for _ in range(2)]
            for block in (None if cache == "contiguous" else int(cache) for cache in args.caches):
                (key_fp8, value_fp8), table = fp8_caches(batch, length, block, gen)
                heads_at = 1 if block is None else 2
                view = [1, 1, 1, 1]
                view[heads_at] = -1
                key_bf16, value_bf16 = (c.to(torch.bfloat16) * s.view(view).to(torch.bfloat16)
                                        for c, s in zip((key_fp8, value_fp8), scales))

                def bf16():
                    return flashattn_ext.decode_attention(query, key_bf16, value_bf16, lengths, block_table=table)

                def fp8():
                    return flashattn_ext.decode_attention(query, key_fp8, value_fp8, lengths, block_table=table,
                                                          key_scale=scales[0], value_scale=scales[1])

                error = (fp8().float() - bf16().float()).abs().max().item()
                scale = bf16().float().abs().max().item()
                assert error <= 2e-2 * scale, f"FP8 and bf16 caches disagree: {error} of {scale}"
                times = graph_times_us({"bf16": bf16, "fp8": fp8})
                cache = "contiguous" if block is None else f"paged {block}"
                bf16_rate, fp8_rate = batch / times["bf16"] * 1e6, batch / times["fp8"] * 1e6
                line = (f"| {length} | {batch} | {cache} | {times['bf16']:.1f} | {times['fp8']:.1f} | "
                        f"{bf16_rate:.0f} | {fp8_rate:.0f} | {times['bf16'] / times['fp8']:.2f} | "
                        f"{2 * batch * fp8_bytes / times['bf16'] / 1e6:.2f} | "
                        f"{batch * fp8_bytes / times['fp8'] / 1e6:.2f} |")
                print(line, flush=True)
                lines.append(line)
                del key_fp8, value_fp8, key_bf16, value_bf16, table
                torch.cuda.empty_cache()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
