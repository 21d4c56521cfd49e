"""Context parallelism: one long sequence's attention shared out over the ranks of a torch.distributed group
(NCCL on GPUs, gloo on the CPU), each rank holding a shard of the sequence's queries, keys and values.

`context_parallel_attention` gathers onto every rank the keys and values its queries see (with GQA they
are a fraction of the queries' bytes) and runs each of the rank's query chunks as one call of our kernels
over every key it sees, aligned bottom-right. So no partial results are merged (the output is the one-GPU
output, computed the same way), and every option keeps its meaning under CP: windows, softcapping, ALiBi
(whose bias needs each key's distance from the query), sinks and packed documents. The backward gathers
the keys and values again (nothing of the whole sequence is kept between the passes) and sums every
rank's dK/dV contributions onto their owners in float32.

The collectives go a section at a time (section j: every rank's j-th chunk; head-tail has two), started
asynchronously: the forward's head-chunk call needs only the head chunks, and runs while the tail chunks
arrive; the backward takes the tail chunk's call first, after which the tail chunks' key gradients are
complete and travel while the head chunk's call runs. Each goes by all-to-all, only the rows that each
rank reads of the others' (a window's halo, not every key), never a rank's own.

Layouts (which chunks of the sequence a rank holds, in order, along the sequence dim):
- "head_tail": the sequence in 2 x world chunks, rank r holding chunks r and 2 x world - 1 - r: each rank
  then has the same causal work. torch's context_parallel shards its buffers so with load balancing on.
- "contiguous": rank r holds chunk r of world. Balanced for calls that see a bounded span of keys
  (a causal window) or every key (not causal).

    shards = [shard_sequence(t, dim=2, group=group, layout="head_tail") for t in (q, k, v)]
    out = context_parallel_attention(*shards, group=group, is_causal=True, layout="head_tail")
    whole = unshard_sequence(out, dim=2, group=group, layout="head_tail")
"""
import math
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .attention import _op_arguments
from .options import window_bounds

LAYOUTS = ("head_tail", "contiguous")


def _group_of(group):
    """A ProcessGroup (None: the default group) of `group`, which may also be a 1-d DeviceMesh."""
    if group is not None and hasattr(group, "get_group"):
        return group.get_group()
    return group


class _Piece(NamedTuple):
    """One call: query rows [row_begin, row_end) of the shard against keys [key_begin, key_end) of the
    whole sequence, with the window (left, right) that call takes; packed = (cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k) where the call is a packed batch of documents (offsets within the rows and
    within the keys)."""

    row_begin: int
    row_end: int
    key_begin: int
    key_end: int
    window: Optional[tuple] = None
    packed: Optional[tuple] = None


def _window_of(left: int, right: int, past: int = 0) -> Tuple[Optional[int], Optional[int]]:
    """The window (left, right) a call takes from bounds (-1 open), for queries whose diagonal the call's
    bottom-right alignment puts `past` keys right of their own position."""
    return None if left < 0 else left + past, None if right < 0 else right - past


