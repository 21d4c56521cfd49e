"""Device check of the ahead-of-time FlashAttention-4 kernels (use.sh runs it on the GPU machine).

First a smoke test of every exported configuration of the default grid (head dim 64 and 128,
causal or not, MHA 16:16 and GQA 16:4, bfloat16 and float16) at B=2, N=1024: the output and the
gradients of flash_attn_func against SDPA in float32 on the same inputs, within twice the error of
SDPA in the inputs' dtype plus 1e-2. Prints "SMOKE PASS" or "SMOKE FAIL".
Then the timing of the MHA configurations at B=4, N=4096, H=16: median of 20 calls after 5
warm-up calls (CUDA events), as TFLOP/s with FLOPs as in bench_attention.py (forward 4*B*H*N*N*D,
halved when causal; backward 2.5x the forward), and torch SDPA's forward for reference.
"""
import torch
import torch.nn.functional as F

from fa4_aot import FA4AOT, config_key, flash_attn_func

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
HEADS = 16


def sdpa(q, k, v, causal):
    """SDPA on (B, N, H, D) tensors, FA4's layout."""
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=causal, enable_gqa=q.shape[2] != k.shape[2])
    return o.transpose(1, 2)


def smoke_test(lib) -> bool:
    ok = True
    B, N = 2, 1024
    for dtype, dname in DTYPE_NAMES.items():
        for d in (64, 128):
            for causal in (False, True):
                for hkv in (16, 4):
                    key = config_key(d, causal, HEADS // hkv, dtype)
                    if key not in lib.manifest["configs"]:
                        continue
                    q = torch.randn(B, N, HEADS, d, device="cuda", dtype=dtype, requires_grad=True)
                    k = torch.randn(B, N, hkv, d, device="cuda", dtype=dtype, requires_grad=True)
                    v = torch.randn(B, N, hkv, d, device="cuda", dtype=dtype, requires_grad=True)
                    do = torch.randn(B, N, HEADS, d, device="cuda", dtype=dtype)
                    o = flash_attn_func(q, k, v, causal=causal)
                    assert o.dtype == dtype, (o.dtype, dtype)
                    grads = torch.autograd.grad(o, (q, k, v), do)
                    # the reference: SDPA in float32; the error baseline: SDPA in the inputs' dtype
                    q32, k32, v32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
                    o32 = sdpa(q32, k32, v32, causal)
                    grads32 = torch.autograd.grad(o32, (q32, k32, v32), do.float())
                    o_sdpa = sdpa(q, k, v, causal)
                    grads_sdpa = torch.autograd.grad(o_sdpa, (q, k, v), do)
                    errors = []
                    for name, ours, ref, base in zip(("o", "dq", "dk", "dv"), (o, *grads), (o32, *grads32),
                                                     (o_sdpa, *grads_sdpa)):
                        err = (ours.float() - ref).abs().max().item()
                        err_sdpa = (base.float() - ref).abs().max().item()
                        good = err <= 2 * err_sdpa + 1e-2
                        ok &= good
                        errors.append(f"{name} {err:.2e} (sdpa-{dname} {err_sdpa:.2e}){'' if good else ' FAIL'}")
                    print(f"[check] {key}: " + "; ".join(errors), flush=True)
    return ok


def median_ms(fn, iters=20, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def time_mha(lib):
    B, N = 4, 4096
    for dtype, dname in DTYPE_NAMES.items():
        for d in (128, 64):
            for causal in (False, True):
                if config_key(d, causal, 1, dtype) not in lib.manifest["configs"]:
                    continue
                q, k, v = [torch.randn(B, N, HEADS, d, device="cuda", dtype=dtype) for _ in range(3)]
                do = torch.randn_like(q)
                flops = 4 * B * HEADS * N * N * d * (0.5 if causal else 1.0)
                out, lse = lib.fwd(q, k, v, causal)
                t_fwd = median_ms(lambda: lib.fwd(q, k, v, causal))
                t_bwd = median_ms(lambda: lib.bwd(q, k, v, out, do, lse, causal))
                qs, ks, vs = [t.transpose(1, 2) for t in (q, k, v)]
                t_sdpa = median_ms(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal))
                print(f"[perf] FA4-AOT d={d} N={N} B={B} H={HEADS} {dname} causal={causal}: "
                      f"fwd {t_fwd:.3f} ms {flops / t_fwd / 1e9:.1f} TFLOP/s | bwd {t_bwd:.3f} ms "
                      f"{2.5 * flops / t_bwd / 1e9:.1f} TFLOP/s | torch SDPA fwd {flops / t_sdpa / 1e9:.1f} TFLOP/s",
                      flush=True)


def main():
    torch.manual_seed(0)
    lib = FA4AOT()
    print("device:", torch.cuda.get_device_name(), "| exported configs:", sorted(lib.manifest["configs"]))
    print("SMOKE", "PASS" if smoke_test(lib) else "FAIL", flush=True)
    time_mha(lib)


if __name__ == "__main__":
    main()
