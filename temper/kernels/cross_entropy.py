"""LM head + log-probabilities in chunks of tokens, so `[tokens, vocab]` logits never exist whole.

`linear_log_probs(hidden, weight, labels)` returns, per token, the log-probability of
its label and the log-partition `logsumexp(logits)`. Cross-entropy, z-loss, and the
per-token log-probabilities that DPO and GRPO need are all simple functions of these
two vectors. The backward recomputes each chunk's logits instead of keeping them:
one extra matmul per chunk buys memory that no longer grows with the vocabulary.

`linear_log_probs_reference` is the plain computation that tests compare against.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100
DEFAULT_CHUNK_TOKENS = 1024


def linear_log_probs_reference(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full logits, then fp32 log-softmax; ignored labels get log-probability 0."""
    logits = (hidden @ weight.t()).float()
    lse = logits.logsumexp(dim=-1)
    valid = labels != IGNORE_INDEX
    picked = logits.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, picked - lse, 0.0), lse


def linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked, memory-lean equivalent of `linear_log_probs_reference`.

    hidden [..., dim], weight [vocab, dim], labels [...] -> (log_probs, lse), both fp32 [...].
    """
    shape = labels.shape
    log_probs, lse = _ChunkedLinearLogProbs.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunk_tokens
    )
    return log_probs.view(shape), lse.view(shape)


class _ChunkedLinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_tokens: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs = hidden.new_empty(labels.shape, dtype=torch.float32)
        lse = torch.empty_like(log_probs)
        for start in range(0, labels.numel(), chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            log_probs[rows], lse[rows] = linear_log_probs_reference(
                hidden[rows], weight, labels[rows]
            )
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk_tokens = chunk_tokens
        return log_probs, lse

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx,
        grad_log_probs: torch.Tensor,
        grad_lse: torch.Tensor,
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, labels, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        )
        valid = labels != IGNORE_INDEX
        grad_log_probs = torch.where(valid, grad_log_probs, 0.0)
        for start in range(0, labels.numel(), ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            h = hidden[rows]
            probs = ((h @ weight.t()).float() - lse[rows, None]).exp()
            # d lse / d logits = p;  d log p_label / d logits = onehot(label) - p
            grad_logits = probs * (grad_lse[rows] - grad_log_probs[rows])[:, None]
            grad_logits.scatter_add_(
                1, labels[rows].clamp(min=0)[:, None], grad_log_probs[rows, None]
            )
            grad_logits = grad_logits.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight += (grad_logits.t() @ h).float()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None
