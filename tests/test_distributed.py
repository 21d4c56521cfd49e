"""flashattn_ext.distributed: context_parallel_attention over 2 and 4 processes (gloo on the CPU kernels,
NCCL on GPUs), each holding its shard of one sequence, against float64 attention over the whole
sequence in one process. Every rank checks the unsharded output and gradients."""
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import free_port, naive_attention, process_group, relative_error, small_config

# (name, layout, is_causal, heads_q, heads_kv, options); 2 x 4 x 12 = 96 tokens in all with 4 ranks.
CASES = [
    ("causal, GQA 4:2", "head_tail", True, 4, 2, {}),
    ("causal, contiguous", "contiguous", True, 2, 2, {}),
    ("not causal, softcap", "head_tail", False, 2, 1, {"softcap": 1.5}),
    ("not causal, contiguous", "contiguous", False, 2, 2, {}),
    ("window inside a chunk", "contiguous", True, 2, 2, {"window": (5, 0)}),
    ("window over chunks", "head_tail", True, 4, 2, {"window": (30, None)}),
    ("window of a chunk, head-tail", "head_tail", True, 2, 1, {"window": (14, 0), "softcap": 2.0}),
    ("ALiBi", "head_tail", True, 4, 2, {"alibi": True}),
    ("ALiBi, window, softcap", "contiguous", True, 2, 1, {"alibi": True, "window": (17, 0), "softcap": 2.0}),
    ("sinks", "head_tail", True, 4, 2, {"sinks": True}),
    ("documents", "head_tail", True, 4, 2, {"documents": True}),
    ("documents, window, ALiBi", "contiguous", True, 2, 2, {"documents": True, "window": (9, 0), "alibi": True}),
    ("documents, not causal", "head_tail", False, 2, 1, {"documents": True}),
    # (4 ranks: every rank reads every head chunk's keys and part of the tails')
    ("long documents", "head_tail", True, 4, 2, {"documents": [40, 3]}),
    # (each document within a chunk: no rank reads another's keys, no collective)
    ("documents within chunks", "head_tail", True, 2, 2, {"documents": [12]}),
    ("window, not causal", "contiguous", False, 2, 2, {"window": (7, 3)}),
    ("window over chunks, not causal", "head_tail", False, 4, 2, {"window": (30, 20)}),
    ("right window, not causal, softcap", "head_tail", False, 2, 1, {"window": (None, 13), "softcap": 1.5}),
    ("sinks, window, not causal", "contiguous", False, 2, 2, {"sinks": True, "window": (4, 9)}),
]
# Packed documents' lengths, repeated to the sequence's end (one empty; some within a chunk, some across),
# where a case's "documents" is True rather than its own list.
DOCUMENT_LENGTHS = [7, 1, 30, 0, 13, 2]
CHUNKS_EACH = 12  # tokens a chunk (2 chunks a rank in head_tail, 1 contiguous: 24 a rank both ways)
HEAD_DIM = 16
# float64 on the CPU kernels: the same sums as one process, to rounding; bf16 on the GPU, as the other GPU tests.
TOLERANCE = {torch.float64: 1e-10, torch.bfloat16: 2e-2}


def document_bounds(length, lengths):
    """cu_seqlens of documents of these lengths, in turn, filling `length` tokens."""
    bounds = [0]
    while bounds[-1] < length:
        bounds.append(min(length, bounds[-1] + lengths[(len(bounds) - 1) % len(lengths)]))
    return bounds


