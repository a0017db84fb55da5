"""Ring attention: causal attention over a sequence split across context-parallel (CP) ranks.

Layout (load-balanced): the sequence, padded to a multiple of ``2 * cp``, is cut into
``2 * cp`` chunks and rank r holds chunk r and chunk ``2cp - 1 - r``. Under causal masking an
early chunk sees few keys and a late one many, so each rank pairing one of each does the same
work.

Each rank keeps its queries and passes its keys and values around the ring (to rank r + 1,
from rank r - 1): after ``cp`` steps it has met every rank's K/V block, and the partial result
of each block is merged with the log-sum-exp (online softmax) rule. Whether a query sees a key
is decided on global columns, which every rank knows from the layout: causal order, the same
document (from the ``DocumentMask`` of the whole sequence, which every rank holds, so no
document id needs to travel with the blocks), the sliding window. Attention sinks join each
row's denominator once, after the merge, never once per block.

The backward is a custom autograd function: the forward keeps only the local q, k, v, output
and log-sum-exp; the backward passes K and V around the ring again together with their
gradient accumulators, recomputing each block's probabilities from the saved log-sum-exp (as
flash attention's backward does), so every rank's dK and dV come home after ``cp`` shifts.

Overlap: the next block's transfer (batched isend/irecv) is posted before the current block's
compute, forward and backward; in the backward each block's dK and dV are computed on their
own and added to the accumulator that arrived meanwhile (sent by the previous rank after its
own compute), so that transfer overlaps a block's compute too. ``overlap=False`` waits for
each transfer before computing (the same numbers, in series: for comparison).

Per block, two kernels (``fused``): torch's fused attention kernel that returns the
log-sum-exp (``temper.utils.compat.fused_attention_forward``: flash on CPU, flash on CUDA for
fp16/bf16), or the plain-PyTorch reference (scores in fp32, a tile of queries at a time so
that no more than ``tile_scores`` of them exist at once, whatever the context length). The
fused kernel takes no mask, only causal order, so it runs what causal order alone decides:
the rank's own block (square, causal) and every other block's visible rectangle (which the
load-balanced layout makes whole: all of this rank's queries over the first half of an
earlier rank's keys, or this rank's later half of queries over all of a later rank's). A
block with document boundaries in it runs the fused kernel once per batch row and document
found in both its queries and its keys (each such piece is again a causal square or a whole
rectangle, since documents are contiguous), writing that document's rows; rows whose
document has no key in the block keep output 0 and log-sum-exp -inf, as the mask gives.
Where the sliding window cuts a block, and for heads the kernel cannot take (MLA's value
head narrower than q's is padded with zeros; a wider one or fp32 on CUDA is not), the
reference runs, in the same ring.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from temper.kernels.attention import DocumentMask
from temper.utils.compat import (
    fused_attention_backward,
    fused_attention_forward,
    fused_attention_runs,
)


def load_balanced_indices(
    seq_len: int, rank: int, size: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """The global columns rank ``rank`` of ``size`` holds, in its local order: chunk ``rank``
    then chunk ``2 * size - 1 - rank`` of the ``2 * size`` chunks of ``seq_len``."""
    if seq_len % (2 * size):
        raise ValueError(
            f"context parallelism splits a sequence into 2 x cp = {2 * size} chunks; its "
            f"length {seq_len} is not a multiple of that (pad it first)"
        )
    chunk = seq_len // (2 * size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    return torch.cat([first, first + (2 * size - 1 - 2 * rank) * chunk])


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    docs: DocumentMask | None,
    group: dist.ProcessGroup,
    *,
    scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    fused: bool = True,
    overlap: bool = True,
    tile_scores: int = 2**24,
) -> torch.Tensor:
    """Causal (block-causal with ``docs``) attention of this rank's queries over the whole
    sequence held by the CP ``group`` in the load-balanced layout.

    q [b, s, h, d], k [b, s, h_kv, d], v [b, s, h_kv, d_v] are this rank's ``s`` tokens (h a
    multiple of h_kv; d_v may differ from d, as in MLA); ``docs`` is the whole sequence's
    mask ([b, s * cp], global order), None for one document per row. ``scale``, ``window``
    and ``sinks`` [h] mean what they mean for ``temper.kernels.attention.attention``, with
    columns counted globally. ``fused``: torch's fused kernel for the blocks it can run
    (module docstring), else the reference for every block. ``overlap``: each transfer in
    flight during a block's compute (False: waited for first). ``tile_scores``: the most
    scores the reference computes at once (2^24 fp32: 64 MiB, and as much again for their
    probabilities), which sets how many queries a tile holds.
    Returns [b, s, h, d_v] in q's dtype.
    """
    size = dist.get_world_size(group)
    b, s, h, _ = q.shape
    if h % k.shape[2]:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({k.shape[2]})")
    if docs is not None and tuple(docs.doc_ids.shape) != (b, s * size):
        raise ValueError(
            f"ring attention needs the whole sequence's document mask, [batch, seq x cp] = "
            f"{[b, s * size]}, got {list(docs.doc_ids.shape)}"
        )
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    doc_ids = None if docs is None else docs.doc_ids
    fused = fused and v.shape[-1] <= q.shape[-1] and fused_attention_runs(q)
    ring = _Ring(group, q, doc_ids, window, tile_scores, fused, overlap)
    return _RingAttention.apply(q, k, v, sinks, ring, scale)


class _RingAttention(torch.autograd.Function):
    """See the module docstring. Internally heads are grouped: q [b, s, h_kv, g, d], scores
    [b, h_kv, g, s_q, s_k], log-sum-exp [b, h_kv, g, s_q]."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
        ring: _Ring,
        scale: float,
    ) -> torch.Tensor:
        q5 = _grouped(q, k.shape[2]).float()
        b, s, h_kv, g, _ = q5.shape
        out = q5.new_zeros(b, s, h_kv, g, v.shape[3])
        lse = q5.new_full((b, h_kv, g, s), float("-inf"))
        block = [k, v]
        for step in range(ring.size):
            receive = ring.shift(block) if step < ring.size - 1 else None
            source = ring.source(step)
            pieces = ring.pieces[source]
            if pieces is not None:
                for batch, rows, keys, causal in pieces:
                    block_out, block_lse = _fused_block(
                        q[batch], *(t[batch] for t in block), rows, keys, causal, scale
                    )
                    out[batch, rows], lse[batch, ..., rows] = _merge(
                        out[batch, rows], lse[batch, ..., rows], block_out, block_lse
                    )
            else:
                keys, values = (t.float() for t in block)
                for rows, end in ring.tiles(source):
                    scores = ring.scores(q5[:, rows], keys[:, :end], source, scale, rows)
                    block_lse = scores.logsumexp(dim=-1)
                    probs = torch.exp(scores - _finite(block_lse)[..., None])
                    block_out = torch.einsum("bhgqk,bkhe->bqhge", probs, values[:, :end])
                    out[:, rows], lse[..., rows] = _merge(
                        out[:, rows], lse[..., rows], block_out, block_lse
                    )
            if receive is not None:
                block = receive()
        if sinks is not None:
            total = torch.logaddexp(lse, sinks.float().view(1, h_kv, g, 1))
            out = out * _per_query(torch.exp(lse - total))
            lse = total
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.ring, ctx.scale = ring, scale
        return out.flatten(2, 3)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, sinks = ctx.saved_tensors
        ring: _Ring = ctx.ring
        scale: float = ctx.scale
        q5 = _grouped(q, k.shape[2]).float()
        grad_out = grad_out.reshape(out.shape)
        d_out = grad_out.float()
        # The softmax backward's row term: sum_j p_j (dO . v_j) = dO . O.
        delta = (d_out * out.float()).sum(dim=-1).permute(0, 2, 3, 1)
        dq = torch.zeros_like(q5)
        block = [k, v]
        arriving: Callable[[], list[torch.Tensor]] | None = None
        for step in range(ring.size):
            receive = ring.shift(block) if step < ring.size - 1 else None
            source = ring.source(step)
            grads = [torch.zeros_like(t, dtype=torch.float32) for t in block]
            pieces = ring.pieces[source]
            if pieces is not None:
                for batch, rows, keys, causal in pieces:
                    block_dq, d_keys, d_values = _fused_block_backward(
                        grad_out[batch],
                        q[batch],
                        *(t[batch] for t in block),
                        out[batch],
                        lse[batch],
                        rows,
                        keys,
                        causal,
                        scale,
                    )
                    dq[batch, rows] += block_dq
                    grads[0][batch, keys] += d_keys
                    grads[1][batch, keys] += d_values
            else:
                keys, values = (t.float() for t in block)
                for rows, end in ring.tiles(source):
                    scores = ring.scores(q5[:, rows], keys[:, :end], source, scale, rows)
                    probs = torch.exp(scores - lse[..., rows, None])
                    d_probs = torch.einsum("bqhge,bkhe->bhgqk", d_out[:, rows], values[:, :end])
                    d_scores = probs * (d_probs - delta[..., rows, None])
                    dq[:, rows] += (
                        torch.einsum("bhgqk,bkhd->bqhgd", d_scores, keys[:, :end]) * scale
                    )
                    d_keys = torch.einsum("bhgqk,bqhgd->bkhd", d_scores, q5[:, rows]) * scale
                    grads[0][:, :end] += d_keys
                    grads[1][:, :end] += torch.einsum("bhgqk,bqhge->bkhe", probs, d_out[:, rows])
            # The accumulators travel with their block: what the previous rank gathered for
            # this block arrived during the compute above; the last shift brings them home.
            if arriving is not None:
                grads = [mine + theirs for mine, theirs in zip(grads, arriving(), strict=True)]
            arriving = ring.shift(grads) if ring.size > 1 else None
            if receive is not None:
                block = receive()
        d_sinks = None
        if sinks is not None:
            # d out / d sink = -p_sink * out per row, so dL/d sink = -sum_rows p_sink * delta.
            sink = sinks.float().view(1, *lse.shape[1:3], 1)
            d_sinks = -(torch.exp(sink - lse) * delta).sum(dim=(0, 3)).flatten().to(sinks.dtype)
        dk, dv = grads if arriving is None else arriving()
        dq = dq.view(q.shape).to(q.dtype)
        return dq, dk.to(k.dtype), dv.to(v.dtype), d_sinks, None, None


