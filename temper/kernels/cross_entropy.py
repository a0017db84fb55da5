"""LM head + log-probabilities in chunks of tokens, so `[tokens, vocab]` logits never exist whole.

`linear_log_probs(hidden, weight, labels)` returns, per token, the log-probability of
its label and the log-partition `logsumexp(logits)`. Cross-entropy, z-loss, and the
per-token log-probabilities that DPO and GRPO need are all simple functions of these
two vectors, and since every token is independent, a sequence-parallel shard of hidden
states and labels needs nothing special. Its backward recomputes each chunk's logits
instead of keeping them: one extra matmul per chunk buys memory that no longer grows
with the vocabulary. Asked for it, the forward's chunks also give each position's entropy
(no gradient), which an RL loss logs without a forward of its own.

`linear_cross_entropy` is the training loss itself (summed cross-entropy plus z-loss).
Its gradient is known up to the one scalar that the backward brings, so the forward
computes it chunk by chunk and the backward only scales it: the same three head matmuls
as unfused training, no recompute, and neither logits nor hidden states are kept.

Per chunk, the softmax statistics and the logits' gradient run through the kernel
dispatcher (op ``cross_entropy``): the references below (the training loss's takes both in
one pass of exponentials), their compiled forms, or Triton kernels that read the chunk once
and write its gradient in place.
`linear_log_probs_reference` is the plain full-logits computation that tests compare against.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from temper.data.batch import IGNORE_INDEX
from temper.kernels.dispatch import Impl, choose

DEFAULT_CHUNK_TOKENS = 1024
ENTROPY_ROWS = 256
"""Rows of a logits chunk whose entropy is taken at once, so its fp32 softmax stays small
(256 x a 152K vocabulary: 156 MB) beside the training forward's activations."""


def log_probs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 log-softmax statistics of logits [..., vocab]: (log p(label), logsumexp);
    ignored labels get log-probability 0."""
    logits = logits.float()
    lse = logits.logsumexp(dim=-1)
    valid = labels != IGNORE_INDEX
    picked = logits.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, picked - lse, 0.0), lse


def logits_entropy(logits: torch.Tensor) -> torch.Tensor:
    """The entropy of softmax(logits) [..., vocab] per position, in fp32."""
    logits = logits.float()
    return logits.logsumexp(dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)


def logits_grad_reference(
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    grad_log_probs: torch.Tensor,
    grad_lse: torch.Tensor,
) -> torch.Tensor:
    """Gradient of the logits chunk [rows, vocab], written over ``logits`` (a chunk that
    nothing else holds, reused for the next), from the gradients of both outputs;
    ``grad_log_probs`` is already 0 at ignored labels.

    d lse / d logits = p;  d log p_label / d logits = onehot(label) - p.

    Every step works in place on the fp32 chunk (the chunk itself when it is fp32), and the
    one-hot term is added at each row's label only: no [rows, vocab] temporary, where the
    out-of-place chain made four of them per chunk.
    """
    grad = logits.float()
    grad.sub_(lse[:, None]).exp_().mul_((grad_lse - grad_log_probs)[:, None])
    rows = torch.arange(grad.shape[0], device=grad.device)
    grad[rows, labels.clamp(min=0)] += grad_log_probs
    return logits.copy_(grad)


def loss_and_grad_reference(
    logits: torch.Tensor, labels: torch.Tensor, z_loss_weight: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk of the training loss: `log_probs_from_logits`' two vectors (the same bits)
    and, written over ``logits``, the gradient of ``-log p(label) + z_loss_weight * lse^2``
    summed over valid labels.

    ``exp(logits - max)`` is taken once, in place, and serves both the log-partition and the
    softmax: statistics and gradient taken apart exponentiate the chunk twice and allocate a
    chunk-sized ``logits - max`` for the first.

    d/d logits = p * (1 + 2 z lse) - onehot(label), with p = exp(logits - max) / sum.
    """
    x = logits.float()
    rows = torch.arange(x.shape[0], device=x.device)
    target = labels.clamp(min=0)
    valid = labels != IGNORE_INDEX
    picked = x[rows, target]
    top = x.amax(dim=-1)
    top = top.masked_fill(top.abs() == float("inf"), 0.0)  # as torch.logsumexp does
    total = x.sub_(top[:, None]).exp_().sum(dim=-1)
    lse = total.log().add_(top)
    x.mul_(torch.where(valid, (1 + 2 * z_loss_weight * lse) / total, 0.0)[:, None])
    x[rows, target] -= valid.float()
    return torch.where(valid, picked - lse, 0.0), lse, logits.copy_(x)