def reference(q, k, v, dout, is_causal, options):
    """out, dq, dk, dv (and dsinks) of the whole sequence in float64: naive attention, documents as a
    mask of same-document pairs, the sinks' extra softmax column spelled out."""
    leaves = [t.to(torch.float64, copy=True).requires_grad_() for t in (q, k, v)]
    sinks = options.get("sinks")
    if sinks is None:
        same_document = None
        if options.get("cu_seqlens") is not None:
            bounds = torch.tensor(options["cu_seqlens"])
            document = torch.bucketize(torch.arange(q.shape[2]), bounds[1:], right=True)
            same_document = (document[:, None] == document[None, :]).to(q.device)
        out, _ = naive_attention(*leaves, is_causal=is_causal, enable_gqa=True, scale=1 / math.sqrt(HEAD_DIM),
                                 window=options.get("window"), softcap=options.get("softcap"),
                                 alibi_slopes=options.get("alibi_slopes"), attn_mask=same_document)
        return [out.detach(), *torch.autograd.grad(out, leaves, dout.double())]
    sinks = sinks.to(torch.float64, copy=True).requires_grad_()
    out, lse = naive_attention(*leaves, is_causal=is_causal, enable_gqa=True, scale=1 / math.sqrt(HEAD_DIM),
                               window=options.get("window"), softcap=options.get("softcap"))
    # A sink joins each row's softmax with weight exp(sink) and value 0: out * exp(lse) / (exp(lse) + exp(sink)).
    out = out * torch.sigmoid(lse - sinks[:, None])[..., None]
    return [out.detach(), *torch.autograd.grad(out, [*leaves, sinks], dout.double())]


def run_cases(rank, world, port, backend):
    from flashattn_ext.distributed import context_parallel_attention, shard_sequence, unshard_sequence

    device = "cuda" if backend == "nccl" else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float64
    with process_group(rank, world, port, backend):
        for name, layout, is_causal, heads_q, heads_kv, extra in CASES:
            length = 2 * world * CHUNKS_EACH
            gen = torch.Generator().manual_seed(len(name))  # the same whole sequence on every rank
            batch = 1 if extra.get("documents") else 2
            q, k, v, dout = (torch.randn(batch, heads, length, HEAD_DIM, generator=gen).to(device, dtype)
                             for heads in (heads_q, heads_kv, heads_kv, heads_q))
            options = {key: extra[key] for key in ("window", "softcap") if key in extra}
            if extra.get("alibi"):
                options["alibi_slopes"] = torch.rand(heads_q, generator=gen).to(device) * 0.3
            if extra.get("sinks"):
                options["sinks"] = torch.randn(heads_q, generator=gen).to(device, dtype)
            if extra.get("documents"):
                lengths = DOCUMENT_LENGTHS if extra["documents"] is True else extra["documents"]
                options["cu_seqlens"] = document_bounds(length, lengths)
            want = reference(q, k, v, dout, is_causal, options)

            shards = [shard_sequence(t, 2, layout=layout) for t in (q, k, v, dout)]
            leaves = [t.requires_grad_() for t in shards[:3]]
            sinks = options.pop("sinks", None)
            if sinks is not None:
                sinks = sinks.clone().requires_grad_()
            out = context_parallel_attention(*leaves, layout=layout, is_causal=is_causal, enable_gqa=True,
                                             sinks=sinks, **options)
            out.backward(shards[3])
            got = [unshard_sequence(t, 2, layout=layout) for t in (out.detach(), *(t.grad for t in leaves))]
            if sinks is not None:  # each rank holds its queries' share of the sinks' gradient
                dist.all_reduce(sinks.grad)
                got.append(sinks.grad)
            for what, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
                assert g.shape == w.shape, (name, what, g.shape, w.shape)
                error = relative_error(g, w)
                assert error < TOLERANCE[dtype], (name, what, world, error)


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_attention_gloo(world):
    mp.spawn(run_cases, args=(world, free_port(), "gloo"), nprocs=world, join=True)


