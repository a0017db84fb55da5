"""Top-k sparse attention in Triton: one program per (query, head) reads only the keys its
query selected, block by block with an online softmax, and keeps the log-sum-exp; the
backward recomputes the probabilities from it and adds each key's and value's gradient into
an fp32 buffer atomically (many queries select the same key).

Keys and values have h_kv heads, h_kv dividing the queries' h: query head j reads key head
j // (h / h_kv) by its offset, so V4's one shared head serves every head without a copy per
head (its gradient gathers every head's contributions, atomically too). With ``sinks`` [h] the
forward folds each head's sink logit into the running maximum and sum after the keys; the
sink carries no value, so the backward's per-key formula is unchanged and d sink
= -exp(sink - lse) * (dO . O), summed over queries.

On per-head keys and values (MLA's after their up-projection, as ``SparseMLA`` hands them to
its sequence core) a query reads n_selected * h * (d_qk + d_v) elements: it saves dense
attention's compute and the dense mask's memory, not bandwidth. DeepSeek's own kernels
use MLA's latent form (one shared latent row per key for all heads), which needs the queries
absorbed into the latent space before the sequence core (docs/models.md, DSA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from temper.kernels.sparse_attention import selected_indices

BLOCK_KEYS = 32


@triton.jit
def _forward(
    q_ptr, k_ptr, v_ptr, rows_ptr, sinks_ptr, o_ptr, lse_ptr, n_heads, n_kv_heads, n_slots,
    d_qk, d_v, scale,
    BLOCK_K: tl.constexpr, BLOCK_QK: tl.constexpr, BLOCK_V: tl.constexpr, SINKS: tl.constexpr,
):  # fmt: skip
    query = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    kv_head = head // (n_heads // n_kv_heads)
    dq = tl.arange(0, BLOCK_QK)
    dv = tl.arange(0, BLOCK_V)
    qk_in, v_in = dq < d_qk, dv < d_v
    q = tl.load(q_ptr + (query * n_heads + head) * d_qk + dq, mask=qk_in, other=0.0)
    q = q.to(tl.float32)
    top = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, n_slots, BLOCK_K):
        slot = start + tl.arange(0, BLOCK_K)
        row = tl.load(rows_ptr + query * n_slots + slot, mask=slot < n_slots, other=-1)
        row = row.to(tl.int64)
        ok = row >= 0
        base = row[:, None] * n_kv_heads + kv_head
        k = tl.load(k_ptr + base * d_qk + dq[None, :], mask=ok[:, None] & qk_in[None, :], other=0.0)
        v = tl.load(v_ptr + base * d_v + dv[None, :], mask=ok[:, None] & v_in[None, :], other=0.0)
        logits = tl.sum(k.to(tl.float32) * q[None, :], axis=1) * scale
        logits = tl.where(ok, logits, float("-inf"))
        new_top = tl.maximum(top, tl.max(logits, axis=0))
        # A block of empty slots leaves the maximum at -inf: shift by 0 so no inf - inf.
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)
        p = tl.exp(logits - shift)
        rescale = tl.exp(top - shift)
        total = total * rescale + tl.sum(p, axis=0)
        acc = acc * rescale + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        top = new_top
    if SINKS:
        # The sink joins the sum only: no value, so acc is just rescaled.
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        new_top = tl.maximum(top, sink)
        rescale = tl.exp(top - new_top)
        total = total * rescale + tl.exp(sink - new_top)
        acc = acc * rescale
        top = new_top
    out = acc / total
    tl.store(o_ptr + (query * n_heads + head) * d_v + dv, out.to(o_ptr.dtype.element_ty), mask=v_in)
    tl.store(lse_ptr + query * n_heads + head, top + tl.log(total))


@triton.jit
def _backward(
    q_ptr, k_ptr, v_ptr, rows_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr,
    n_heads, n_kv_heads, n_slots, d_qk, d_v, scale,
    BLOCK_K: tl.constexpr, BLOCK_QK: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    query = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    kv_head = head // (n_heads // n_kv_heads)
    at = query * n_heads + head
    dq = tl.arange(0, BLOCK_QK)
    dv = tl.arange(0, BLOCK_V)
    qk_in, v_in = dq < d_qk, dv < d_v
    q = tl.load(q_ptr + at * d_qk + dq, mask=qk_in, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + at * d_v + dv, mask=v_in, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + at)
    delta = tl.load(delta_ptr + at)
    grad_q = tl.zeros([BLOCK_QK], tl.float32)
    for start in range(0, n_slots, BLOCK_K):
        slot = start + tl.arange(0, BLOCK_K)
        row = tl.load(rows_ptr + query * n_slots + slot, mask=slot < n_slots, other=-1)
        row = row.to(tl.int64)
        ok = row >= 0
        base = row[:, None] * n_kv_heads + kv_head
        k_mask = ok[:, None] & qk_in[None, :]
        v_mask = ok[:, None] & v_in[None, :]
        k = tl.load(k_ptr + base * d_qk + dq[None, :], mask=k_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + base * d_v + dv[None, :], mask=v_mask, other=0.0).to(tl.float32)
        logits = tl.sum(k * q[None, :], axis=1) * scale
        p = tl.where(ok, tl.exp(logits - lse), 0.0)
        # d logit = p * (dO . v - dO . O), times the scale for q and k.
        ds = p * (tl.sum(v * do[None, :], axis=1) - delta) * scale
        grad_q += tl.sum(ds[:, None] * k, axis=0)
        tl.atomic_add(dk_ptr + base * d_qk + dq[None, :], ds[:, None] * q[None, :], mask=k_mask)
        tl.atomic_add(dv_ptr + base * d_v + dv[None, :], p[:, None] * do[None, :], mask=v_mask)
    tl.store(dq_ptr + at * d_qk + dq, grad_q, mask=qk_in)


def _blocks(d_qk: int, d_v: int) -> dict[str, int]:
    p2 = triton.next_power_of_2
    return {"BLOCK_K": BLOCK_KEYS, "BLOCK_QK": p2(d_qk), "BLOCK_V": p2(d_v)}


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rows: torch.Tensor,
        scale: float,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        q, k, v, rows = (t.contiguous() for t in (q, k, v, rows))
        b, s, h, d_qk = q.shape
        h_kv, d_v = v.shape[2:]
        if h % h_kv:
            raise ValueError(f"sparse attention: {h_kv} key heads must divide {h} query heads")
        out = q.new_empty(b, s, h, d_v)
        lse = torch.empty(b, s, h, device=q.device, dtype=torch.float32)
        sink_logits = lse if sinks is None else sinks.float().contiguous()  # lse: never read
        _forward[(b * s, h)](
            q, k, v, rows, sink_logits, out, lse, h, h_kv, rows.shape[-1], d_qk, d_v, scale,
            **_blocks(d_qk, d_v), SINKS=sinks is not None,
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, rows, out, lse, sinks)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, d_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None, torch.Tensor | None]:
        q, k, v, rows, out, lse, sinks = ctx.saved_tensors
        b, s, h, d_qk = q.shape
        h_kv, d_v = v.shape[2:]
        d_out = d_out.contiguous()
        delta = (d_out.float() * out.float()).sum(-1)
        dq = torch.empty(q.shape, device=q.device, dtype=torch.float32)
        dk = torch.zeros(k.shape, device=k.device, dtype=torch.float32)
        dv = torch.zeros(v.shape, device=v.device, dtype=torch.float32)
        _backward[(b * s, h)](
            q, k, v, rows, d_out, lse, delta, dq, dk, dv, h, h_kv, rows.shape[-1], d_qk, d_v,
            ctx.scale, **_blocks(d_qk, d_v),
        )  # fmt: skip
        d_sinks = None
        if sinks is not None:
            # The sink's probability times (its value 0 - dO . O), over every query.
            d_sinks = -((sinks.float() - lse).exp() * delta).sum((0, 1)).to(sinks.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, d_sinks


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    selected: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [b, s, h, d_qk] over the keys of k [b, t, h_kv, d_qk], v [b, t, h_kv, d_v] that
    ``selected`` [b, s, t] marks, and the sink logits ``sinks`` [h] if given
    -> [b, s, h, d_v]; gradients for q, k, v and sinks."""
    return sparse_attention_indexed(q, k, v, selected_indices(selected), scale, sinks)


def sparse_attention_indexed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """As ``sparse_attention`` with the selection as key positions ``indices`` [b, s, n]
    (-1: an empty slot), the form ``gather_attention`` takes."""
    t = k.shape[1]
    offset = torch.arange(k.shape[0], device=k.device, dtype=indices.dtype)[:, None, None] * t
    rows = torch.where(indices >= 0, indices + offset, -1).to(torch.int32)
    return _SparseAttention.apply(q, k, v, rows, scale, sinks)