def linear_log_probs_reference(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full logits, then fp32 log-softmax; ignored labels get log-probability 0."""
    return log_probs_from_logits(hidden @ weight.t(), labels)


def linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    impl: Impl | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked, memory-lean equivalent of `linear_log_probs_reference`.

    hidden [..., dim], weight [vocab, dim], labels [...] -> (log_probs, lse), both fp32 [...].
    Under autocast both operands are cast to its dtype here, so the forward and the
    recomputing backward (which runs outside autocast) multiply in the same precision.
    ``impl`` is the per-chunk implementation asked for (None: the reference).
    ``entropy``: a contiguous fp32 tensor shaped
    like ``labels`` that the forward fills with each position's `logits_entropy` (no
    gradient flows through it).
    """
    hidden, weight = _autocast_operands(hidden, weight)
    shape = labels.shape
    flat_entropy = None if entropy is None else entropy.view(-1)
    log_probs, lse = _ChunkedLinearLogProbs.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        labels.reshape(-1),
        chunk_tokens,
        impl,
        flat_entropy,
    )
    return log_probs.view(shape), lse.view(shape)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    z_loss_weight: float = 0.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    impl: Impl | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token loss from the head's input, in chunks of tokens.

    Returns ``sum over valid labels of -log p(label) + z_loss_weight * lse^2`` and, without
    gradient, the sum of ``lse^2`` over valid labels (the z-loss metric). Equal to
    ``linear_log_probs_reference`` followed by those sums; autocast as in `linear_log_probs`.
    """
    hidden, weight = _autocast_operands(hidden, weight)
    return _ChunkedLinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        labels.reshape(-1),
        z_loss_weight,
        chunk_tokens,
        impl,
    )


def _autocast_operands(
    hidden: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both cast to the autocast dtype when autocast is on, so the chunks' matmuls, in forward
    and in a backward that runs outside autocast, use one precision."""
    # Meta (the planner's shape-only forward) has no autocast.
    if hidden.device.type != "meta" and torch.is_autocast_enabled(hidden.device.type):
        dtype = torch.get_autocast_dtype(hidden.device.type)
        return hidden.to(dtype), weight.to(dtype)
    return hidden, weight


def _chunk_logits(
    hidden: torch.Tensor, weight: torch.Tensor, rows: slice, buffer: torch.Tensor
) -> torch.Tensor:
    """The logits of ``hidden[rows]``, written into ``buffer``'s first rows: one chunk-sized
    buffer serves every chunk, where a fresh [chunk, vocab] tensor per chunk would be
    allocated (and, on CPU, its pages faulted in) again each time."""
    chunk = hidden[rows]
    return torch.mm(chunk, weight.t(), out=buffer[: chunk.shape[0]])


