"""torch's SDPA flash backend with flashattn_ext activated as torch's flash-attention implementation,
against torch's own flash kernels (FA2), cuDNN and flashattn_ext's own SDPA: forward + backward ms,
interleaved (CUDA events, median of 30), bf16, on the GPU.

    python3 benchmarks/bench_torch_flash.py
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import (SDPBackend, activate_flash_attention_impl, restore_flash_attention_impl,
                                sdpa_kernel)

from bench_timing import interleaved_median_cuda_events  # (puts this checkout first on sys.path)
import flashattn_ext  # noqa: E402

SHAPES = [(4, 16, 4096, 128, True), (4, 16, 4096, 128, False), (8, 16, 1024, 64, True)]  # B, H, N, D, causal


def main() -> None:
    print(f"{torch.cuda.get_device_name()}; forward + backward ms")
    print("| shape | torch FA2 | cuDNN | flashattn_ext's SDPA | torch SDPA flash, flashattn_ext active |")
    print("|---|---|---|---|---|")
    for b, h, n, d, causal in SHAPES:
        q, k, v, grad = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=i < 3)
                         for i in range(4))

        def step(attention):
            def run():
                torch.autograd.grad(attention(q, k, v, is_causal=causal), (q, k, v), grad)
            return run

        def torch_sdpa(backend):
            def attention(*args, **kwargs):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(*args, **kwargs)
            return attention

        ours = step(flashattn_ext.scaled_dot_product_attention)
        fa2, cudnn, alone = interleaved_median_cuda_events(
            [step(torch_sdpa(SDPBackend.FLASH_ATTENTION)), step(torch_sdpa(SDPBackend.CUDNN_ATTENTION)), ours], 30)
        activate_flash_attention_impl("flashattn_ext")
        try:
            active, beside = interleaved_median_cuda_events([step(torch_sdpa(SDPBackend.FLASH_ATTENTION)), ours], 30)
        finally:
            restore_flash_attention_impl()
        print(f"| B{b} H{h} N{n} D{d}{' causal' if causal else ''} | {fa2 * 1e3:.3f} | {cudnn * 1e3:.3f} | "
              f"{alone * 1e3:.3f} | {active * 1e3:.3f} (ours beside it: {beside * 1e3:.3f}) |")


if __name__ == "__main__":
    main()
