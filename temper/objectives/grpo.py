"""Group Relative Policy Optimization (Shao et al., 2024): PPO's clipped objective with the
value baseline replaced by the mean reward of a group of completions of the same prompt.

A rollout (``prepare``) samples ``group_size`` completions per prompt with the training
model itself, scores them with the rewards, and turns the rewards into advantages
``A = (r - mean_group) / (std_group + eps)`` (``objective.advantage_scale``). It records the
reference's log-probabilities of the sampled tokens when a KL term is on, and the policy's own
(``old``) with a trainer forward when they can differ from the first update's: a sampler
other than the model itself, or several updates per rollout. Otherwise ``old`` is the
training forward's own log-probs, detached (the ratio is 1 by construction). Per completion
token, with ``ratio = exp(logp - old)``:

    loss = -min(ratio A, clip(ratio, 1 - eps, 1 + eps) A) + kl_coef * k3
    k3   = exp(ref - logp) - (ref - logp) - 1     (Schulman's low-variance KL estimate)

(``kl_estimator weighted_k3``: ``ratio * k3``, DeepSeek-V3.2's importance-weighted estimate.)
``objective.loss`` says what the per-token sum is divided by (``grpo``: each completion's
mean, then the completions'; ``dapo``: every completion token of the step, TRL's default
and this objective's) or swaps in GSPO's sequence ratio (``temper.objectives.policy_loss``,
with asymmetric clipping and truncated importance sampling); DAPO's dynamic sampling is
``temper.objectives.dynamic_sampling``.
Rewards get each prompt's whole record (``temper.objectives.rewards``). The same rollout serves
``updates_per_rollout`` optimizer steps; the first is on-policy (ratio 1), later ones are
held near the sampling policy by the clip. With ``router_replay`` (MoE) every forward of a
rollout's tokens routes them to the experts that sampled them
(``temper.models.layers.route_replay``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from temper.config import (
    Config,
    ConfigError,
    Kernels,
    ObjectiveConfig,
    check_positive,
    check_range,
)
from temper.data.batch import IGNORE_INDEX, SEQUENCE_SHARD, Batch
from temper.data.chat import load_chat_template, stop_token_ids
from temper.data.tokenizer import Tokenizer, load_tokenizer
from temper.generation import gathered_weights
from temper.generation.engines import RolloutEngine
from temper.models.layers.route_replay import ROUTES, replaying_routes
from temper.objectives.causal_lm import documents, label_log_probs
from temper.objectives.model_terms import indexer_term
from temper.objectives.policy_loss import (
    ADVANTAGE_EPS,
    AdvantageScale,
    LossName,
    PolicyLoss,
    batch_std,
)
from temper.objectives.registry import (
    Metrics,
    Objective,
    ReferenceMode,
    reference_policy,
    register_objective,
)
from temper.objectives.rollout import (
    COMPLETION_LENGTHS,
    Rollout,
    RolloutSampler,
    RolloutSettings,
    Sampled,
)
from temper.parallel.ulysses import whole_sequences

KLEstimator = Literal["k3", "weighted_k3"]


def k3_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens; >= 0."""
    delta = ref_log_probs - log_probs
    return torch.exp(delta) - delta - 1