@pytest.mark.cuda
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_attention_nccl(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    mp.spawn(run_cases, args=(world, free_port(), "nccl"), nprocs=world, join=True)


def run_refusals(rank, world, port):
    from flashattn_ext.distributed import context_parallel_attention

    with process_group(rank, world, port, "gloo"):
        q = torch.randn(1, 2, 6, 8, dtype=torch.float64)
        with pytest.raises(ValueError, match="ALiBi with is_causal=True only"):
            context_parallel_attention(q, q, q, alibi_slopes=torch.ones(2))
        with pytest.raises(ValueError, match="window with cu_seqlens only with is_causal=True"):
            context_parallel_attention(q, q, q, window=(2, 2), cu_seqlens=[0, 5, 12])
        with pytest.raises(ValueError, match="odd"):
            context_parallel_attention(q[:, :, :5], q[:, :, :5], q[:, :, :5], is_causal=True)
        with pytest.raises(ValueError, match="one length"):
            context_parallel_attention(q, q[:, :, :4], q[:, :, :4], is_causal=True)
        with pytest.raises(ValueError, match="layout"):
            context_parallel_attention(q, q, q, layout="zigzag")
        with pytest.raises(ValueError, match="rise from 0"):  # the whole sequence is 12 tokens
            context_parallel_attention(q, q, q, is_causal=True, cu_seqlens=[0, 7, 5, 12])
        with pytest.raises(ValueError, match="rise from 0"):
            context_parallel_attention(q, q, q, is_causal=True, cu_seqlens=torch.tensor([0, 6]))
        with pytest.raises(ValueError, match="batch must be 1"):
            context_parallel_attention(q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1),
                                       is_causal=True, cu_seqlens=[0, 12])
        with pytest.raises(ValueError, match="no sinks"):
            context_parallel_attention(q, q, q, is_causal=True, cu_seqlens=[0, 12], sinks=torch.zeros(2))


def test_context_parallel_attention_refusals():
    mp.spawn(run_refusals, args=(2, free_port()), nprocs=2, join=True)


# ----------------------------------------------------------------------------- a transformers model under CP

# The models are float64, but transformers' RMSNorm and rotary tables round through float32: sums taken in
# another order (the ranks' shards) may round differently there.
MODEL_TOLERANCE = 1e-6


def next_token_loss(logits, labels, count):
    """The sum of the tokens' cross-entropies over `count`, the whole sequence's number of labels."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                             reduction="sum") / count


def run_model_cases(rank, world, port):
    import transformers

    from flashattn_ext.distributed import register_with_transformers, shard_sequence

    with process_group(rank, world, port, "gloo"):
        name = register_with_transformers(layout="head_tail")
        for family in ("llama", "mistral", "gemma2"):
            # One config a model (from_config sets the config's attention); a window of 11 reaches over chunks of 8.
            config, own_config = small_config(family, sliding_window=11), small_config(family, sliding_window=11)
            torch.manual_seed(0)
            reference = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").double()
            ours = transformers.AutoModelForCausalLM.from_config(own_config, attn_implementation=name).double()
            ours.load_state_dict(reference.state_dict())
            length = 2 * world * 8
            tokens = torch.randint(config.vocab_size, (1, length), generator=torch.Generator().manual_seed(1))
            labels = torch.cat([tokens[:, 1:], torch.full((1, 1), -100)], dim=1)  # the next token; none at the end
            positions = torch.arange(length)[None]

            loss = next_token_loss(reference(input_ids=tokens, position_ids=positions).logits, labels, length - 1)
            loss.backward()
            shard_loss = next_token_loss(
                ours(input_ids=shard_sequence(tokens, 1), position_ids=shard_sequence(positions, 1)).logits,
                shard_sequence(labels, 1), length - 1)
            shard_loss.backward()
            got_loss = shard_loss.detach().clone()
            dist.all_reduce(got_loss)
            assert abs(got_loss.item() - loss.item()) < MODEL_TOLERANCE * loss.item(), (family, got_loss.item(), loss)
            for (param_name, want), got in zip(reference.named_parameters(), ours.parameters()):
                dist.all_reduce(got.grad)  # the ranks' shares, summed as data parallelism sums them
                assert relative_error(got.grad, want.grad) < MODEL_TOLERANCE, (family, param_name)


@pytest.mark.parametrize("world", [2, 4])
def test_transformers_model_under_context_parallel(world):
    """A transformers model, each rank running its shard of one sequence with attn_implementation set to
    context_parallel_attention: loss and every parameter's gradient equal transformers' own eager
    attention over the whole sequence in one process (float64, CPU)."""
    pytest.importorskip("transformers")
    mp.spawn(run_model_cases, args=(world, free_port()), nprocs=world, join=True)