class _Plan:
    """Where this rank's chunks sit in the whole sequence, and which keys each of its query chunks sees."""

    def __init__(self, group, layout: str, local_length: int):
        if layout not in LAYOUTS:
            raise ValueError(f"flashattn_ext: layout must be one of {LAYOUTS}, got {layout!r}")
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.per_rank = 2 if layout == "head_tail" else 1
        if local_length % self.per_rank:
            raise ValueError(f"flashattn_ext: the {layout} layout splits a rank's shard in 2 chunks; its "
                             f"length {local_length} is odd")
        self.chunk = local_length // self.per_rank
        self.chunks = self.per_rank * self.world  # of the whole sequence
        self.length = self.chunk * self.chunks
        self.layout = layout

    def owner(self, chunk: int) -> Tuple[int, int]:
        """(rank, its j-th chunk) holding global chunk `chunk`."""
        if self.layout == "contiguous" or chunk < self.world:
            return chunk, 0
        return 2 * self.world - 1 - chunk, 1

    def chunks_of(self, rank: int) -> List[int]:
        return [rank] if self.layout == "contiguous" else [rank, 2 * self.world - 1 - rank]

    def pieces(self, is_causal: bool, window: Tuple[int, int], documents: Optional[List[int]] = None,
               rank: Optional[int] = None) -> List[_Piece]:
        """The calls of `rank` (default: this one): (first query row, end row) of its shard and (first key,
        end key) of the whole sequence each. window: (left, right) bounds, -1 open. Causal, a chunk sees the
        keys up to its own end (from its window's start), which bottom-right alignment places right; not
        causal, every key, or its window's. With documents (the whole sequence's boundaries), a chunk's call
        is a packed batch of its pieces of each document, each seeing its document's keys: its keys are one
        span of the sequence."""
        left, right = window
        rank = self.rank if rank is None else rank
        if not is_causal and documents is None and left < 0 and right < 0:
            return [_Piece(0, self.chunk * self.per_rank, 0, self.length)]
        pieces = []
        for j, chunk in enumerate(self.chunks_of(rank)):
            start, end = chunk * self.chunk, (chunk + 1) * self.chunk
            if documents is None:
                key_begin = 0 if left < 0 else max(0, start - left)
                if is_causal:
                    key_end = end
                else:
                    key_end = self.length if right < 0 else min(self.length, end + right)
                # Bottom-right alignment puts query i on key i + (keys - rows) of the span: `past` keys right
                # of its own position where the span runs past the chunk's end (not causal), which the
                # window's bounds take back.
                past = key_end - end
                pieces.append(_Piece(j * self.chunk, (j + 1) * self.chunk, key_begin, key_end,
                                     _window_of(left, right, past)))
                continue
            query_ends, key_spans = [], []
            for doc_start, doc_end in zip(documents[:-1], documents[1:]):
                if doc_end <= start or doc_start >= end:
                    continue
                query_begin, query_end = max(doc_start, start), min(doc_end, end)
                if is_causal:
                    key_begin = doc_start if left < 0 else max(doc_start, query_begin - left)
                    key_spans.append((key_begin, query_end))
                else:
                    key_spans.append((doc_start, doc_end))
                query_ends.append(query_end - start)
            cu_q = [0] + query_ends
            cu_k = [0] + [span_end - key_spans[0][0] for _, span_end in key_spans]
            max_q = max(b - a for a, b in zip(cu_q[:-1], cu_q[1:]))
            max_k = max(b - a for a, b in key_spans)
            pieces.append(_Piece(j * self.chunk, (j + 1) * self.chunk, key_spans[0][0], key_spans[-1][1],
                                 _window_of(left, right), (cu_q, cu_k, max_q, max_k)))
        return pieces

    def parts(self, key_begin: int, key_end: int) -> List[Tuple[int, int, slice, slice]]:
        """Keys [key_begin, key_end) of the whole sequence by the chunk they lie in: (owner rank, its j-th
        chunk, their rows in that chunk, their rows in the span)."""
        parts = []
        for chunk in range(key_begin // self.chunk, (key_end - 1) // self.chunk + 1 if key_end > key_begin else 0):
            rank, j = self.owner(chunk)
            first = chunk * self.chunk
            begin, end = max(key_begin, first), min(key_end, first + self.chunk)
            parts.append((rank, j, slice(begin - first, end - first), slice(begin - key_begin, end - key_begin)))
        return parts


class _Routes:
    """Which rows of each rank's chunks the other ranks' calls read: rows[j][owner][reader] = (a, b), the rows
    [a, b) of owner's j-th chunk (a == b: none; a rank reads its own chunks where they lie). Section j (every
    rank's j-th chunk) goes by one all-to-all of the rows read, none where no rank reads another's."""

    def __init__(self, plan: _Plan, spans_by_rank: List[List[Tuple[int, int]]]):
        self.world = plan.world
        reads = [[[(plan.chunk, 0)] * plan.world for _ in range(plan.world)] for _ in range(plan.per_rank)]
        for reader, spans in enumerate(spans_by_rank):
            for key_begin, key_end in spans:
                for owner, j, in_chunk, _ in plan.parts(key_begin, key_end):
                    a, b = reads[j][owner][reader]
                    reads[j][owner][reader] = (min(a, in_chunk.start), max(b, in_chunk.stop))
        self.rows = [[[(a, b) if a < b and owner != reader else (0, 0) for reader, (a, b) in enumerate(by_reader)]
                      for owner, by_reader in enumerate(section)] for section in reads]
        self.crossing = [any(a < b for by_reader in section for a, b in by_reader) for section in self.rows]

    def sent(self, j: int, rank: int) -> List[Tuple[int, int]]:
        """The rows of rank's j-th chunk that each rank reads."""
        return self.rows[j][rank]

    def received(self, j: int, rank: int) -> List[Tuple[int, int]]:
        """The rows of each rank's j-th chunk that rank reads."""
        return [self.rows[j][owner][rank] for owner in range(self.world)]


def _split_sizes(rows: List[Tuple[int, int]], row_shape) -> List[int]:
    """Elements of each rank's block of rows, each row (2, B, H, D): its key's and its value's."""
    return [(b - a) * math.prod(row_shape) for a, b in rows]


def _blocks(flat: Tensor, rows: List[Tuple[int, int]], row_shape) -> List[Tuple[Tensor, int]]:
    """A flat buffer holding one block a rank (block r: rows rows[r] of a chunk, keys then values) as
    (a (2, B, H, rows, D) view, its first row in the chunk) a rank."""
    return [(part.view(*row_shape[:3], b - a, row_shape[3]), a)
            for part, (a, b) in zip(flat.split(_split_sizes(rows, row_shape)), rows)]


class _GatheredKeys:
    """The keys and values this rank's calls read: its own where they lie, the other ranks' gathered a
    section at a time (section j: every rank's j-th chunk, one all-to-all of the rows read each, all
    started at once), so that a call waits only for the sections its keys lie in and the others arrive
    while it runs."""

    def __init__(self, plan: _Plan, routes: _Routes, key: Tensor, value: Tensor, group):
        self.plan, self.pending = plan, []
        self.blocks = []  # blocks[j][owner] = (keys, values, their first row in owner's j-th chunk)
        row_shape = (2, *key.shape[:2], key.shape[3])
        for j in range(plan.per_rank):
            first_row = j * plan.chunk
            sent, received = routes.sent(j, plan.rank), routes.received(j, plan.rank)
            blocks, work = [None] * plan.world, None
            if routes.crossing[j]:
                outgoing = key.new_empty(sum(_split_sizes(sent, row_shape)))
                for block, first in _blocks(outgoing, sent, row_shape):
                    rows = slice(first_row + first, first_row + first + block.shape[3])
                    block[0].copy_(key[:, :, rows])
                    block[1].copy_(value[:, :, rows])
                incoming = key.new_empty(sum(_split_sizes(received, row_shape)))
                work = dist.all_to_all_single(incoming, outgoing, _split_sizes(received, row_shape),
                                              _split_sizes(sent, row_shape), group=group, async_op=True)
                blocks = [(block[0], block[1], first) for block, first in _blocks(incoming, received, row_shape)]
            rows = slice(first_row, first_row + plan.chunk)
            blocks[plan.rank] = (key[:, :, rows], value[:, :, rows], 0)
            self.blocks.append(blocks)
            self.pending.append(work)

    def span(self, key_begin: int, key_end: int) -> Tuple[Tensor, Tensor]:
        """Keys and values [key_begin, key_end) of the whole sequence, (B, H, keys, D) each."""
        keys, values = [], []
        for rank, j, in_chunk, _ in self.plan.parts(key_begin, key_end):
            if rank != self.plan.rank and self.pending[j] is not None:
                self.pending[j].wait()
                self.pending[j] = None
            key, value, first = self.blocks[j][rank]
            rows = slice(in_chunk.start - first, in_chunk.stop - first)
            keys.append(key[:, :, rows])
            values.append(value[:, :, rows])
        if len(keys) == 1:  # (rows of one block: a view)
            return keys[0], values[0]
        return torch.cat(keys, dim=2), torch.cat(values, dim=2)

    def finish(self) -> None:
        """Waits for the sections no call needed, so that no collective outlives the call."""
        for work in self.pending:
            if work is not None:
                work.wait()


class _KeyGradients:
    """Every rank's gradients of the keys and values it read, summed onto their owners in float32: a
    rank's own rows where they lie, the other ranks' sent back to them a section (every rank's j-th chunk)
    an all-to-all, the reverse of the forward's. The sections go in one order on every rank (the last
    first, as collectives must), each as soon as this rank's calls left add nothing to it, so that it
    travels while those calls run."""

    def __init__(self, plan: _Plan, routes: _Routes, key: Tensor, group, calls_by_section: List[int]):
        self.plan, self.routes, self.group, self.calls_left = plan, routes, group, list(calls_by_section)
        dtype = torch.float64 if key.dtype == torch.float64 else torch.float32
        self.row_shape = (2, *key.shape[:2], key.shape[3])
        self.mine = key.new_zeros((2, *key.shape), dtype=dtype)  # this rank's dK and dV
        # sections[j]: the sums this rank sends back; blocks[j][owner] = (a view of them, its first row)
        self.sections, self.blocks, self.returned = [], [], []
        for j in range(plan.per_rank):
            received = self.routes.received(j, plan.rank)
            section = key.new_zeros(sum(_split_sizes(received, self.row_shape)), dtype=dtype)
            blocks = _blocks(section, received, self.row_shape)
            blocks[plan.rank] = (self.mine[:, :, :, j * plan.chunk:(j + 1) * plan.chunk], 0)
            self.sections.append(section)
            self.blocks.append(blocks)
            self.returned.append(section.new_empty(sum(_split_sizes(routes.sent(j, plan.rank), self.row_shape))))
        self.order, self.pending = list(reversed(range(plan.per_rank))), []
        self._send(finished=False)

    def add(self, grad_key: Tensor, grad_value: Tensor, key_begin: int) -> None:
        """Adds one call's gradients of keys [key_begin, key_begin + keys), then sends the sections done."""
        touched = set()
        for rank, j, in_chunk, in_span in self.plan.parts(key_begin, key_begin + grad_key.shape[2]):
            block, first = self.blocks[j][rank]
            for which, grad in enumerate((grad_key, grad_value)):
                block[which, :, :, in_chunk.start - first:in_chunk.stop - first] += grad[:, :, in_span]
            touched.add(j)
        for j in touched:
            self.calls_left[j] -= 1
        self._send(finished=False)

    def _send(self, finished: bool) -> None:
        while len(self.pending) < len(self.order):
            j = self.order[len(self.pending)]
            if self.calls_left[j] and not finished:
                return
            work = None
            if self.routes.crossing[j]:
                sent, received = self.routes.sent(j, self.plan.rank), self.routes.received(j, self.plan.rank)
                work = dist.all_to_all_single(self.returned[j], self.sections[j], _split_sizes(sent, self.row_shape),
                                              _split_sizes(received, self.row_shape), group=self.group,
                                              async_op=True)
            self.pending.append((j, work))

    def result(self, key: Tensor, value: Tensor) -> Tuple[Tensor, Tensor]:
        """This rank's dK and dV, in key's and value's dtypes."""
        self._send(finished=True)
        for j, work in self.pending:
            if work is None:
                continue
            work.wait()
            for block, first in _blocks(self.returned[j], self.routes.sent(j, self.plan.rank), self.row_shape):
                begin = j * self.plan.chunk + first
                self.mine[:, :, :, begin:begin + block.shape[3]] += block
        return self.mine[0].to(key.dtype), self.mine[1].to(value.dtype)


def _offsets(values: List[int], device: torch.device) -> Tensor:
    """A packed call's cu_seqlens on `device`: int32, copied from pinned memory without waiting."""
    offsets = torch.tensor(values, dtype=torch.int32)
    if device.type == "cuda":
        return offsets.pin_memory().to(device, non_blocking=True)
    return offsets


def _packed(t: Tensor, begin: int, end: int) -> Tensor:
    """Rows [begin, end) of a (1, H, L, D) tensor as the packed ops take them: (rows, H, D), a view."""
    return t[0, :, begin:end].transpose(0, 1)


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, sinks, group, plan, options):
        is_causal, scale, enable_gqa, window, softcap, alibi_slopes, documents = options
        pieces_by_rank = [plan.pieces(is_causal, window_bounds(window), documents, rank)
                          for rank in range(plan.world)]
        routes = _Routes(plan, [[(piece.key_begin, piece.key_end) for piece in pieces] for pieces in pieces_by_rank])
        gathered = _GatheredKeys(plan, routes, key, value, group)
        outs, lses, calls = [], [], []
        for piece in pieces_by_rank[plan.rank]:  # (head-tail: the head first)
            rows = slice(piece.row_begin, piece.row_end)
            span_key, span_value = gathered.span(piece.key_begin, piece.key_end)
            args, *_ = _op_arguments(query[:, :, rows], span_key, span_value, None, 0.0, is_causal, scale,
                                     enable_gqa, True, piece.window, softcap, alibi_slopes)
            options_of_op = args[4:]  # dropout_p, is_causal, lower_right, scale, window, softcap, slopes
            if piece.packed is None:
                out, lse, _ = torch.ops.flashattn_ext.attention_forward(*args, sinks=sinks)
            else:
                cu_q, cu_k, max_q, max_k = piece.packed
                cu_q, cu_k = (_offsets(cu, query.device) for cu in (cu_q, cu_k))
                slopes = options_of_op[-1]
                if slopes is not None:  # (1, Hq): one row a document
                    slopes = slopes.expand(len(cu_q) - 1, -1).contiguous()
                options_of_op = (*options_of_op[:-1], slopes)
                out, lse = torch.ops.flashattn_ext.varlen_forward(
                    _packed(query, rows.start, rows.stop), _packed(span_key, 0, span_key.shape[2]),
                    _packed(span_value, 0, span_value.shape[2]), cu_q, cu_k, max_q, max_k, *options_of_op[1:])
                out, lse = out.transpose(0, 1).unsqueeze(0), lse.unsqueeze(0)
                options_of_op = (cu_q, cu_k, max_q, max_k, *options_of_op)
            outs.append(out)
            lses.append(lse)
            calls.append((piece, options_of_op))
        gathered.finish()
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(query, key, value, sinks, out, lse)
        ctx.group, ctx.plan, ctx.routes, ctx.calls = group, plan, routes, calls
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        query, key, value, sinks, out, lse = ctx.saved_tensors
        plan = ctx.plan
        gathered = _GatheredKeys(plan, ctx.routes, key, value, ctx.group)
        calls = ctx.calls[::-1]  # (head-tail: the tail first, after which the tails' key gradients are done)
        calls_by_section = [0] * plan.per_rank
        for piece, _ in calls:
            for j in {j for _, j, _, _ in plan.parts(piece.key_begin, piece.key_end)}:
                calls_by_section[j] += 1
        key_grads = _KeyGradients(plan, ctx.routes, key, ctx.group, calls_by_section)
        grad_out = grad_out.contiguous()
        grad_query = torch.empty_like(query)
        grad_sinks = None if sinks is None or not ctx.needs_input_grad[3] else torch.zeros_like(sinks)
        for piece, options_of_op in calls:
            rows = slice(piece.row_begin, piece.row_end)
            span_key, span_value = gathered.span(piece.key_begin, piece.key_end)
            piece_out, piece_lse = out[:, :, rows].contiguous(), lse[:, :, rows].contiguous()
            piece_grad = grad_out[:, :, rows]
            if piece.packed is None:
                dropout_p, is_causal, lower_right, scale, window_left, window_right, softcap, slopes = options_of_op
                grad_q, grad_k, grad_v, _ = torch.ops.flashattn_ext.attention_backward(
                    piece_grad, query[:, :, rows], span_key, span_value, piece_out, piece_lse,
                    query.new_empty(0, dtype=torch.int64), None, dropout_p, is_causal, lower_right, scale, False,
                    window_left, window_right, softcap, slopes, sinks)
                if grad_sinks is not None:
                    grad_sinks += torch.ops.flashattn_ext.sinks_backward(piece_grad, piece_out, piece_lse, sinks)
            else:
                cu_q, cu_k, max_q, max_k, _dropout_p, *varlen_options = options_of_op
                grads = torch.ops.flashattn_ext.varlen_backward(
                    _packed(piece_grad, 0, piece_grad.shape[2]), _packed(query, rows.start, rows.stop),
                    _packed(span_key, 0, span_key.shape[2]), _packed(span_value, 0, span_value.shape[2]),
                    _packed(piece_out, 0, piece_out.shape[2]), piece_lse[0], cu_q, cu_k, max_q, max_k,
                    *varlen_options)
                grad_q, grad_k, grad_v = (t.transpose(0, 1).unsqueeze(0) for t in grads)
            grad_query[:, :, rows] = grad_q
            key_grads.add(grad_k, grad_v, piece.key_begin)
        gathered.finish()
        grad_key, grad_value = key_grads.result(key, value)
        return grad_query, grad_key, grad_value, grad_sinks, None, None, None