def _fused_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: slice,
    keys: slice,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Query ``rows`` over the ``keys`` of a block, every pair visible (or causal):
    output [b, s_q, h_kv, g, d_v] (fp32) and log-sum-exp [b, h_kv, g, s_q], from torch's
    fused kernel."""
    b, _, h_kv, d_v = v.shape
    qb = q[:, rows].transpose(1, 2)
    kb, vb = (t[:, keys].transpose(1, 2) for t in (k, v))
    out, lse = fused_attention_forward(qb, kb, _pad_head(vb, q.shape[-1]), causal, scale)
    out = out[..., :d_v].transpose(1, 2).float()
    return out.reshape(b, -1, h_kv, q.shape[2] // h_kv, d_v), lse.view(b, h_kv, -1, lse.shape[-1])


def _fused_block_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    rows: slice,
    keys: slice,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of dq [b, s_q, h_kv, g, d] and its dk, dv for its ``keys``
    ([b, s_k, h_kv, d(_v)]), all fp32, from the whole row's output and log-sum-exp (grouped
    as the forward keeps them)."""
    b, _, h_kv, d_v = v.shape
    d = q.shape[-1]
    qb = q[:, rows].transpose(1, 2)
    kb, vb = (t[:, keys].transpose(1, 2) for t in (k, v))
    ob, gb = (_pad_head(t[:, rows].flatten(2, 3).transpose(1, 2), d) for t in (out, grad_out))
    lb = lse[..., rows].flatten(1, 2).contiguous()
    dq, dk, dv = fused_attention_backward(gb, qb, kb, _pad_head(vb, d), ob, lb, causal, scale)
    dq = dq.transpose(1, 2).float().reshape(b, -1, h_kv, q.shape[2] // h_kv, d)
    return dq, dk.transpose(1, 2).float(), dv[..., :d_v].transpose(1, 2).float()


def _pad_head(t: torch.Tensor, size: int) -> torch.Tensor:
    """``t`` [..., d_v] with zeros up to ``size`` columns: the fused kernels take one head
    size, and zero value columns add zero output columns (MLA's narrower values)."""
    return F.pad(t, (0, size - t.shape[-1])) if t.shape[-1] < size else t


class _Ring:
    """This rank's place in the CP ring: neighbours, every rank's global columns, the part of
    each rank's block that causal order lets each tile of this rank's queries see, the
    visibility mask there, and which pieces of each block the fused kernel runs."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        q: torch.Tensor,
        doc_ids: torch.Tensor | None,
        window: int | None,
        tile_scores: int,
        fused: bool,
        overlap: bool,
    ) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.previous = dist.get_global_rank(group, (self.rank - 1) % self.size)
        seq_len = q.shape[1] * self.size
        self.host_columns = [load_balanced_indices(seq_len, r, self.size) for r in range(self.size)]
        self.columns = [c.to(q.device) for c in self.host_columns]
        self.doc_ids = doc_ids
        self.window = window
        self.overlap = overlap
        b, s, h, _ = q.shape
        self.query_tile = max(1, tile_scores // (b * h * s))
        self.pieces = self._pieces() if fused else [None] * self.size

    def source(self, step: int) -> int:
        """The rank whose block this rank holds at ``step``."""
        return (self.rank - step) % self.size

    def rectangle(self, source: int) -> tuple[slice, int, bool]:
        """The query rows of this rank that see any key of rank ``source``'s block, the end of
        the keys they see (a prefix, columns ascending on every rank), and whether causal
        order within that is the square's (the rank's own block) rather than all pairs."""
        mine, theirs = self.host_columns[self.rank], self.host_columns[source]
        start = int(torch.searchsorted(mine, theirs[0]))
        end = int(torch.searchsorted(theirs, mine[-1], right=True))
        return slice(start, len(mine)), end, source == self.rank

    def _pieces(self) -> list[list[Piece] | None]:
        """Per source rank: the pieces of its ``rectangle`` the fused kernel runs, None where
        the window (if any) cuts the rectangle (the reference runs it). Without a document
        boundary in the rectangle's columns, one piece for the whole batch; else one per batch
        row and document present in both its query rows and its keys. Document ids ascend
        along a row and so do both column lists, so a document is a range of either: a causal
        square on the rank's own block, a whole rectangle elsewhere (the layout puts one
        block's keys wholly before or after the other's queries). Query rows whose document
        has no key here get nothing, as the mask gives. One host sync for all blocks: the
        document ids are read once."""
        mine = self.host_columns[self.rank]
        last = int(mine[-1])  # every block's rectangle ends at this rank's last query
        ids = None if self.doc_ids is None else self.doc_ids.cpu()
        result: list[list[Piece] | None] = []
        for source in range(self.size):
            rows, end, causal = self.rectangle(source)
            theirs = self.host_columns[source][:end]
            first = min(int(mine[rows.start]), int(theirs[0]))
            if self.window is not None and last - first >= self.window:
                result.append(None)
            elif ids is None or bool((ids[:, first] == ids[:, last]).all()):
                result.append([(slice(None), rows, slice(0, end), causal)])
            else:
                pieces = []
                for i, row in enumerate(ids):
                    key_runs = _runs(row[theirs])
                    for doc, (q0, q1) in _runs(row[mine[rows]]).items():
                        if doc in key_runs:
                            doc_rows = slice(rows.start + q0, rows.start + q1)
                            pieces.append(
                                (slice(i, i + 1), doc_rows, slice(*key_runs[doc]), causal)
                            )
                result.append(pieces)
        return result

    def tiles(self, source: int) -> list[tuple[slice, int]]:
        """This rank's query rows in tiles of ``query_tile``, each with the end of the keys of
        rank ``source``'s block it can see causally; what causal order hides is skipped.
        The rows that see any key are ``rectangle``'s (computed on the host from the layout:
        no device sync). In the load-balanced layout this halves every block but the rank's
        own, whose tiles see their causal prefix."""
        mine, theirs = self.host_columns[self.rank], self.host_columns[source]
        visible, _, _ = self.rectangle(source)
        tiles = []
        for first in range(visible.start, len(mine), self.query_tile):
            rows = slice(first, min(first + self.query_tile, len(mine)))
            tiles.append((rows, int(torch.searchsorted(theirs, mine[rows.stop - 1], right=True))))
        return tiles

    def visible(self, source: int, rows: slice, end: int) -> torch.Tensor:
        """[b or 1, s_q, s_k] bool: which of the first ``end`` keys of rank ``source``'s block
        this rank's query ``rows`` see (same document, causal, within the window), by global
        column."""
        mine = self.columns[self.rank][rows]
        theirs = self.columns[source][:end]
        queries, keys = mine[:, None], theirs[None, :]
        mask = keys <= queries
        if self.window is not None:
            mask = mask & (queries - keys < self.window)
        mask = mask[None]
        if self.doc_ids is not None:
            ids = self.doc_ids
            mask = mask & (ids[:, mine, None] == ids[:, None, theirs])
        return mask

    def scores(
        self, q5: torch.Tensor, keys: torch.Tensor, source: int, scale: float, rows: slice
    ) -> torch.Tensor:
        """Masked scores [b, h_kv, g, s_q, s_k] (fp32) of query ``rows`` against ``keys``, the
        first keys of rank ``source``'s block (as many as ``tiles`` kept)."""
        scores = torch.einsum("bqhgd,bkhd->bhgqk", q5, keys) * scale
        mask = self.visible(source, rows, keys.shape[1])
        return scores.masked_fill(~mask[:, None, None], float("-inf"))

    def shift(self, tensors: Sequence[torch.Tensor]) -> Callable[[], list[torch.Tensor]]:
        """Post sends of ``tensors`` to the next rank and receives of the previous rank's (same
        shapes); the returned function waits and gives what arrived (without ``overlap``,
        the wait is done here)."""
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.previous, self.group) for t in received]
        works = dist.batch_isend_irecv(ops)

        def wait() -> list[torch.Tensor]:
            # Each work is waited for once: gloo's receive would wait for another message.
            while works:
                works.pop().wait()
            return received

        if not self.overlap:
            wait()
        return wait


