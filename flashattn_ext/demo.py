"""A small comparison with torch SDPA on whatever device is present:
python -m flashattn_ext.demo"""
import time

import torch
import torch.nn.functional as F

import flashattn_ext


def timed(fn, device, repeats=5):
    """Median wall time of fn() in milliseconds, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    batch, heads, length, head_dim = (4, 16, 2048, 128) if device == "cuda" else (1, 4, 512, 64)
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, heads, length, head_dim, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    print(f"device {device}, {dtype}, (batch, heads, seq_len, head_dim) = {(batch, heads, length, head_dim)}, causal")

    out = flashattn_ext.scaled_dot_product_attention(q, k, v, is_causal=True)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True)
    want_grads = torch.autograd.grad(want.sum(), (q64, k64, v64))
    for name, got, expected in zip(("out", "dq", "dk", "dv"), (out, *grads), (want, *want_grads)):
        error = (got.double() - expected).abs().max().item() / expected.abs().max().item()
        print(f"  {name}: max error relative to float64 SDPA {error:.2e}")

    for name, attention in (("flashattn_ext", flashattn_ext.scaled_dot_product_attention),
                            ("torch SDPA", F.scaled_dot_product_attention)):
        forward = timed(lambda: attention(q, k, v, is_causal=True), device)
        both = timed(lambda: torch.autograd.grad(attention(q, k, v, is_causal=True).sum(), (q, k, v)), device)
        print(f"  {name:>13}: forward {forward:8.2f} ms, forward + backward {both:8.2f} ms")


if __name__ == "__main__":
    main()