def context_parallel_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    group=None,
    *,
    layout: str = "head_tail",
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    cu_seqlens=None,
    return_lse: bool = False,
):
    """Attention over a sequence sharded along dim 2 over `group`'s ranks (a ProcessGroup, a 1-d
    DeviceMesh, or None for the default group). query, key, value: this rank's shards (B, H, L, E), the
    same L on every rank, holding the sequence's chunks as `layout` says (module docstring). Returns this
    rank's shard of the output (with return_lse, also of the log-sum-exp, float32 (B, Hq, L)).

    The options mean what they mean in attention_with_lse, over the whole sequence's positions: is_causal
    (the whole sequence is square: top-left and bottom-right agree), window (left, right), softcap,
    alibi_slopes, sinks. ALiBi needs is_causal=True (not causal, a chunk's keys lie on both sides of it,
    and ALiBi's distances would need the kernels to place the diagonal inside the keys). The gradients of
    query, key and value are this rank's shards; a sinks tensor gets this rank's queries' share of its
    gradient (as a replicated parameter's is, summed over the ranks where the model's gradients are
    reduced). No dropout or attn_mask.

    cu_seqlens: documents packed in the sequence (as varlen_attention's, but of the whole sequence: a list
    or CPU tensor of boundaries, 0 first and the sequence's length last, non-decreasing). Each document
    attends within itself only (causal: bottom-right, as varlen_attention), with B = 1; a chunk's pieces
    of its documents go to the kernels as one packed call. No sinks with documents.
    """
    group = _group_of(group)
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, Tensor) or tensor.dim() != 4:
            raise ValueError(f"flashattn_ext: context_parallel_attention's {name} must be a 4-d tensor "
                             f"(B, H, L, E), got {getattr(tensor, 'shape', type(tensor).__name__)}")
    if not (query.shape[2] == key.shape[2] == value.shape[2]):
        raise ValueError(f"flashattn_ext: context_parallel_attention's shards must be of one length (one "
                         f"sequence's chunks), got query {query.shape[2]}, key {key.shape[2]}, "
                         f"value {value.shape[2]}")
    if not is_causal and alibi_slopes is not None:
        raise ValueError("flashattn_ext: context_parallel_attention takes ALiBi with is_causal=True only (not "
                         "causal, a chunk's keys lie on both sides of it, and no call of our kernels can "
                         "place its queries' diagonal inside the keys for ALiBi's distances)")
    if not is_causal and window_bounds(window) != (-1, -1) and cu_seqlens is not None:
        raise ValueError("flashattn_ext: context_parallel_attention takes a window with cu_seqlens only with "
                         "is_causal=True")
    plan = _Plan(group, layout, query.shape[2])
    documents = None if cu_seqlens is None else _documents(cu_seqlens, plan.length, query.shape[0], sinks)
    options = (bool(is_causal), scale, bool(enable_gqa), window, softcap, alibi_slopes, documents)
    out, lse = _ContextParallelAttention.apply(query, key, value, sinks, group, plan, options)
    return (out, lse) if return_lse else out


