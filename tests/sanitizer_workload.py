"""A small CUDA workload for compute-sanitizer: forward and backward of flashattn_ext over a few
small, ragged shapes in float16 and bfloat16, with every causal mode, GQA, several head dims (and
values of another, MLA's), dropout on some, bool and float masks (with the float mask's gradient),
sliding windows, softcap, ALiBi, attention sinks, packed batches, decoding steps and the FP8 forward.

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 tests/sanitizer_workload.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python3 tests/sanitizer_workload.py

Sanitizers slow kernels down 10-100x, so the shapes stay small. torch's caching allocator is
switched off (before torch loads) so that each tensor is a cudaMalloc of its own: memcheck then
reports a read or write past a tensor's end, which would otherwise land silently in a
neighbouring cached block. Cases with one batch and one head put the last, partial tile of the
sequence right at the end of its allocation. Not a pytest module: it has no test functions.
"""
import os
import sys

os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")

import torch  # noqa: E402  (after the allocator setting above)

import flashattn_ext  # noqa: E402

# (batch, heads_q, heads_kv, len_q, len_k, head_dim, mode)
CASES = [
    (1, 1, 1, 1, 1, 64, "full"),
    (1, 1, 1, 65, 129, 96, "causal"),
    (1, 1, 1, 129, 65, 128, "causal_lower_right"),  # the first 64 rows see no key
    (1, 4, 2, 129, 1, 40, "full"),  # GQA, a single key
    (2, 4, 1, 65, 65, 256, "causal"),  # MQA
    (2, 2, 2, 1, 129, 128, "causal_lower_right"),
    (1, 2, 1, 129, 129, 64, "causal_lower_right"),
    # More tiles than the GPU's 132 SMs: the persistent Hopper forward's blocks take several each
    # (the first tile of each head has no visible key in the first case).
    (2, 40, 8, 260, 130, 128, "causal_lower_right"),
    (1, 48, 48, 400, 400, 64, "causal"),
    # The Hopper forward's last 176-key tile run narrow: over 48 keys of 48, and 112 keys of which 104 are real.
    (1, 2, 2, 65, 400, 128, "full"),
    (1, 2, 1, 130, 280, 96, "full"),
    # Head dim 256's kernels: a padded head dim, ragged key tiles and blocks, two query heads a key head.
    (1, 4, 2, 200, 333, 160, "causal_lower_right"),
]
DTYPES = (torch.float16, torch.bfloat16)
DROPOUT_CASES = (CASES[1], CASES[3], CASES[4])  # run again in bfloat16 with dropout_p = 0.3


def check_finite(where, **tensors):
    """Raises, naming the first of tensors (name=tensor) with an element that is not finite, and where."""
    for name, t in tensors.items():
        if not torch.isfinite(t).all():
            raise RuntimeError(f"{name} is not finite {where}")


