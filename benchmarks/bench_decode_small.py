"""Small-batch and multi-token decoding (issue 44, item 4): flashattn_ext.decode_attention against stock
SDPA (cuDNN) on the same call, GPU time alone.

B = 1 and 4, GQA 32:8, head dim 128, bf16, every sequence's cache full (contiguous; a paged copy in
blocks of 16 for one token), 1 to 8 query tokens (causal, bottom-right, as in speculative decoding;
SDPA gets them without a mask, which costs it nothing). A call here takes 10-600 us, of which the
host's launch would be most at B = 1, so each provider's calls are captured 20 to a CUDA graph and
timed as the median of 15 replays (CUDA events), the providers' replays interleaved. "drop-in" is
flashattn_ext.scaled_dot_product_attention on SDPA's call (the route to the decode kernels, no
cache_seqlens). Each row first checks our first sequence's output against float64. The read rate
counts K and V once.

    python3 benchmarks/bench_decode_small.py [--out FILE]
"""
import argparse
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_decode import paged_caches  # (bench_attention, which it imports, puts this checkout first on sys.path)
import flashattn_ext

HEADS_Q, HEADS_KV, DIM = 32, 8, 128
CALLS, REPLAYS = 20, 15


def graph_times_us(fns):
    """{name: median microseconds a call} of each fn, CALLS calls captured to a graph, replays interleaved."""
    graphs = {}
    for name, fn in fns.items():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(CALLS):
                fn()
        graphs[name] = graph
    times = {name: [] for name in graphs}
    for _ in range(REPLAYS):
        for name, graph in graphs.items():
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times[name].append(begin.elapsed_time(end) / CALLS * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def reference(q, k, v):
    """One sequence's out in float64: q (Hq, T, D) against k, v (Hkv, L, D), query token i seeing keys up to
    L - T + i (causal, bottom-right)."""
    heads_kv, length, dim = k.shape
    tokens = q.shape[1]
    grouped = q.double().reshape(heads_kv, -1, dim)  # (Hkv, group * T, D): a key head's query rows
    scores = grouped @ k.double().transpose(1, 2) / dim**0.5
    token = torch.arange(grouped.shape[1], device=q.device) % tokens
    hidden = torch.arange(length, device=q.device)[None, :] > (length - tokens + token)[:, None]
    weights = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
    return (weights @ v.double()).reshape(q.shape)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    lines = [f"# Small-batch decoding: decode_attention against cuDNN ({torch.cuda.get_device_name()}, "
             f"torch {torch.__version__})", "",
             "| B | keys | cache | q tokens | ours us | drop-in us | cuDNN us | ours TB/s | cuDNN / ours | "
             "ours / ours at 1 token |", "|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for batch in (1, 4):
        for keys in (8192, 32768, 131072):
            k, v = (torch.randn(batch, HEADS_KV, keys, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            lengths = torch.full((batch,), keys, device="cuda", dtype=torch.int32)
            (k_paged, v_paged), table = paged_caches((k, v), 16)
            one_token = None
            for tokens, cache in ((1, "contiguous"), (1, "paged 16"), (2, "contiguous"), (4, "contiguous"),
                                  (8, "contiguous")):
                q = torch.randn(batch, HEADS_Q, tokens, DIM, device="cuda", dtype=torch.bfloat16)
                causal = tokens > 1
                caches = (k, v) if cache == "contiguous" else (k_paged, v_paged)
                block_table = None if cache == "contiguous" else table

                def ours():
                    return flashattn_ext.decode_attention(q, *caches, lengths, block_table=block_table,
                                                          is_causal=causal)

                error = (ours()[0].double() - reference(q[0], k[0], v[0])).abs().max().item()
                assert error < 2e-2, f"B={batch} keys={keys} {cache} {tokens} tokens: max error {error}"
                fns = {"ours": ours, "cudnn": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)}
                if cache == "contiguous":  # (without the mask, as SDPA's call: its is_causal aligns top-left)
                    fns["drop-in"] = lambda: flashattn_ext.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                times = graph_times_us(fns)
                if tokens == 1 and cache == "contiguous":
                    one_token = times["ours"]
                rate = 2 * batch * HEADS_KV * keys * DIM * 2 / (times["ours"] * 1e-6) / 1e12
                drop_in = f"{times['drop-in']:.1f}" if "drop-in" in times else "-"
                line = (f"| {batch} | {keys} | {cache} | {tokens} | {times['ours']:.1f} | {drop_in} | "
                        f"{times['cudnn']:.1f} | {rate:.2f} | {times['cudnn'] / times['ours']:.2f} | "
                        f"{times['ours'] / one_token:.2f} |")
                lines.append(line)
                print(line, flush=True)
            del k, v, k_paged, v_paged
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