@register_objective
@dataclass
class GRPOConfig(RolloutSettings, ObjectiveConfig):
    """``--objective.*`` of GRPO: rollouts sampled from prompts (the fields of
    ``RolloutSettings``), rewarded, trained on (the loss's fields below)."""

    name: str = "grpo"
    """Training objective, as registered with `temper.objectives.register_objective`."""
    clip_eps: float = 0.2
    """The importance ratio is clipped to [1 - clip_eps, 1 + clip_high] (PPO)."""
    clip_high: float | None = None
    """The upper clip; None = clip_eps (symmetric). DAPO's clip-higher: 0.28."""
    loss: LossName = "dapo"
    """What the per-token losses are divided by: grpo (each completion's token mean, then
    the mean over completions), dapo (every completion token of the step), bnpo (each
    micro-batch's tokens), dr_grpo (rows x max_new_tokens); gspo: one ratio per completion,
    averaged as grpo. TRL's loss_type of the same name; see docs/post-training.md."""
    advantage_scale: AdvantageScale = "group"
    """The centred rewards are divided by the reward std of their group, of the whole step's
    rollout (batch: every micro-batch on every data rank), or not at all (none: Dr. GRPO).
    TRL's scale_rewards."""
    tis_cap: float | None = None
    """Truncated importance sampling: weigh each token by min(exp(old - sampler), cap),
    the trainer's old log-prob against the sampler's; None = off."""
    mask_band: tuple[float, float] | None = None
    """Token-level masking of the sampler-trainer gap: tokens whose exp(old - sampler) leaves
    [low, high] get no loss (their sampler drew them from a distribution the trainer does not
    hold); None = off. Composes with tis_cap; e.g. 0.5 2.0 with --rollout.engine vllm."""
    kl_coef: float = 0.0
    """Weight of the k3 KL estimate to the reference model; 0 builds no reference."""
    kl_estimator: KLEstimator = "k3"
    """k3 per token, or weighted_k3: k3 times the importance ratio (DeepSeek-V3.2's unbiased
    estimate off-policy; TRL's use_bias_correction_kl)."""
    updates_per_rollout: int = 1
    """Optimizer steps taken on each rollout batch (the first one is on-policy)."""

    data_formats: ClassVar[tuple[str, ...]] = ("prompt",)

    def validate(self, config: Config) -> None:
        """The rollout's rules (``RolloutSettings.check``), then the loss's."""
        self.check(config)
        check_positive(config, "objective.updates_per_rollout")
        check_range(config, "objective.clip_eps", 0.0, 1.0, right_open=True)
        if self.clip_high is not None and self.clip_high < 0:
            raise ConfigError(f"objective.clip_high must be >= 0, got {self.clip_high}")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ConfigError(f"objective.tis_cap must be > 0 or None, got {self.tis_cap}")
        if self.mask_band is not None and not 0 < self.mask_band[0] < 1 < self.mask_band[1]:
            raise ConfigError(
                f"objective.mask_band must be (low, high) with 0 < low < 1 < high, got "
                f"{self.mask_band}"
            )
        _check_engine(self, config)
        if self.loss == "gspo" and config.parallelism.sp > 1:
            raise ConfigError(
                "objective.loss gspo needs each completion's whole log-prob sum, which "
                f"parallelism.sp {config.parallelism.sp} splits over ranks; use grpo, dapo, "
                "bnpo or dr_grpo with sequence parallelism"
            )
        if self.kl_coef < 0:
            raise ConfigError(f"objective.kl_coef must be >= 0, got {self.kl_coef}")

    def policy_loss(self) -> PolicyLoss:
        """The loss ``objective.loss`` names, with its clip range."""
        high = self.clip_eps if self.clip_high is None else self.clip_high
        return PolicyLoss(
            self.loss,
            self.clip_eps,
            high,
            self.tis_cap,
            self.max_new_tokens,
            self.mask_band,
            self.advantage_scale,
        )

    def completion_tokens(self) -> int:
        return self.max_new_tokens

    def build(self, config: Config, build_reference: Callable[[], nn.Module]) -> Objective:
        folder = config.data.tokenizer_path or config.model.hf_path
        tokenizer = load_tokenizer(folder)
        template = load_chat_template(config.data.chat_template, folder)
        return GRPO(
            self,
            tokenizer=tokenizer,
            stop_tokens=stop_token_ids(tokenizer, template),
            lockstep_group=dist.group.WORLD if config.parallelism.ep > 1 else None,
            kernels=config.kernels,
            **(reference_policy(config, build_reference) if self.kl_coef else {}),
        )