def run(case, dtype, dropout_p=0.0):
    """Forward and backward of one case; raises if a result is not finite."""
    batch, heads_q, heads_kv, len_q, len_k, head_dim, mode = case
    q = torch.randn(batch, heads_q, len_q, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (
        torch.randn(batch, heads_kv, len_k, head_dim, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2)
    )
    is_causal, lower_right, gqa = mode != "full", mode == "causal_lower_right", heads_q != heads_kv
    out, _ = flashattn_ext.attention_with_lse(
        q, k, v, dropout_p=dropout_p, is_causal=is_causal, causal_lower_right=lower_right, enable_gqa=gqa
    )
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()  # so that a kernel's error is reported with the case that launched it
    check_finite(f"for {case} in {dtype}", out=out, dq=q.grad, dk=k.grad, dv=v.grad)


def run_dense(dtype):
    """The CASES, and in bfloat16 the DROPOUT_CASES with dropout (a section of its own: main runs
    them in both dQ modes)."""
    for case in CASES:
        run(case, dtype)
    if dtype == torch.bfloat16:
        for case in DROPOUT_CASES:
            run(case, dtype, dropout_p=0.3)


def run_sinks(dtype):
    """Attention sinks through the kernels' backward: causal (a row that sees key 0 alone), head dims
    64 and 256, GQA."""
    for head_dim in (64, 256):
        q = torch.randn(1, 4, 129, head_dim, device="cuda", dtype=dtype, requires_grad=True)
        k, v = (torch.randn(1, 2, 200, head_dim, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
        sinks = torch.randn(4, device="cuda", dtype=dtype, requires_grad=True)
        out, _ = flashattn_ext.attention_with_lse(q, k, v, is_causal=True, enable_gqa=True, sinks=sinks)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        check_finite(f"with sinks at head dim {head_dim} in {dtype}", out=out, dq=q.grad, dk=k.grad, dv=v.grad,
                     dsinks=sinks.grad)


def run_copied_inputs(dtype):
    """A query at an odd storage offset and a stride-0 upstream gradient: the glue copies both to
    aligned rows, and the copies must live until the kernels have run (memcheck would report a read
    of freed memory otherwise, the caching allocator being off)."""
    storage = torch.randn(1 + 2 * 3 * 70 * 64, device="cuda", dtype=dtype)
    q = storage[1:].view(2, 3, 70, 64).requires_grad_()
    k, v = (torch.randn(2, 3, 70, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    out = flashattn_ext.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.sum().backward()  # its gradient is a stride-0 expanded one
    torch.cuda.synchronize()
    check_finite(f"for the copied inputs in {dtype}", out=out, dq=q.grad, dk=k.grad, dv=v.grad)


def run_masked(dtype):
    """Masks over ragged tiles with GQA: a broadcast bool key mask, a float mask that requires grad
    (rows of 129 of 136 elements, which the Hopper forward's copy engine reads), a bool (L, S) one
    (rows of 129 bytes, which it does not), one that leaves every other row one key (the rows the
    backward marks), per-head float masks at head dims 64 and 128, and a key-padding mask with key
    blocks of each kind."""
    q = torch.randn(1, 2, 65, 64, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, 1, 129, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    bool_mask = torch.rand(1, 1, 1, 129, device="cuda") > 0.3
    float_mask_rows = torch.randn(65, 136, device="cuda", dtype=dtype, requires_grad=True)
    float_mask = float_mask_rows[:, :129]
    one_key = torch.rand(65, 129, device="cuda") > 0.3
    one_key[::2] = torch.arange(129, device="cuda") == 2 * torch.arange(0, 65, 2, device="cuda")[:, None]
    for mask in (bool_mask, float_mask, torch.rand(65, 129, device="cuda") > 0.3, one_key):
        out = flashattn_ext.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        out.backward(torch.randn_like(out))
    for dim in (64, 128):
        q2, k2, v2 = (torch.randn(2, 2, 200, dim, device="cuda", dtype=dtype) for _ in range(3))
        head_mask = torch.randn(2, 2, 200, 200, device="cuda", dtype=dtype)
        if not torch.isfinite(flashattn_ext.scaled_dot_product_attention(q2, k2, v2, attn_mask=head_mask)).all():
            raise RuntimeError(f"out is not finite for the per-head mask at head dim {dim} in {dtype}")
    # A key-padding mask whose 128-key blocks the Hopper forward skips (hidden), runs unmasked (visible)
    # or masks, and a batch element that sees no key.
    keep = torch.zeros(2, 1, 1, 640, dtype=torch.bool, device="cuda")
    keep[0, ..., :128] = True
    keep[0, ..., 256:384] = torch.rand(128, device="cuda") > 0.5
    q3 = torch.randn(2, 4, 300, 128, device="cuda", dtype=dtype)
    k3, v3 = (torch.randn(2, 2, 640, 128, device="cuda", dtype=dtype) for _ in range(2))
    out3 = flashattn_ext.scaled_dot_product_attention(q3, k3, v3, attn_mask=keep, enable_gqa=True)
    if not torch.isfinite(out3).all():
        raise RuntimeError(f"out is not finite for the key-padding mask's blocks in {dtype}")
    torch.cuda.synchronize()
    check_finite(f"for the masked case in {dtype}", out=out, dq=q.grad, dk=k.grad, dv=v.grad,
                 dmask=float_mask_rows.grad)


def run_mask_blocks(dtype):
    """The masks' block maps at head dims 64 (the backward's 128-query tiles, one dS^T buffer with
    a float mask) and 128: (B, 1, L, S) masks whose 64 x 128 blocks hide every pair, none or some,
    bool and float, with and without dropout, a batch element that sees no key; ragged tiles, GQA."""
    for dim in (64, 128):
        q = torch.randn(2, 4, 200, dim, device="cuda", dtype=dtype, requires_grad=True)
        k, v = (torch.randn(2, 2, 400, dim, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
        blocks = torch.randint(0, 3, (2, 1, 4, 4), device="cuda")  # 0 hidden, 1 visible, 2 partial
        blocks[1] = 0
        per_pair = blocks.repeat_interleave(64, dim=2)[:, :, :200].repeat_interleave(128, dim=3)[..., :400]
        keep = (per_pair == 1) | ((per_pair == 2) & (torch.rand(per_pair.shape, device="cuda") > 0.5))
        float_mask = torch.zeros(keep.shape, device="cuda", dtype=dtype).masked_fill(~keep, -float("inf"))
        for mask in (keep, float_mask):
            for dropout_p in (0.0, 0.3):
                out = flashattn_ext.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                                 enable_gqa=True)
                out.backward(torch.randn_like(out))
                torch.cuda.synchronize()
                if torch.isnan(out[0]).any():  # (batch element 1 sees no key: SDPA's NaN there, ours 0)
                    raise RuntimeError(f"out is NaN for a block mask at head dim {dim} in {dtype}")


def run_windowed(dtype):
    """Sliding windows through the Hopper kernels: key (query) tiles from the window's first, both
    edges crossing ragged tiles, rows that see no key, with a float mask and with dropout, head dims
    64, 128 and 256; softcap, alone and with a window; ALiBi, alone and with a window."""
    windows = [
        ((1, 2, 1, 300, 300, 64), dict(window=(70, 0), is_causal=True)),
        ((1, 2, 2, 260, 333, 128), dict(window=(40, 90))),
        ((1, 2, 2, 333, 130, 128), dict(window=(20, None), causal_lower_right=True)),  # rows that see no key
        ((1, 2, 2, 200, 300, 256), dict(window=(100, 0), is_causal=True)),
        ((1, 2, 2, 200, 304, 128), dict(window=(90, 10), attn_mask=torch.randn(200, 304, device="cuda", dtype=dtype))),
        ((1, 2, 2, 200, 300, 128), dict(window=(90, 10), dropout_p=0.3)),
        ((1, 2, 1, 200, 300, 64), dict(softcap=5.0)),  # softcap at head dim 64 (the backward's rounded P^T)
        ((1, 2, 2, 130, 250, 256), dict(softcap=5.0, window=(60, 0), is_causal=True)),
        ((1, 2, 1, 200, 300, 128), dict(softcap=5.0, window=(50, 20))),  # softcap in the Hopper backward too
        ((1, 2, 1, 200, 300, 128), dict(alibi_slopes=torch.tensor([0.5, 0.25], device="cuda"))),
        ((1, 2, 2, 210, 150, 64), dict(alibi_slopes=torch.tensor([0.5, 0.25], device="cuda"), is_causal=True)),
        ((1, 2, 2, 130, 250, 256), dict(alibi_slopes=torch.tensor([[0.5, 0.25]], device="cuda"), window=(60, 0))),
    ]
    for (batch, heads_q, heads_kv, len_q, len_k, dim), options in windows:
        q = torch.randn(batch, heads_q, len_q, dim, device="cuda", dtype=dtype, requires_grad=True)
        k, v = (torch.randn(batch, heads_kv, len_k, dim, device="cuda", dtype=dtype, requires_grad=True)
                for _ in range(2))
        out, _ = flashattn_ext.attention_with_lse(q, k, v, enable_gqa=heads_q != heads_kv, **options)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        check_finite(f"for the window {options.get('window')} in {dtype}", out=out, dq=q.grad, dk=k.grad, dv=v.grad)


def run_mla(dtype):
    """Values of another head dim than the queries' (MLA's 192 / 128, and 160 / 96 read as those) through
    the Hopper forward and backward: ragged tiles and blocks, GQA, causal both alignments, a window."""
    for (batch, heads_q, heads_kv, len_q, len_k, dim, dim_v), options in (
            ((1, 4, 2, 200, 333, 192, 128), dict(is_causal=True, causal_lower_right=True)),
            ((2, 2, 2, 130, 65, 160, 96), dict()),
            ((1, 2, 1, 150, 300, 192, 128), dict(window=(70, 10)))):
        q = torch.randn(batch, heads_q, len_q, dim, device="cuda", dtype=dtype, requires_grad=True)
        k = torch.randn(batch, heads_kv, len_k, dim, device="cuda", dtype=dtype, requires_grad=True)
        v = torch.randn(batch, heads_kv, len_k, dim_v, device="cuda", dtype=dtype, requires_grad=True)
        out, _ = flashattn_ext.attention_with_lse(q, k, v, enable_gqa=heads_q != heads_kv, **options)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        check_finite(f"for head dims {dim} / {dim_v} in {dtype}", out=out, dq=q.grad, dk=k.grad, dv=v.grad)


def run_fp8(dtype):
    """The FP8 forward's e4m3 kernel (descales a (batch, key/value head), head dim 128) and its transpose of
    V: ragged key tiles and transpose blocks, GQA, causal both alignments (rows that see no key). The
    dtype (of the main loop's sections) is unused: e4m3 in, bfloat16 out."""
    del dtype
    for batch, heads_q, heads_kv, len_q, len_k, is_causal, lower_right in (
            (1, 4, 2, 200, 333, True, True), (2, 2, 2, 130, 65, True, True), (1, 2, 1, 1, 129, False, False),
            (1, 4, 2, 130, 450, False, False)):
        q = (torch.randn(batch, heads_q, len_q, 128, device="cuda") * 40).to(torch.float8_e4m3fn)
        k, v = ((torch.randn(batch, heads_kv, len_k, 128, device="cuda") * 40).to(torch.float8_e4m3fn)
                for _ in range(2))
        descales = [torch.full((batch, heads_kv), 0.01, device="cuda") for _ in range(3)]
        out, lse = torch.ops.flashattn_ext.attention_forward_fp8(q, k, v, *descales, is_causal, lower_right,
                                                                 128**-0.5)
        torch.cuda.synchronize()
        if out.isnan().any() or lse.isnan().any():
            raise RuntimeError(f"the FP8 forward's out or lse has a NaN for {(batch, heads_q, len_q, len_k)}")


def run_varlen(dtype):
    """A packed batch through the Hopper forward's one launch (rows past a sequence's end, empty
    sequences), head dims 64, 128 and 256, causal both alignments and a window."""
    lengths_q, lengths_k = [130, 0, 1, 70, 200], [130, 5, 1, 300, 0]
    cu_q, cu_k = (torch.tensor([0] + lengths, device="cuda").cumsum(0, dtype=torch.int32)
                  for lengths in (lengths_q, lengths_k))
    for dim, options in ((64, dict(is_causal=True)), (128, dict()), (128, dict(window=(40, 0), is_causal=True)),
                         (256, dict(is_causal=True, causal_lower_right=True))):
        q = torch.randn(sum(lengths_q), 4, dim, device="cuda", dtype=dtype, requires_grad=True)
        k, v = (torch.randn(sum(lengths_k), 2, dim, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
        out = flashattn_ext.varlen_attention(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), **options)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        if not torch.isfinite(out).all():
            raise RuntimeError(f"out is not finite for the packed batch at head dim {dim} in {dtype}")


def run_varlen_bad_bounds(dtype):
    """Packed batches whose cu_seqlens are not a packed batch's bounds (decreasing, past the end,
    not from 0), forward and backward in one launch each: the kernels must stay in their tensors."""
    q, k, v = (torch.randn(300, 2, 128, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    for bounds in ([0, 250, 100, 300], [0, 100, 1000], [20, 100, 300], [0, 300, 300]):
        cu = torch.tensor(bounds, device="cuda", dtype=torch.int32)
        out = flashattn_ext.varlen_attention(q, k, v, cu, cu, 200, 200, is_causal=True)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        if not torch.isnan(out).all():
            raise RuntimeError(f"out is not NaN for the bounds {bounds} in {dtype}")


def run_decode(dtype):
    """Decoding steps: contiguous and paged caches (blocks of 16 and 256 keys, and of 4: the mma.sync
    kernel's) whose sequences end inside tiles and blocks, one with no key, len_q 1 and 3 (causal),
    and two new tokens appended; head dims 64 and 128 (the Hopper kernel's) and 32; one sequence of
    8 key heads, 1 and 8 tokens; and more key heads than SMs."""
    lengths = torch.tensor([0, 37, 300], device="cuda")
    for dim, block_size, len_q in ((128, None, 1), (64, 16, 3), (128, 256, 1), (32, 4, 1)):
        capacity = 320
        if block_size is None:
            k_cache, v_cache = (torch.randn(3, 2, capacity, dim, device="cuda", dtype=dtype) for _ in range(2))
            table = None
        else:
            per_sequence = capacity // block_size + (capacity % block_size > 0)
            k_cache, v_cache = (torch.randn(3 * per_sequence, block_size, 2, dim, device="cuda", dtype=dtype)
                                for _ in range(2))
            table = torch.randperm(3 * per_sequence, device="cuda").view(3, per_sequence).to(torch.int32)
        q = torch.randn(3, 8, len_q, dim, device="cuda", dtype=dtype)
        new = [torch.randn(3, 2, 2, dim, device="cuda", dtype=dtype) for _ in range(2)]
        out = flashattn_ext.decode_attention(q, k_cache, v_cache, lengths, block_table=table, key_new=new[0],
                                             value_new=new[1], is_causal=len_q > 1)
        torch.cuda.synchronize()
        if not torch.isfinite(out).all():
            raise RuntimeError(f"decode out is not finite at head dim {dim}, block size {block_size} in {dtype}")
    # One sequence of 8 key heads: the Hopper kernel splits each head's keys into chunks over the SMs,
    # which merge after the grid's barrier; 1 and 8 query tokens (4 and 32 query rows a key head: one
    # and two row groups). A length past the capacity beside it: NaN, from the kernel itself.
    for len_q in (1, 8):
        k_cache, v_cache = (torch.randn(2, 8, 4096, 128, device="cuda", dtype=dtype) for _ in range(2))
        q = torch.randn(2, 32, len_q, 128, device="cuda", dtype=dtype)
        out = flashattn_ext.decode_attention(q, k_cache, v_cache, torch.tensor([4000, 5000], device="cuda"),
                                             is_causal=True)
        torch.cuda.synchronize()
        if not torch.isfinite(out[0]).all() or not out[1].isnan().all():
            raise RuntimeError(f"decode out is not finite, or not NaN past the capacity, {len_q} tokens, in {dtype}")
    # More (sequence, key head) units than SMs: the Hopper kernel takes most whole and splits those left
    # over into chunks, merged by the last to finish.
    batch = torch.cuda.get_device_properties(0).multi_processor_count // 2 + 1
    k_cache, v_cache = (torch.randn(batch, 2, 2048, 128, device="cuda", dtype=dtype) for _ in range(2))
    q = torch.randn(batch, 8, 1, 128, device="cuda", dtype=dtype)
    out = flashattn_ext.decode_attention(q, k_cache, v_cache, torch.randint(0, 2049, (batch,), device="cuda"))
    torch.cuda.synchronize()
    if not torch.isfinite(out).all():
        raise RuntimeError(f"decode out is not finite with more key heads than SMs in {dtype}")


def run_masked_decode(dtype):
    """Dense decoding steps with a bool mask (the decode kernels read it a pair at a time, and no key past
    each sequence's key extent): a static cache's mask with one sequence that sees no key, with the
    Hopper kernel's split units (one sequence of 8 key heads) and at head dim 32 (the mma.sync kernel);
    a per-head mask of 8 tokens."""
    for batch, dim, keys in ((3, 128, 5000), (1, 128, 9000), (3, 32, 700)):
        q = torch.randn(batch, 32, 1, dim, device="cuda", dtype=dtype)
        k, v = (torch.randn(batch, 8, keys, dim, device="cuda", dtype=dtype) for _ in range(2))
        lengths = torch.randint(1, keys, (batch,), device="cuda")
        lengths[0] = 0
        mask = (torch.arange(keys, device="cuda") < lengths[:, None])[:, None, None]
        flashattn_ext.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    q = torch.randn(2, 8, 8, 64, device="cuda", dtype=dtype)
    k, v = (torch.randn(2, 2, 3001, 64, device="cuda", dtype=dtype) for _ in range(2))
    mask = torch.rand(2, 8, 8, 3001, device="cuda") > 0.5
    out = flashattn_ext.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.cuda.synchronize()
    if not torch.isfinite(out).all():
        raise RuntimeError(f"masked decode out is not finite in {dtype}")


def main():
    if not torch.cuda.is_available():
        sys.exit("sanitizer_workload.py needs a CUDA GPU")
    torch.manual_seed(0)
    # The backward has two dQ paths: float32 atomics (default) and a separate
    # pass (deterministic mode); both run every case.
    for deterministic in (False, True):
        torch.use_deterministic_algorithms(deterministic)
        for case in CASES:
            for dtype in DTYPES:
                run(case, dtype)
                print(f"ok {case} {dtype} deterministic={deterministic}", flush=True)
        for bits in (8, 16):  # dropout's random numbers of either size (the kernels' two paths)
            flashattn_ext.set_dropout_bits(bits)
            for case in DROPOUT_CASES:
                run(case, torch.bfloat16, dropout_p=0.3)
                print(f"ok {case} dropout {bits}-bit deterministic={deterministic}", flush=True)
        flashattn_ext.set_dropout_bits(8)
        for dtype in DTYPES:
            run_copied_inputs(dtype)
            print(f"ok copied inputs {dtype} deterministic={deterministic}", flush=True)
            run_masked(dtype)
            print(f"ok masks {dtype} deterministic={deterministic}", flush=True)
            run_mask_blocks(dtype)
            print(f"ok mask blocks {dtype} deterministic={deterministic}", flush=True)
            run_windowed(dtype)
            print(f"ok windows {dtype} deterministic={deterministic}", flush=True)
            run_varlen(dtype)
            print(f"ok packed batch {dtype} deterministic={deterministic}", flush=True)
            run_sinks(dtype)
            print(f"ok sinks {dtype} deterministic={deterministic}", flush=True)
            run_mla(dtype)
            print(f"ok values of another head dim {dtype} deterministic={deterministic}", flush=True)
    run_fp8(None)
    print("ok fp8 forward", flush=True)
    torch.use_deterministic_algorithms(False)  # (bad bounds: the one-launch paths, which do not raise)
    for dtype in DTYPES:
        run_varlen_bad_bounds(dtype)
        print(f"ok packed batch, bad bounds {dtype}", flush=True)
        run_decode(dtype)
        print(f"ok decode {dtype}", flush=True)
        run_masked_decode(dtype)
        print(f"ok masked decode {dtype}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:  # one section, e.g. `mask_blocks`, in both dtypes
        for dtype in DTYPES:
            globals()[f"run_{sys.argv[1]}"](dtype)
            print(f"ok {sys.argv[1]} {dtype}", flush=True)
    else:
        main()