Piece = tuple[slice, slice, slice, bool]
"""What the fused kernel runs of one block: batch rows, query rows, key rows, and whether
causal order (a square on the diagonal) or all pairs."""


def _runs(ids: torch.Tensor) -> dict[int, tuple[int, int]]:
    """Ascending document ids (host) -> each document's [start, end) positions among them."""
    docs, counts = torch.unique_consecutive(ids, return_counts=True)
    ends = counts.cumsum(0).tolist()
    return {
        doc: (stop - n, stop)
        for doc, n, stop in zip(docs.tolist(), counts.tolist(), ends, strict=True)
    }


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[b, s, h, d] -> [b, s, h_kv, h / h_kv, d]: query head i reads key/value head i // g."""
    b, s, h, d = q.shape
    return q.view(b, s, kv_heads, h // kv_heads, d)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (a row that sees no key of a block) as 0, so exp(-inf - it) is 0."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _per_query(x: torch.Tensor) -> torch.Tensor:
    """[b, h_kv, g, s] -> [b, s, h_kv, g, 1], to scale outputs row by row."""
    return x.permute(0, 3, 1, 2)[..., None]


def _merge(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two softmax-normalized partial results over disjoint keys -> the result over both."""
    total = torch.logaddexp(lse, block_lse)
    finite = _finite(total)
    merged = out * _per_query(torch.exp(lse - finite)) + block_out * _per_query(
        torch.exp(block_lse - finite)
    )
    return merged, total
