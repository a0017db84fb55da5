"""DeepSeek Sparse Attention (DSA, DeepSeek V3.2 and GLM-5): a small "lightning indexer"
scores every visible key for every query, and multi-head latent attention then attends to each
query's ``topk`` best keys only.

The indexer's score of key s for query t is

    I[t, s] = sum_j w[t, j] * relu(q[t, j] . k[s] / sqrt(d))

over its ``n_heads`` query heads j (from the attention's query latent), one key head k (from
the hidden state, LayerNorm-ed) and per-query head weights w (``weights_proj``, times
``n_heads ** -0.5``). Rotary embeddings turn the first ``rope_dim`` dims of q and k, in the
rotate-half layout (DeepSeek V3.2) or in interleaved pairs (GLM-5). The selection is discrete:
it runs without gradient, so the main loss never reaches the indexer (as in transformers, whose
indexer runs under ``no_grad``).

The attention over the selection runs through ``kernels.sparse_attention``: the plain-PyTorch
reference makes it a boolean mask over dense scores (the cost of dense attention); the Triton
kernel (CUDA's ``auto``) reads only the selected keys (``temper.kernels.sparse_attention``).
Keys a query may not see (future ones, other packed documents, left padding) are never
selected; when fewer than ``topk`` are visible, all are.

Training the indexer (``IndexerTraining``, DeepSeek V3.2 report): its scores, computed from
detached inputs, learn the main attention's distribution over the same keys (summed over
heads, L1-normalized, detached) through a KL divergence, so the language-model loss trains the
rest of the model and the KL only the indexer. ``off``: the indexer does not train (as in
transformers, the usual choice for fine-tuning a released model); ``sparse``: attention over
the selected keys, KL over them; ``dense_warmup``: attention over every visible key, KL over
them all (the warm-up, with the rest of the model frozen by the family).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from temper.data.batch import SequenceShard
from temper.kernels.attention import causal_band
from temper.kernels.sparse_attention import sparse_attention
from temper.models.layers.context import ForwardContext
from temper.models.layers.init import init_linear
from temper.models.layers.mla import MLA
from temper.models.layers.rope import apply_rope
from temper.models.layers.whole_sequence import local_part, whole_sequence
from temper.utils.compat import functional_all_reduce

IndexerTraining = Literal["off", "sparse", "dense_warmup"]
INDEXER_TRAINING: tuple[IndexerTraining, ...] = ("off", "sparse", "dense_warmup")

INDEXER_NORM_EPS = 1e-6
"""The eps of the indexer's key LayerNorm in DeepSeek's and transformers' code."""


