"""The per-chunk softmax work of the fused linear cross-entropy in Triton: one program per row
streams its logits through an online logsumexp, and the backward overwrites the recomputed
logits with their gradient in place, so no fp32 copy of a [rows, vocab] chunk is made."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from temper.data.batch import IGNORE_INDEX

BLOCK = 4096


@triton.jit
def _stats(
    logits_ptr, stride, labels_ptr, log_probs_ptr, lse_ptr, n_cols, ignore_index,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    total = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, axis=0))
        total = total * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
        m = new_m
    lse = m + tl.log(total)
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    picked = tl.load(base + tl.where(valid, label, 0)).to(tl.float32)
    tl.store(log_probs_ptr + row, tl.where(valid, picked - lse, 0.0))
    tl.store(lse_ptr + row, lse)


@triton.jit
def _grad(
    logits_ptr, stride, labels_ptr, lse_ptr, grad_lp_ptr, grad_lse_ptr, n_cols,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    lse = tl.load(lse_ptr + row)
    label = tl.load(labels_ptr + row)
    grad_lp = tl.load(grad_lp_ptr + row)
    scale = tl.load(grad_lse_ptr + row) - grad_lp
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) * scale + tl.where(cols == label, grad_lp, 0.0)
        tl.store(base + cols, g.to(logits_ptr.dtype.element_ty), mask=mask)


def log_probs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """As the reference: fp32 (log p(label), logsumexp) per row of logits [rows, vocab]."""
    rows, vocab = logits.shape
    log_probs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(log_probs)
    _stats[(rows,)](
        logits, logits.stride(0), labels.contiguous(), log_probs, lse, vocab, IGNORE_INDEX,
        BLOCK=min(BLOCK, triton.next_power_of_2(vocab)), num_warps=8,
    )  # fmt: skip
    return log_probs, lse


def logits_grad(
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    grad_log_probs: torch.Tensor,
    grad_lse: torch.Tensor,
) -> torch.Tensor:
    """As the reference, written over ``logits`` (a recomputed chunk that nothing else holds)."""
    rows, vocab = logits.shape
    _grad[(rows,)](
        logits, logits.stride(0), labels.contiguous(), lse.contiguous(),
        grad_log_probs.contiguous(), grad_lse.contiguous(), vocab,
        BLOCK=min(BLOCK, triton.next_power_of_2(vocab)), num_warps=8,
    )  # fmt: skip
    return logits


def loss_and_grad(
    logits: torch.Tensor, labels: torch.Tensor, z_loss_weight: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As the reference: the statistics, then the training loss's gradient over ``logits``
    (d loss / d log p = -1 and d loss / d lse = 2 z lse, on valid labels only)."""
    log_probs, lse = log_probs_from_logits(logits, labels)
    valid = labels != IGNORE_INDEX
    grad_lse = 2 * z_loss_weight * torch.where(valid, lse, 0.0)
    return log_probs, lse, logits_grad(logits, labels, lse, -valid.float(), grad_lse)
