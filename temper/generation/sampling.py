"""The next token from a row of logits: greedy, or a sample at a temperature, optionally
restricted to the ``top_k`` most likely tokens and to the nucleus of probability ``top_p``."""

from __future__ import annotations

import torch


def check_sampling(temperature: float, top_k: int | None, top_p: float) -> None:
    """Refuse settings that have no meaning, naming the argument, before any model work."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None = None,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits [b, vocab] -> token ids [b]. Temperature 0 is greedy (top-k/top-p then change
    nothing); otherwise the logits are divided by the temperature, filtered by top-k, then by
    top-p, and a token is drawn with ``generator`` (``draw``: same generator state, same
    tokens)."""
    if temperature == 0:
        return greedy_pick(logits)
    logits = _scaled(logits, temperature)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        logits = _nucleus(logits, top_p)
    return draw(logits.softmax(dim=-1), generator)


def sample_with_log_prob(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None = None,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample_next``'s tokens [b] (the same draw from the same generator state) and their
    log-probabilities [b] under softmax(logits / temperature), without top-k/top-p (greedy:
    temperature 1). Unfiltered, the log-probability is the log of the drawn token's entry in
    the probabilities the draw used, not a second pass of log_softmax over the vocabulary (a
    fifth of the sampling's time at vocab 32000); it equals log_softmax's to float rounding
    for any token whose probability is a normal float (above 1e-38)."""
    if temperature == 0 or _filters(logits, top_k, top_p):
        token = sample_next(logits, temperature, top_k, top_p, generator)
        return token, token_log_prob(logits, token, temperature)
    probs = _scaled(logits, temperature).softmax(dim=-1)
    token = draw(probs, generator)
    return token, probs.gather(1, token[:, None]).log().squeeze(1)


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token [b] per row of ``probs`` [b, vocab] (non-negative, positive sum) by inverse
    CDF: a uniform u per row, then the first token whose running sum exceeds u times the
    row's total. One random number per row, where ``torch.multinomial`` draws an exponential
    for every entry (on CPU, 16 of a 29 ms decode step at 32 rows x 32000 tokens). The running
    sum is fp64, so each token's chance is its probability to ~1e-16 of the row's total;
    a token of probability 0 is never drawn (past the end, rounding is sent to the last
    token that reaches the total)."""
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    u = torch.rand(total.shape, generator=generator, dtype=torch.float64, device=probs.device)
    token = torch.searchsorted(cdf, u * total, right=True).squeeze(1)
    return torch.minimum(token, (cdf < total).sum(dim=-1))


def token_log_prob(logits: torch.Tensor, token: torch.Tensor, temperature: float) -> torch.Tensor:
    """log-probability [b] of each row's ``token`` under softmax(logits / temperature)
    (temperature 0: 1)."""
    scaled = _scaled(logits, temperature) if temperature > 0 else logits.float()
    return scaled.log_softmax(dim=-1).gather(1, token[:, None]).squeeze(1)


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature in fp32, without the pass over the vocabulary at temperature 1
    (x / 1 is x exactly)."""
    logits = logits.float()
    return logits if temperature == 1 else logits / temperature


def _filters(logits: torch.Tensor, top_k: int | None, top_p: float) -> bool:
    """top-k or top-p removes some tokens of ``logits`` [b, vocab]."""
    return (top_k is not None and top_k < logits.shape[-1]) or top_p < 1


def greedy_pick(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)``: the first index of each row's largest logit. Inside a
    compiled graph it is written as two max-reductions, which Inductor vectorizes on CPU and
    its argmax is not (at batch 64 and vocab 2048: 98 us per decode step for the argmax
    kernel, 6% of the compiled step). A row with a NaN gives the last index there."""
    if not torch.compiler.is_compiling():
        return logits.argmax(dim=-1)
    vocab = logits.shape[-1]
    top = logits.amax(dim=-1, keepdim=True)
    # vocab - i at each maximum i: the largest is the first maximum's.
    countdown = torch.arange(vocab, 0, -1, device=logits.device)
    first = vocab - torch.where(logits == top, countdown, 0).amax(dim=-1)
    return first.clamp(max=vocab - 1)


def _nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the fewest most likely tokens whose probabilities sum to at least ``top_p``: a token
    goes once the tokens more likely than it already reach ``top_p`` (the first always stays)."""
    ordered, order = logits.sort(dim=-1, descending=True)
    probs = ordered.softmax(dim=-1)
    ahead = probs.cumsum(dim=-1) - probs
    ordered = ordered.masked_fill(ahead >= top_p, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, ordered)
