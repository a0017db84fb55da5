"""The chunked LM-head log-probabilities equal the plain computation, values and gradients."""

from __future__ import annotations

import pytest
import torch

from temper.kernels.cross_entropy import (
    IGNORE_INDEX,
    linear_log_probs,
    linear_log_probs_reference,
    log_probs_from_logits,
    logits_grad_reference,
)
from temper.kernels.dispatch import compiled


def inputs(tokens: int, dim: int, vocab: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, dim, generator=gen, dtype=torch.float64).float()
    weight = (torch.randn(vocab, dim, generator=gen) * 0.2).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    labels[::3] = IGNORE_INDEX
    return hidden.requires_grad_(), weight, labels


def losses(log_probs: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy sum plus a z-loss, so both outputs carry gradient."""
    valid = labels != IGNORE_INDEX
    return -log_probs.sum() + 1e-2 * (lse[valid] ** 2).sum()


@pytest.mark.parametrize(("tokens", "chunk"), [(37, 8), (64, 64), (5, 1024), (50, 7)])
def test_matches_reference_with_masked_labels_and_odd_sizes(tokens: int, chunk: int) -> None:
    hidden, weight, labels = inputs(tokens, dim=24, vocab=101)
    ref_lp, ref_lse = linear_log_probs_reference(hidden, weight, labels)
    ref_grads = torch.autograd.grad(losses(ref_lp, ref_lse, labels), (hidden, weight))

    lp, lse = linear_log_probs(hidden, weight, labels, chunk_tokens=chunk)
    grads = torch.autograd.grad(losses(lp, lse, labels), (hidden, weight))
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-6)
    assert (lp[labels == IGNORE_INDEX] == 0).all()
    for got, expected in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_entropy_from_the_chunks_equals_the_full_softmax(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Asked for it, the forward fills each position's entropy from its chunk's logits (in
    slices of ENTROPY_ROWS rows): -sum p log p of the full softmax, and the log-probs and
    gradients are unchanged."""
    import temper.kernels.cross_entropy as module

    monkeypatch.setattr(module, "ENTROPY_ROWS", 3)  # several slices per 8-token chunk
    hidden, weight, labels = inputs(37, dim=24, vocab=101)
    entropy = torch.full((37,), float("nan"))
    lp, lse = linear_log_probs(hidden, weight, labels, chunk_tokens=8, entropy=entropy)
    logits = (hidden @ weight.t()).detach()
    want = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    torch.testing.assert_close(entropy, want, rtol=1e-5, atol=1e-6)
    ref_lp, ref_lse = linear_log_probs_reference(hidden, weight, labels)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(losses(lp, lse, labels), (hidden, weight))
    ref_grads = torch.autograd.grad(losses(ref_lp, ref_lse, labels), (hidden, weight))
    for got, expected in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_cross_entropy_equals_torch_within_1e5() -> None:
    hidden, weight, labels = inputs(96, dim=32, vocab=257, seed=1)
    lp, _ = linear_log_probs(hidden, weight, labels, chunk_tokens=16)
    fused = -lp.sum() / (labels != IGNORE_INDEX).sum()
    plain = torch.nn.functional.cross_entropy(hidden @ weight.t(), labels)
    assert abs(fused.item() - plain.item()) <= 1e-5 * abs(plain.item())


def test_batched_shapes_and_tied_weight_gradients() -> None:
    """[batch, seq] labels, and a head that is also the embedding (tied): grads accumulate."""
    gen = torch.Generator().manual_seed(2)
    embedding = torch.nn.Embedding(50, 16)
    ids = torch.randint(0, 50, (3, 11), generator=gen)
    labels = torch.randint(0, 50, (3, 11), generator=gen)

    def run(fn):
        embedding.zero_grad()
        lp, _ = fn(torch.tanh(embedding(ids)), embedding.weight, labels)
        (-lp.sum()).backward()
        return lp.detach(), embedding.weight.grad.clone()

    lp_ref, grad_ref = run(linear_log_probs_reference)
    lp, grad = run(lambda h, w, y: linear_log_probs(h, w, y, chunk_tokens=5))
    assert lp.shape == (3, 11)
    torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", ["eager", "compiled"])
def test_logits_gradient_is_autograds_written_over_the_chunk(form: str) -> None:
    """The per-chunk gradient (one-hot by column comparison) equals autograd's through
    both outputs, and it is written over the logits chunk it was given, which the fused
    loss reuses for the next chunk."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 53, generator=gen, requires_grad=True)
    labels = torch.tensor([4, IGNORE_INDEX, 52, 0, 17, 4])
    log_probs, lse = log_probs_from_logits(logits, labels)
    grad_log_probs, grad_lse = torch.randn(6, generator=gen), torch.randn(6, generator=gen)
    grad_log_probs[labels == IGNORE_INDEX] = 0.0
    (expected,) = torch.autograd.grad((log_probs, lse), logits, (grad_log_probs, grad_lse))

    chunk = logits.detach().clone()
    fn = compiled(logits_grad_reference) if form == "compiled" else logits_grad_reference
    got = fn(chunk, labels, lse.detach(), grad_log_probs, grad_lse)
    assert got.data_ptr() == chunk.data_ptr()
    torch.testing.assert_close(chunk, expected, rtol=1e-5, atol=1e-7)