class LightningIndexer(nn.Module):
    """Scores ``I[t, s]`` (module docstring) from the hidden states and the query latent."""

    def __init__(
        self,
        dim: int,
        q_lora_rank: int,
        n_heads: int,
        head_dim: int,
        rope_dim: int,
        *,
        rope_interleaved: bool,
    ) -> None:
        super().__init__()
        if rope_dim > head_dim:
            raise ValueError(f"index_head_dim {head_dim} must be >= qk_rope_head_dim {rope_dim}")
        self.n_heads = n_heads
        self.head_dim = head_dim
        self.rope_dim = rope_dim
        self.rope_interleaved = rope_interleaved
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=INDEXER_NORM_EPS)
        self.weights_proj = nn.Linear(dim, n_heads, bias=False)

    def init_weights(self, std: float) -> None:
        for linear in (self.wq_b, self.wk, self.weights_proj):
            init_linear(linear, std)
        self.k_norm.reset_parameters()

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary on the first ``rope_dim`` dims of x [b, s, h, head_dim]; the rest pass."""
        r = self.rope_dim
        return torch.cat((apply_rope(x[..., :r], cos, sin, self.rope_interleaved), x[..., r:]), -1)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The one key head [b, s, head_dim] of hidden states x [b, s, dim]."""
        return self._rotate(self.k_norm(self.wk(x)).unsqueeze(2), cos, sin).squeeze(2)

    def forward(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        keys: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """fp32 scores [b, s, t] of the queries x [b, s, dim] (query latent [b, s, q_lora_rank],
        rotary cos/sin [b, s, rope_dim]) over ``keys`` [b, t, head_dim]."""
        b, s, _ = x.shape
        q = self._rotate(self.wq_b(q_latent).view(b, s, self.n_heads, self.head_dim), cos, sin)
        return index_scores(q, keys, x, self.weights_proj)


def index_scores(
    q: torch.Tensor, keys: torch.Tensor, x: torch.Tensor, weights_proj: nn.Linear
) -> torch.Tensor:
    """``I[t, s]`` (module docstring) in fp32 [b, s, t] of the rotated query heads q
    [b, s, h, d] over ``keys`` [b, t, d], the head weights ``weights_proj`` of x [b, s, dim]:
    shared by DSA's indexer and DeepSeek V4's (``temper.models.layers.compressor``)."""
    # [b, s, h, d] @ [b, 1, d, t]: every head's dot product with the one key head.
    logits = q.float() @ keys.float().transpose(1, 2).unsqueeze(1) * q.shape[-1] ** -0.5
    # In fp32 whatever the compute dtype, as transformers keeps this projection.
    weights = F.linear(x.float(), weights_proj.weight.float()) * q.shape[2] ** -0.5
    return (weights.unsqueeze(-2) @ F.relu(logits)).squeeze(-2)


def select_top_k(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """[b, s, t] True at each query's ``topk`` best-scored ``visible`` keys (all visible ones
    when fewer): the keys sparse attention keeps. Equal scores (the indexer's ReLU gives exact
    zeros) go to the earliest keys, by a stable sort rather than ``topk``, whose tie order
    depends on the row's length: so a row padded at the end chooses what it chose unpadded."""
    masked = scores.masked_fill(~visible, float("-inf"))
    order = masked.sort(dim=-1, descending=True, stable=True).indices
    best = order[..., : min(topk, scores.shape[-1])]
    return torch.zeros_like(visible).scatter(-1, best, True) & visible


def indexer_kl(
    q: torch.Tensor,
    k: torch.Tensor,
    scores: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Each query's KL(p || softmax(scores)) [b, s] over its ``allowed`` keys [b, s, t]: p is
    the attention distribution of q [b, s, h, d] over k [b, t, h, d] (fp32, no gradient)
    summed over heads and L1-normalized, ``scores`` [b, s, t] the indexer's."""
    with torch.no_grad():
        logits = torch.einsum("bshd,bthd->bhst", q.float(), k.float()) * scale
        probs = logits.masked_fill(~allowed[:, None], float("-inf")).softmax(-1).sum(1)
        target = probs / probs.sum(-1, keepdim=True)
    log_q = scores.masked_fill(~allowed, float("-inf")).log_softmax(-1)
    log_q = log_q.masked_fill(~allowed, 0.0)
    return (torch.xlogy(target, target) - target * log_q).sum(-1)


class IndexerOutputs(NamedTuple):
    """What a ``SparseMLA`` forward returns beside its output."""

    kl: torch.Tensor | None
    """[] the indexer's KL term; None unless it trains in this forward (``indexer_training``
    on, a training-mode forward with autograd, no cache) and for a layer without an indexer."""
    selected: torch.Tensor
    """[b, s, t] True at the keys each query attended to (every query of the whole sequence
    under sequence parallelism): what the layers after it without an indexer reuse (GLM-5's
    ``indexer_types`` ``"shared"``, through ``ForwardContext.reused_selection``)."""


class SparseMLA(MLA):
    """MLA whose queries attend only to the keys their ``indexer`` selects (DSA).

    The MLA projections and rotary are the parent's; the indexer reads its query latent, so
    ``q_lora_rank`` is required. The context's ``backend`` is ignored: the attention runs as
    ``kernels.sparse_attention`` says (the mask on sdpa, or the Triton kernel). ``forward``
    returns the indexer's KL term (module docstring) and the keys chosen beside its output
    (``IndexerOutputs``): outputs, not state, so the block passes them out (``BlockAux``), a
    recomputation overwrites nothing and torch.compile traces no side effect.

    ``own_indexer`` False: no indexer; the layer attends to the keys the latest layer with one
    chose (``ForwardContext.reused_selection``, which the decoder sets from that block's
    outputs).
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        q_lora_rank: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        *,
        index_n_heads: int,
        index_head_dim: int,
        index_topk: int,
        index_rope_interleaved: bool,
        softmax_scale: float,
        rope_scale: float = 1.0,
        rope_interleaved: bool = True,
        indexer_training: IndexerTraining = "off",
        own_indexer: bool = True,
    ) -> None:
        super().__init__(
            dim,
            n_heads,
            q_lora_rank,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
            softmax_scale=softmax_scale,
            rope_scale=rope_scale,
            rope_interleaved=rope_interleaved,
        )
        if indexer_training not in INDEXER_TRAINING:
            raise ValueError(
                f"indexer_training {indexer_training!r} is not one of {INDEXER_TRAINING}"
            )
        self.index_topk = index_topk
        self.indexer_training = indexer_training
        self.indexer = (
            LightningIndexer(
                dim,
                q_lora_rank,
                index_n_heads,
                index_head_dim,
                qk_rope_head_dim,
                rope_interleaved=index_rope_interleaved,
            )
            if own_indexer
            else None
        )

    def init_weights(self, std: float, out_std: float) -> None:
        super().init_weights(std, out_std)
        if self.indexer is not None:
            self.indexer.init_weights(std)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, IndexerOutputs]:
        """As ``MLA.forward``, each query restricted to its selected keys (to every visible
        key in ``dense_warmup``); and its ``IndexerOutputs``."""
        q, k, v, q_latent = self.project(x, ctx.cos, ctx.sin, ctx.kernels)
        assert q_latent is not None  # q_lora_rank is required in __init__'s signature
        if self.indexer is None:
            chosen = ctx.reused_selection
            whole = x.shape[1] if ctx.shard is None else ctx.shard.seq_len
            if chosen is None or chosen.shape[1] != whole:
                raise RuntimeError("a shared DSA layer runs after the layer it reuses")
            kl = None
        else:
            chosen, kl = self._choose(x, q_latent, q, k, ctx, self.indexer)
        out = self.sequence_core(self, q, k, v, dataclasses.replace(ctx, selected=chosen))
        return self.wo(out.flatten(2)), IndexerOutputs(kl, chosen)

    def mix_heads(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """Each query over its selected keys (``ctx.selected``) through the kernel dispatcher
        (``kernels.sparse_attention``: the masked reference, or the Triton kernel that reads
        only those keys); decoding, through the KV cache as MLA does."""
        if ctx.cache is not None:
            return super().mix_heads(q, k, v, ctx)
        assert ctx.selected is not None  # forward sets it
        return sparse_attention(
            q, k, v, ctx.selected, self.softmax_scale, ctx.kernels.sparse_attention
        )

    def _choose(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        ctx: ForwardContext,
        indexer: LightningIndexer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[b, s, t] True at the keys each query attends to, and the KL term (None unless
        the indexer trains).

        Under sequence or context parallelism each rank scores its queries against the whole
        sequence's indexer keys (``whole_sequence``) and the rows of every rank are joined in
        sequence order: the choice of all queries of the whole sequence, which the attention
        core sees (Ulysses' whole, or CP's all-gather taking its rank's rows). The scores
        leave out the padding's keys, so each row is one process's and ``topk`` breaks ties
        as it would there (ReLU makes exact ties common); the KL is the mean over the whole
        sequences' real queries."""
        cos, sin = ctx.cos * self.rope_scale, ctx.sin * self.rope_scale
        cache, shard = ctx.cache, ctx.shard
        trains = (
            self.indexer_training != "off"
            and self.training
            and cache is None
            and torch.is_grad_enabled()
        )
        # The indexer reads detached inputs: no loss reaches the rest of the model through it.
        with torch.enable_grad() if trains else torch.no_grad():
            x_in, latent = x.detach(), q_latent.detach()
            keys = indexer.keys(x_in, cos, sin)
            if cache is not None:
                keys = cache.index_keys(keys)
            elif shard is not None:
                keys = whole_sequence(keys, shard)
            real = keys.shape[1] if shard is None or shard.real_len is None else shard.real_len
            scores = indexer(x_in, latent, keys[:, :real], cos, sin)
        visible = self._visible(ctx, keys.shape[1], x.device)
        visible = visible.expand(scores.shape[0], -1, -1)
        if self.indexer_training == "dense_warmup":
            chosen = visible[..., :real]
        else:
            chosen = select_top_k(scores.detach(), visible[..., :real], self.index_topk)
        mean_kl = None
        if trains:
            every_k = k if shard is None else whole_sequence(k.detach(), shard)
            n = x.shape[1] if shard is None else shard.valid_len
            kl = indexer_kl(
                q[:, :n], every_k[:, :real], scores[:, :n], chosen[:, :n], self.softmax_scale
            )
            mean_kl = kl.mean() if shard is None else _whole_sequence_mean(kl, shard)
        # A padding query keeps the padding keys it sees (itself at least), as attention needs.
        chosen = torch.cat([chosen, visible[..., real:]], dim=-1)
        return (chosen if shard is None else whole_sequence(chosen, shard)), mean_kl

    @staticmethod
    def _visible(ctx: ForwardContext, n_keys: int, device: torch.device) -> torch.Tensor:
        """[b or 1, queries, n_keys] True where a query may see a key: the cache's filled
        columns when decoding, else the same document and not later (the rows of this rank's
        queries under sequence or context parallelism, whose keys are the whole sequence's)."""
        if ctx.cache is not None:
            return ctx.cache.visible()
        if ctx.docs is not None:
            visible = ctx.docs.dense()[:, 0]
        else:
            visible = causal_band(n_keys, n_keys, None, device)[None]
        return visible if ctx.shard is None else local_part(visible, ctx.shard)


def _whole_sequence_mean(kl: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """The mean of the real queries' ``kl`` [b, valid_len] over every rank of the shard's group
    (SP, CP or CP x SP):
    what one process holding the whole rows would take (the same on every rank; the gradient
    of each rank's use of it is summed back)."""
    totals = torch.stack([kl.sum(), kl.new_tensor(float(kl.numel()))])
    totals = functional_all_reduce(totals, "sum", shard.group)
    return totals[0] / totals[1]