def _check_engine(section: GRPOConfig, config: Config) -> None:
    """What only the native sampler offers, and what asynchronous rollouts cannot do."""
    rollout = config.rollout
    if rollout.engine != "native":
        for name in ("router_replay", "compile_rollouts"):
            if getattr(section, name):
                raise ConfigError(
                    f"objective.{name} needs --rollout.engine native (vLLM does not return "
                    "the experts it routed to, and compiles its own decoding)"
                )
    if rollout.mode == "async":
        if rollout.staleness and section.tis_cap is None and section.mask_band is None:
            raise ConfigError(
                "rollout.mode async samples with the weights of one update before: set "
                "objective.tis_cap (e.g. 2.0) or objective.mask_band (e.g. 0.5 2.0) to correct "
                "for the policy that sampled"
            )
        if section.dynamic_sampling:
            raise ConfigError(
                "objective.dynamic_sampling with rollout.mode async: refills draw prompts "
                "while the step trains; use rollout.mode sync"
            )
        if section.updates_per_rollout != 1:
            raise ConfigError(
                f"objective.updates_per_rollout {section.updates_per_rollout} with rollout.mode "
                "async: an asynchronous rollout serves one update"
            )


class GRPO:
    """GRPO with rollouts from the policy itself (see the module docstring)."""

    def __init__(
        self,
        settings: GRPOConfig,
        *,
        tokenizer: Tokenizer,
        stop_tokens: set[int],
        reference: nn.Module | None = None,
        reference_mode: ReferenceMode | None = None,
        lockstep_group: ProcessGroup | None = None,
        kernels: Kernels | None = None,
    ) -> None:
        """``settings`` whole (its rollout fields go to the sampler as they are); the KL term
        needs the frozen ``reference`` or the policy's ``reference_mode`` (LoRA: adapters
        off); ``kernels``: the run's choices for the head (None: the references,
        full logits)."""
        if settings.kl_coef and (reference is None) == (reference_mode is None):
            raise ValueError(
                "objective.kl_coef > 0 takes exactly one of a reference model or a reference mode"
            )
        self.settings = settings
        self.policy_loss = settings.policy_loss()
        self.sampler = RolloutSampler(
            settings,
            tokenizer=tokenizer,
            stop_tokens=stop_tokens,
            with_reference=settings.kl_coef > 0,
            reference=reference,
            reference_mode=reference_mode,
            lockstep_group=lockstep_group,
            recompute_old=settings.updates_per_rollout > 1,
            kernels=kernels,
        )
        self.kernels = kernels
        self.loss_temperature = self.sampler.loss_temperature
        self.updates_per_rollout = settings.updates_per_rollout

    def count(self, batch: Batch) -> torch.Tensor:
        """The units the loss is averaged over (``PolicyLoss.count``); of a sequence-parallel
        slice's rows, only the first slice counts those that are not tokens."""
        shard = batch.get(SEQUENCE_SHARD)
        whole = shard is None or shard.group is None or dist.get_rank(shard.group) == 0
        return self.policy_loss.count(batch["labels"] != IGNORE_INDEX, whole)

    def prepare(
        self,
        model: nn.Module,
        prompts: Batch,
        generator: torch.Generator,
        engine: RolloutEngine | None = None,
    ) -> tuple[Batch, dict[str, float]]:
        """Sample (with ``engine``; None: the model itself), score and log-prob one
        micro-batch of prompts (``temper.objectives.rollout``); returns the training rows
        (``input_ids``, ``labels``, ``completion_lengths``, ``sampler_log_probs``,
        ``advantages``, maybe ``old_log_probs`` and ``ref_log_probs``) and the rollout's
        metrics."""
        return self._with_advantages(self.sampler(model, prompts, generator, engine))

    def sample(
        self, model: nn.Module, prompts: Batch, generator: torch.Generator, engine: RolloutEngine
    ) -> Sampled:
        """``prepare``'s sampling alone (asynchronous rollouts run it beside training)."""
        return self.sampler.sample(model, prompts, generator, engine)

    def score(
        self, model: nn.Module, prompts: Batch, sampled: Sampled
    ) -> tuple[Batch, dict[str, float]]:
        """``prepare``'s scoring of what ``sample`` drew."""
        with gathered_weights(model), whole_sequences(model):
            return self._with_advantages(self.sampler.score(model, prompts, sampled))

    def _with_advantages(self, rollout: Rollout) -> tuple[Batch, dict[str, float]]:
        advantages = self.policy_loss.advantages(rollout.rewards, self.settings.group_size)
        device = rollout.batch["input_ids"].device
        scored = {"advantages": advantages.to(device), "rewards": rollout.rewards.to(device)}
        return rollout.batch | scored, rollout.metrics

    def finish_rollout(
        self, batches: list[Batch], sum_over_data: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """With ``advantage_scale batch``: every micro-batch's centred advantages divided by
        the std of all the step's rewards (every micro-batch on every data rank), as TRL
        divides by the std of its gathered batch. Each data rank computes it alike."""
        if self.policy_loss.scale != "batch":
            return
        rewards = torch.cat([batch["rewards"] for batch in batches]).double()
        count = torch.tensor(float(rewards.numel()), dtype=torch.float64, device=rewards.device)
        sums = sum_over_data(torch.stack([count, rewards.sum(), rewards.square().sum()]))
        scale = (batch_std(sums) + ADVANTAGE_EPS).float()
        for batch in batches:
            batch["advantages"] = batch["advantages"] / scale

    def empty_rollout(self, model: nn.Module, prompts: int, width: int) -> Batch:
        rows = prompts * self.settings.group_size
        scored = {"advantages": torch.zeros(rows), "rewards": torch.zeros(rows)}
        return self.sampler.empty_rollout(model, rows, width) | scored

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
        """The policy loss of a micro-batch of rollout rows. Without ``old_log_probs`` (the
        model sampled them and this is their one update) the forward's own log-probs,
        detached, are ``old``. Logs the policy's entropy from this forward's logits and the
        sampler-trainer gap."""
        labels = batch["labels"]
        completion = labels != IGNORE_INDEX
        entropy = torch.zeros(labels.shape, device=labels.device)
        # The rollout's routes, if replayed, enter the forward's context, which an activation
        # checkpoint's recomputation in backward reuses: no scope around the backward.
        with replaying_routes(model, batch.get(ROUTES)):
            log_probs = label_log_probs(
                model,
                batch["input_ids"],
                labels,
                batch.get("position_ids"),
                documents(batch),
                temperature=self.loss_temperature,
                shard=batch.get(SEQUENCE_SHARD),
                entropy=entropy,
                kernels=self.kernels,
            )
        old = batch.get("old_log_probs", log_probs.detach())
        sampler = batch["sampler_log_probs"]
        per_token, ratio, metrics = self.policy_loss(
            log_probs, old, batch["advantages"], completion, sampler
        )
        gap = (sampler - old).abs().masked_fill(~completion, 0.0)
        metrics["entropy"] = self._token_mean(entropy, completion, batch)
        metrics["logprob_diff_mean"] = self._token_mean(gap, completion, batch)
        metrics["logprob_diff_max"] = gap.amax()
        if self.settings.kl_coef:
            kl = k3_kl(log_probs, batch["ref_log_probs"])
            if self.settings.kl_estimator == "weighted_k3":
                kl = kl * ratio
            per_token = per_token + self.settings.kl_coef * kl
            metrics["kl"] = self._token_mean(kl, completion, batch)
        loss = self.policy_loss.reduce(per_token, completion, batch[COMPLETION_LENGTHS])
        count = self.count(batch)
        # DeepSeek sparse attention: the indexers' KL term of this forward, per unit.
        return loss + indexer_term(model, count, metrics), count, metrics

    @staticmethod
    def _token_mean(values: torch.Tensor, completion: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The mean of ``values`` [b, s] over the micro-batch's completion tokens. On a
        sequence-parallel slice: its part of that mean times the slices, so the metrics' mean
        over the slices' ranks is the whole rows' mean."""
        shard = batch.get(SEQUENCE_SHARD)
        slices = 1 if shard is None or shard.group is None else dist.get_world_size(shard.group)
        total = values.detach().masked_fill(~completion, 0.0).sum() * slices
        return total / batch[COMPLETION_LENGTHS].sum().clamp(min=1)
