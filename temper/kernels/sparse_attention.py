"""Top-k sparse attention (DeepSeek sparse attention's core, and DeepSeek V4's compressed
attention) behind the kernel dispatcher.

Each query attends to its own set of keys, the same for every head: ``selected`` [b, s, t]
True at them. Keys and values may have fewer heads than the queries (h_kv dividing h: V4's one
shared head serves all), and ``sinks`` [h] adds one logit per head to every softmax row whose
probability carries no value (V4's learned sink). The reference is the dense form: the
selection as a boolean mask over dense scores through sdpa, whose cost is dense attention's.
The Triton form reads only the selected keys: the selection becomes each query's list of key
positions (``selected_indices``) and the kernel gathers those rows. ``gather_attention`` is
that computation in plain PyTorch, the Triton kernel's oracle in tests (it holds
[b, s, n, h, d] gathered keys, so it is no path for real sizes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from temper.kernels.attention import attention
from temper.kernels.dispatch import Impl, choose

INDEX_ROWS = 1024
"""Queries per chunk while turning a selection into indices: bounds the int32 [b, chunk, t]
scratch (128 MiB at 32K keys) whatever the sequence length."""


def sparse_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    selected: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [b, s, h, d_qk], k [b, t, h_kv, d_qk], v [b, t, h_kv, d_v] -> [b, s, h, d_v], each
    query over the keys ``selected`` [b, s, t] marks (and the sink logits ``sinks`` [h]):
    dense scores under that mask (sdpa; written out with sinks)."""
    return attention(q, k, v, mask=selected[:, None], scale=scale, sinks=sinks)


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    selected: torch.Tensor,
    scale: float,
    impl: Impl | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sparse_attention_reference`` through the dispatcher; ``impl`` pins one form."""
    return choose("sparse_attention", q.device, impl, sparse_attention_reference, _triton)(
        q, k, v, selected, scale, sinks
    )


def compressed_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    selected: torch.Tensor,
    scale: float,
    sinks: torch.Tensor,
    impl: Impl | None = None,
) -> torch.Tensor:
    """DeepSeek V4's attention: q [b, s, h, d] over the rows of its one shared head ``kv``
    [b, t, 1, d] (keys and values alike) that ``selected`` [b, s, t] marks, with the sink
    logits ``sinks`` [h]. ``sparse_attention``'s forms under their own choice
    (``kernels.compressed_attention``), so V4 and DSA pick apart."""
    return choose("compressed_attention", q.device, impl, sparse_attention_reference, _triton)(
        q, kv, kv, selected, scale, sinks
    )


def selected_indices(selected: torch.Tensor) -> torch.Tensor:
    """int32 [b, s, n]: the positions each query's row of ``selected`` [b, s, t] marks, n the
    most any query marks, -1 in a row's empty slots. Reads n back to the host (one sync)."""
    width = int(selected.sum(-1).max())
    positions = torch.arange(selected.shape[-1], device=selected.device, dtype=torch.int32)
    chunks = [
        torch.where(rows, positions, -1).topk(width, dim=-1).values
        for rows in selected.split(INDEX_ROWS, dim=1)
    ]
    return torch.cat(chunks, dim=1)


def gather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [b, s, h, d_qk] over the keys of k [b, t, h_kv, d_qk] and v [b, t, h_kv, d_v] that
    ``indices`` [b, s, n] lists (-1: an empty slot): gather them, softmax over them and the
    sink logit ``sinks`` [h] if given (fp32), -> [b, s, h, d_v] in q's dtype."""
    rows = torch.arange(q.shape[0], device=q.device)[:, None, None]
    slots = indices.clamp(min=0).long()
    groups = q.shape[2] // k.shape[2]
    keys, values = (t[rows, slots].float().repeat_interleave(groups, dim=3) for t in (k, v))
    logits = torch.einsum("bshd,bsnhd->bshn", q.float(), keys) * scale  # keys [b, s, n, h, d]
    logits = logits.masked_fill((indices < 0)[:, :, None], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, 1, -1, 1).expand(*logits.shape[:3], 1)
        probs = torch.cat((logits, sink), dim=-1).softmax(-1)[..., :-1]
    else:
        probs = logits.softmax(-1)
    return torch.einsum("bshn,bsnhd->bshd", probs, values).to(q.dtype)


def _triton() -> Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor | None],
    torch.Tensor,
]:
    from temper.kernels.triton.sparse_attention import sparse_attention

    return sparse_attention
