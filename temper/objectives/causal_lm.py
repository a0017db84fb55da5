"""Next-token cross-entropy: the objective of pretraining and SFT.

With ``kernels.fused_cross_entropy`` (``temper.kernels.dispatch``) the LM head and the loss run
in chunks of tokens from the model's ``hidden_states`` and ``output.weight``, so the full
[tokens, vocab] logits never exist, and only over the positions that carry a label (prompts
and padding are skipped); otherwise from full logits. Both give the same numbers.
An objective built from a run's config takes that run's ``Kernels`` (and passes the chunk to
the model's multi-token prediction); one built without them runs the references on full logits
(``temper.kernels.dispatch.REFERENCE``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from temper.config import Config, ConfigError, Kernels, ObjectiveConfig
from temper.data.batch import (
    DOCUMENT_POSITIONS,
    IGNORE_INDEX,
    SEQUENCE_SHARD,
    Batch,
    SequenceShard,
    model_inputs,
)
from temper.kernels.attention import DocumentMask
from temper.kernels.cross_entropy import (
    linear_cross_entropy,
    linear_log_probs,
    log_probs_from_logits,
    logits_entropy,
)
from temper.kernels.dispatch import REFERENCE
from temper.models.protocols import MultiTokenPredictor, RoutedModel
from temper.objectives.model_terms import indexer_term
from temper.objectives.registry import Metrics, Objective, register_objective


@register_objective
@dataclass
class CausalLMConfig(ObjectiveConfig):
    """``--objective.*`` of next-token prediction: pretraining (text) and SFT (sft) data."""

    name: str = "causal_lm"
    """Training objective, as registered with `temper.objectives.register_objective`:
    causal_lm (pretraining, SFT), dpo or grpo."""
    z_loss_weight: float = 0.0
    """Weight of PaLM's z-loss, logsumexp(logits)^2 per valid token: keeps the softmax
    normalizer near 1 (bf16 stability); 0 = off. Logged as z_loss."""

    data_formats: ClassVar[tuple[str, ...]] = ("text", "sft", "image_sft")

    def validate(self, config: Config) -> None:
        if self.z_loss_weight < 0:
            raise ConfigError(f"objective.z_loss_weight must be >= 0, got {self.z_loss_weight}")

    def build(self, config: Config, build_reference: Callable[[], nn.Module]) -> Objective:
        return CausalLM(self, config.kernels)


class CausalLM:
    """Sum of next-token negative log-likelihoods over labels that are not ignored.

    A ``RoutedModel`` (MoE load balancing) adds ``router_aux_loss_coef * aux`` per
    valid token, so after the trainer's division the gradient carries coef x the token-weighted
    mean of aux over micro-batches and ranks, and one batch's loss equals HF's CE + coef * aux.
    ``z_loss_weight`` adds ``weight * logsumexp(logits)^2`` per valid token (PaLM's z-loss),
    which keeps the softmax normalizer near 1 and the logits from drifting in bf16. A model
    with multi-token-prediction depths (``mtp_loss``) adds their weighted cross-entropy sum
    and logs ``mtp_loss`` and ``mtp_accuracy`` (the drafts' next-token accuracy). A model
    whose sparse-attention indexers train (``IndexerTrainer``) adds ``indexer_loss_weight *
    kl`` per valid token and logs ``indexer_kl``.
    """

    def __init__(
        self, settings: CausalLMConfig | None = None, kernels: Kernels | None = None
    ) -> None:
        """``settings`` None: the defaults (no z-loss); ``kernels`` None: the references on
        full logits (``temper.kernels.dispatch.REFERENCE``)."""
        self.settings = settings or CausalLMConfig()
        self.kernels = kernels

    def count(self, batch: Batch) -> torch.Tensor:
        return count_tokens(batch)

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
        labels, z_weight = batch["labels"], self.settings.z_loss_weight
        args = (batch["input_ids"], batch.get("position_ids"), documents(batch))
        shard = batch.get(SEQUENCE_SHARD)
        media = model_inputs(batch)  # a vision-language batch's images and positions
        kernels = self.kernels or REFERENCE
        if kernels.fused_cross_entropy and _weight_only_head(model):
            head = _HeadRows.of(labels)
            hidden = model.hidden_states(*args, shard=shard, **media)
            loss_sum, z_sum = linear_cross_entropy(
                head.gather(hidden),
                model.output.weight,
                head.gather(labels),
                z_weight,
                kernels.chunk_tokens(hidden.device),
                kernels.cross_entropy,
            )
        else:
            log_probs, lse = log_probs_from_logits(model(*args, shard=shard, **media), labels)
            z_sum = lse[labels != IGNORE_INDEX].pow(2).sum()
            loss_sum = -log_probs.sum() + z_weight * z_sum
        n_tokens = count_tokens(batch)
        metrics: Metrics = {}
        if z_weight:
            metrics["z_loss"] = (z_sum / n_tokens.clamp(min=1)).detach()
        if isinstance(model, RoutedModel):
            aux = model.aux_loss()
            loss_sum = loss_sum + model.args.router_aux_loss_coef * aux * n_tokens
            metrics["aux_loss"] = aux.detach()
            metrics["moe_load_imbalance"] = model.load_imbalance().detach()
        # DeepSeek sparse attention: the indexers' KL term, when they train.
        loss_sum = loss_sum + indexer_term(model, n_tokens, metrics)
        # Multi-token prediction (DeepSeek V3): its weighted draft losses join the sum.
        if isinstance(model, MultiTokenPredictor):
            chunk = kernels.chunk_tokens(labels.device)
            mtp = model.mtp_loss(labels, batch.get("position_ids"), chunk)
            if mtp is not None:
                loss_sum = loss_sum + mtp.weighted_sum
                metrics["mtp_loss"] = torch.as_tensor(mtp.mean)
                metrics["mtp_accuracy"] = torch.as_tensor(mtp.accuracy)
        return loss_sum, n_tokens, metrics


def label_log_probs(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    document_mask: DocumentMask | None = None,
    temperature: float = 1.0,
    shard: SequenceShard | None = None,
    entropy: torch.Tensor | None = None,
    kernels: Kernels | None = None,
) -> torch.Tensor:
    """Per-token log p(label) [b, s] in fp32, 0 where the label is ignored: the quantity DPO
    and GRPO build on, with the logits divided by ``temperature`` (GRPO's sampling one).
    Chunked through the head (no full logits) when the fused cross-entropy is on, as in
    `CausalLM`; from full logits otherwise. ``shard``: the rows are a sequence-parallel
    slice. ``entropy``: an fp32 tensor shaped like ``labels`` filled with each position's
    entropy at ``temperature`` from the same logits (no gradient): no forward of its own; with
    the fused head only the labelled positions are filled (the others keep their values).
    ``kernels``: the run's choices (None: the references on full logits)."""
    kernels = kernels or REFERENCE
    if kernels.fused_cross_entropy and _weight_only_head(model):
        head = _HeadRows.of(labels)
        hidden = model.hidden_states(input_ids, position_ids, document_mask, shard=shard)
        rows = head.gather(hidden) / temperature
        chunk = kernels.chunk_tokens(hidden.device)
        weight, impl = model.output.weight, kernels.cross_entropy
        rows_entropy = None if entropy is None else head.gather(entropy)
        log_probs = linear_log_probs(
            rows, weight, head.gather(labels), chunk, impl, entropy=rows_entropy
        )[0]
        if entropy is not None:
            entropy.copy_(head.scatter(rows_entropy, entropy))
        return head.scatter(log_probs, torch.zeros_like(labels, dtype=torch.float32))
    logits = model(input_ids, position_ids, document_mask, shard=shard) / temperature
    if entropy is not None:
        entropy.copy_(logits_entropy(logits.detach()))
    return log_probs_from_logits(logits, labels)[0]


@dataclass(frozen=True)
class _HeadRows:
    """The flat positions whose label is not ignored: the only rows the fused LM head runs on.

    Prompt tokens of chat SFT and GRPO and the padding of every row carry no label, so their
    logits change neither the loss nor a label's log-probability; skipping them roughly halves
    the head's matmuls on GRPO's rows. ``positions`` None: every position is labelled (plain
    pretraining), and the rows pass through with no copy.
    """

    label_dims: int
    """Dimensions of the labels ([b, s]: 2), which `gather` flattens."""
    positions: torch.Tensor | None
    """Flat indices into ``labels.reshape(-1)``, ascending."""

    @classmethod
    def of(cls, labels: torch.Tensor) -> _HeadRows:
        """Taken before the model's forward, so that the host sync a data-dependent count
        needs (on a GPU) waits for the work queued so far and never for this forward. A dry
        run's meta labels hold no values, so it plans the head over every row (an upper
        bound)."""
        if labels.is_meta:
            return cls(labels.dim(), None)
        positions = (labels.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)
        return cls(labels.dim(), None if positions.numel() == labels.numel() else positions)

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """The labelled rows of ``values`` shaped [*labels.shape, ...] -> [rows, ...] (the
        gradient flows back to those rows; the others get 0)."""
        flat = values.flatten(0, self.label_dims - 1)
        return flat if self.positions is None else flat.index_select(0, self.positions)

    def scatter(self, rows: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
        """``into`` [*labels.shape] with the labelled positions replaced by ``rows`` (a new
        tensor; the gradient flows to ``rows``)."""
        if self.positions is None:
            return rows.view(into.shape)
        return into.reshape(-1).index_copy(0, self.positions, rows).view(into.shape)


def _weight_only_head(model: nn.Module) -> bool:
    """The head applies ``output.weight`` and nothing else (no bias, no LoRA adapters), which
    the fused loss assumes; any other head computes full logits through its own forward."""
    return [name for name, _ in model.output.named_parameters()] == ["weight"]


def documents(batch: Batch) -> DocumentMask | None:
    """The packed documents of a batch with ``position_ids`` (they restart at each one), so
    attention never crosses a document boundary; None for a continuous stream."""
    position_ids = batch.get(DOCUMENT_POSITIONS, batch.get("position_ids"))
    if position_ids is None or position_ids.numel() == 0:  # empty: continuous SP rows
        return None
    return DocumentMask.from_position_ids(position_ids)


def count_tokens(batch: Batch) -> torch.Tensor:
    """Positions that carry a label: the denominator of the token-mean loss."""
    return (batch["labels"] != IGNORE_INDEX).sum()