def _documents(cu_seqlens, length: int, batch: int, sinks) -> List[int]:
    """cu_seqlens checked, as a list of ints (read on the host: the plan needs it there)."""
    if isinstance(cu_seqlens, Tensor):
        if cu_seqlens.device.type != "cpu":
            raise ValueError("flashattn_ext: context_parallel_attention's cu_seqlens must be on the CPU (each "
                             "rank plans its calls from it), got one on " + str(cu_seqlens.device))
        cu_seqlens = cu_seqlens.tolist()
    documents = [int(b) for b in cu_seqlens]
    if len(documents) < 2 or documents[0] != 0 or documents[-1] != length or \
            any(b < a for a, b in zip(documents[:-1], documents[1:])):
        raise ValueError(f"flashattn_ext: cu_seqlens must rise from 0 to the whole sequence's length {length}, "
                         f"got {documents}")
    if batch != 1:
        raise ValueError(f"flashattn_ext: with cu_seqlens (documents packed in one sequence) the batch must be 1, "
                         f"got {batch}")
    if sinks is not None:
        raise ValueError("flashattn_ext: context_parallel_attention takes no sinks with cu_seqlens")
    return documents


def shard_sequence(tensor: Tensor, dim: int, group=None, layout: str = "head_tail") -> Tensor:
    """This rank's shard of a whole sequence held on every rank (a copy): the chunks `layout` gives it,
    in order, along dim."""
    group = _group_of(group)
    plan = _Plan(group, layout, tensor.shape[dim] // dist.get_world_size(group))
    if plan.length != tensor.shape[dim]:
        raise ValueError(f"flashattn_ext: a sequence of {tensor.shape[dim]} does not split into "
                         f"{plan.chunks} equal chunks")
    chunks = tensor.split(plan.chunk, dim)
    return torch.cat([chunks[c] for c in plan.chunks_of(plan.rank)], dim)


def unshard_sequence(shard: Tensor, dim: int, group=None, layout: str = "head_tail") -> Tensor:
    """The whole sequence (on every rank) from each rank's shard: shard_sequence's inverse."""
    group = _group_of(group)
    plan = _Plan(group, layout, shard.shape[dim])
    gathered = [torch.empty_like(shard) for _ in range(plan.world)]
    dist.all_gather(gathered, shard.contiguous(), group=group)
    pieces = [gathered[rank].split(plan.chunk, dim)[j] for rank, j in map(plan.owner, range(plan.chunks))]
    return torch.cat(pieces, dim)


def register_with_transformers(group=None, layout: str = "head_tail", name: str = "fa_ext_cp") -> str:
    """Registers context_parallel_attention over `group` with transformers' AttentionInterface (and a
    mask function that builds no mask) under `name`, so that a model made with attn_implementation=name
    runs each rank on its shard of one sequence: input_ids (B, L) this rank's tokens in `layout`,
    position_ids their positions in the whole sequence (shard_sequence of arange(N)). Causal decoders with
    no padding: sliding windows, softcapping and sinks keep their meaning over the whole sequence. The
    loss is the rank's share (sum over its tokens, divided by the whole sequence's count), and the
    parameters' gradients are summed over the ranks as under data parallelism. Returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        if attention_mask is not None or dropout:
            raise ValueError(f"flashattn_ext: {name} (context parallel) takes no attention mask or dropout")
        sliding_window = kwargs.get("sliding_window")
        out = context_parallel_attention(
            query, key, value, group, layout=layout,
            is_causal=is_causal if is_causal is not None else getattr(module, "is_causal", True), scale=scaling,
            enable_gqa=key.shape[1] != query.shape[1],
            window=(int(sliding_window) - 1, 0) if sliding_window else None, softcap=kwargs.get("softcap"),
            sinks=kwargs.get("s_aux"))
        return out.transpose(1, 2).contiguous(), None

    def no_mask(*args, attention_mask=None, **kwargs):
        # Which keys a query sees is the attention's own (causal, window) over the whole sequence.
        if attention_mask is not None:
            raise ValueError(f"flashattn_ext: {name} (context parallel) takes no attention_mask (padding)")
        return None

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, no_mask)
    return name