def _logits_buffer(hidden: torch.Tensor, weight: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    return hidden.new_empty(min(chunk_tokens, hidden.shape[0]), weight.shape[0])


def _grad_buffers(
    ctx: torch.autograd.function.FunctionCtx, hidden: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradient outputs for the inputs that need one; the weight's accumulates in fp32."""
    want_hidden, want_weight = ctx.needs_input_grad[:2]
    grad_hidden = torch.empty_like(hidden) if want_hidden else None
    grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
    return grad_hidden, grad_weight


def _accumulate(
    grad_logits: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    rows: slice,
    grad_hidden: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
) -> None:
    """One chunk's share of the gradients: its rows of d hidden, its term of d weight."""
    if grad_hidden is not None:
        torch.mm(grad_logits, weight, out=grad_hidden[rows])
    if grad_weight is None:
        return
    if grad_logits.dtype == torch.float32:
        grad_weight.addmm_(grad_logits.t(), hidden[rows])  # no [vocab, dim] temporary
    else:
        grad_weight += (grad_logits.t() @ hidden[rows]).float()


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        z_loss_weight: float,
        chunk_tokens: int,
        impl: Impl | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stats = choose("cross_entropy", hidden.device, impl, log_probs_from_logits, _triton_stats)
        loss_and_grad = choose(
            "cross_entropy", hidden.device, impl, loss_and_grad_reference, _triton_loss_and_grad
        )
        grad_hidden, grad_weight = _grad_buffers(ctx, hidden, weight)
        want_grads = grad_hidden is not None or grad_weight is not None
        nll = hidden.new_zeros((), dtype=torch.float32)
        z_sum = torch.zeros_like(nll)
        buffer = _logits_buffer(hidden, weight, chunk_tokens)
        for start in range(0, labels.numel(), chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            logits = _chunk_logits(hidden, weight, rows, buffer)
            if want_grads:
                log_probs, lse, grad_logits = loss_and_grad(logits, labels[rows], z_loss_weight)
                _accumulate(grad_logits, hidden, weight, rows, grad_hidden, grad_weight)
            else:
                log_probs, lse = stats(logits, labels[rows])
            nll -= log_probs.sum()
            z_sum += torch.where(labels[rows] != IGNORE_INDEX, lse, 0.0).pow(2).sum()
        ctx.grads = (grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(z_sum)
        return nll + z_loss_weight * z_sum, z_sum

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_loss: torch.Tensor, _: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        if ctx.grads is None:
            raise RuntimeError("linear_cross_entropy's gradients were already used (one backward)")
        grad_hidden, grad_weight = ctx.grads
        ctx.grads = None
        if grad_hidden is not None:
            grad_hidden.mul_(grad_loss)
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None


class _ChunkedLinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_tokens: int,
        impl: Impl | None,
        entropy: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stats = choose("cross_entropy", hidden.device, impl, log_probs_from_logits, _triton_stats)
        log_probs = hidden.new_empty(labels.shape, dtype=torch.float32)
        lse = torch.empty_like(log_probs)
        buffer = _logits_buffer(hidden, weight, chunk_tokens)
        for start in range(0, labels.numel(), chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            logits = _chunk_logits(hidden, weight, rows, buffer)
            log_probs[rows], lse[rows] = stats(logits, labels[rows])
            if entropy is not None:
                out = entropy[rows]
                for part in range(0, logits.shape[0], ENTROPY_ROWS):
                    out[part : part + ENTROPY_ROWS] = logits_entropy(
                        logits[part : part + ENTROPY_ROWS]
                    )
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk_tokens = chunk_tokens
        ctx.impl = impl
        return log_probs, lse

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx,
        grad_log_probs: torch.Tensor,
        grad_lse: torch.Tensor,
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, labels, lse = ctx.saved_tensors
        logits_grad = choose(
            "cross_entropy", hidden.device, ctx.impl, logits_grad_reference, _triton_grad
        )
        grad_hidden, grad_weight = _grad_buffers(ctx, hidden, weight)
        grad_log_probs = torch.where(labels != IGNORE_INDEX, grad_log_probs, 0.0)
        buffer = _logits_buffer(hidden, weight, ctx.chunk_tokens)
        for start in range(0, labels.numel(), ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            grad_logits = logits_grad(
                _chunk_logits(hidden, weight, rows, buffer),
                labels[rows],
                lse[rows],
                grad_log_probs[rows],
                grad_lse[rows],
            )
            _accumulate(grad_logits, hidden, weight, rows, grad_hidden, grad_weight)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def _triton_stats() -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    from temper.kernels.triton.cross_entropy import log_probs_from_logits

    return log_probs_from_logits


def _triton_loss_and_grad() -> Callable[
    [torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
]:
    from temper.kernels.triton.cross_entropy import loss_and_grad

    return loss_and_grad


def _triton_grad() -> Callable[..., torch.Tensor]:
    from temper.kernels.triton.cross_entropy import logits_grad

    return logits_grad
