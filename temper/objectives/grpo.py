"""Group Relative Policy Optimization (Shao et al., 2024): PPO's clipped objective with the
value baseline replaced by the mean reward of a group of completions of the same prompt.

A rollout (``prepare``) samples ``group_size`` completions per prompt with the training
model itself, scores them with the rewards, and turns the rewards into advantages
``A = (r - mean_group) / (std_group + eps)``. It also records the policy's log-probabilities
of the sampled tokens with a trainer forward (``old``), and the reference's when a KL term is
on. Per completion token, with ``ratio = exp(logp - old)``:

    loss = -min(ratio A, clip(ratio, 1 - eps, 1 + eps) A) + kl_coef * k3
    k3   = exp(ref - logp) - (ref - logp) - 1     (Schulman's low-variance KL estimate)

The loss is summed over completion tokens and ``count`` is their number, so the trainer's
division averages over every token of the step (DAPO's token-level normalization: long
completions weigh by their length, not as one sample each). ``objective.loss`` swaps in
GSPO or Dr. GRPO (``temper.objectives.policy_loss``, with asymmetric clipping and truncated
importance sampling); DAPO's dynamic sampling is ``temper.objectives.dynamic_sampling``.
Rewards get each prompt's whole record (``temper.objectives.rewards``). The same rollout serves
``updates_per_rollout`` optimizer steps; the first is on-policy (ratio 1), later ones are
held near the sampling policy by the clip.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from temper.config import Config, ConfigError, ObjectiveConfig, check_positive, check_range
from temper.data.batch import IGNORE_INDEX, Batch
from temper.data.chat import load_chat_template, stop_token_ids
from temper.data.prompts import decode_record
from temper.data.tokenizer import Tokenizer, load_tokenizer
from temper.generation import generate
from temper.generation.sampling import check_sampling
from temper.kernels.cross_entropy import log_probs_from_logits
from temper.objectives.causal_lm import label_log_probs
from temper.objectives.policy_loss import LossName, PolicyLoss, overlong_penalty
from temper.objectives.registry import (
    Metrics,
    Objective,
    ReferenceMode,
    reference_policy,
    register_objective,
)
from temper.objectives.rewards import Record, Reward, exact_match, get_reward, reward_names
from temper.objectives.rollout_metrics import rollout_signal_metrics

LOGITS_BUDGET = 2**28
"""fp32 logits elements per no-grad forward chunk of a rollout (1 GiB)."""


def k3_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens; >= 0."""
    delta = ref_log_probs - log_probs
    return torch.exp(delta) - delta - 1


@register_objective
@dataclass
class GRPOConfig(ObjectiveConfig):
    """``--objective.*`` of GRPO: rollouts sampled from prompts, rewarded, trained on."""

    name: str = "grpo"
    """Training objective, as registered with `temper.objectives.register_objective`."""
    group_size: int = 8
    """Completions sampled per prompt; advantages are normalized within the group."""
    max_new_tokens: int = 32
    """The longest completion; prompts get training.seq_len minus this."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts (0 is greedy)."""
    top_k: int | None = None
    """Sample among the k most likely tokens; None = all."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 = off."""
    rewards: list[str] = field(default_factory=lambda: ["exact_match"])
    """Reward functions registered with `temper.objectives.register_reward`, summed."""
    reward_weights: list[float] = field(default_factory=list)
    """One weight per reward; empty = all 1."""
    clip_eps: float = 0.2
    """The importance ratio is clipped to [1 - clip_eps, 1 + clip_high] (PPO)."""
    clip_high: float | None = None
    """The upper clip; None = clip_eps (symmetric). DAPO's clip-higher: 0.28."""
    loss: LossName = "grpo"
    """grpo (per-token ratio, token-level mean), gspo (per-completion ratio and mean) or
    dr_grpo (no std division, constant normalizer); see docs/post-training.md."""
    tis_cap: float | None = None
    """Truncated importance sampling: weigh each token by min(exp(old - sampler), cap),
    the trainer's old log-prob against the sampler's; None = off."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: completions longer than max_new_tokens minus this
    lose up to overlong_penalty reward, linearly; 0 = off."""
    overlong_penalty: float = 1.0
    """The reward lost by a completion of max_new_tokens tokens (with overlong_buffer)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop groups whose rewards all agree and refill the batch
    with more prompts' rollouts."""
    dynamic_sampling_draws: int = 4
    """The most prompt micro-batches one rollout micro-batch samples to fill itself (with
    dynamic_sampling); a batch still short after them keeps what it found."""
    compile_rollouts: bool = False
    """Decode rollouts with the compiled static-cache step (`generate(compile=True)`); the
    first rollout then compiles it. See docs/generation.md."""
    accuracy_reward: str = "exact_match"
    """The registered reward reported as the rollout's `accuracy` metric (1 = right)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL estimate to the reference model; 0 builds no reference."""
    updates_per_rollout: int = 1
    """Optimizer steps taken on each rollout batch (the first one is on-policy)."""

    data_formats: ClassVar[tuple[str, ...]] = ("prompt",)

    def validate(self, config: Config) -> None:
        """Rollouts fit the rows, groups can differ, every reward exists; SP and EP are
        refused: decoding runs each rank on its own prompts, with no collective between
        tokens."""
        for degree in ("sp", "ep"):
            if getattr(config.parallelism, degree) != 1:
                raise ConfigError(
                    f"parallelism.{degree} must be 1 with objective.name 'grpo': rollouts "
                    "decode each rank's prompts alone, without the per-token collectives it "
                    "needs"
                )
        if self.group_size < 2:
            raise ConfigError(
                "objective.group_size must be >= 2 (advantages compare a prompt's "
                f"completions), got {self.group_size}"
            )
        check_positive(config, "objective.max_new_tokens", "objective.updates_per_rollout")
        if self.max_new_tokens >= config.training.seq_len:
            raise ConfigError(
                f"objective.max_new_tokens ({self.max_new_tokens}) must be below "
                f"training.seq_len ({config.training.seq_len}): the prompt needs room"
            )
        try:  # the sampler's own rules; its messages start with the argument's name
            check_sampling(self.temperature, self.top_k, self.top_p)
        except ValueError as error:
            raise ConfigError(f"objective.{error}") from None
        check_range(config, "objective.clip_eps", 0.0, 1.0, right_open=True)
        self._validate_variants(config)
        if self.kl_coef < 0:
            raise ConfigError(f"objective.kl_coef must be >= 0, got {self.kl_coef}")
        if not self.rewards:
            raise ConfigError("objective.rewards must name at least one reward")
        unknown = [r for r in self.rewards if r not in reward_names()]
        if unknown:
            raise ConfigError(
                f"objective.rewards: {', '.join(map(repr, unknown))} not registered; choose "
                f"from {', '.join(reward_names())} or register one with @register_reward"
            )
        if self.reward_weights and len(self.reward_weights) != len(self.rewards):
            raise ConfigError(
                f"objective.reward_weights has {len(self.reward_weights)} values for "
                f"{len(self.rewards)} objective.rewards"
            )

    def _validate_variants(self, config: Config) -> None:
        """The loss variants' own settings (see temper/objectives/policy_loss.py)."""
        if self.clip_high is not None and self.clip_high < 0:
            raise ConfigError(f"objective.clip_high must be >= 0, got {self.clip_high}")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ConfigError(f"objective.tis_cap must be > 0 or None, got {self.tis_cap}")
        if not 0 <= self.overlong_buffer <= self.max_new_tokens:
            raise ConfigError(
                f"objective.overlong_buffer must be in [0, objective.max_new_tokens "
                f"({self.max_new_tokens})], got {self.overlong_buffer}"
            )
        check_positive(config, "objective.dynamic_sampling_draws")
        if self.accuracy_reward not in reward_names():
            raise ConfigError(
                f"objective.accuracy_reward: {self.accuracy_reward!r} not registered; choose "
                f"from {', '.join(reward_names())}"
            )

    def policy_loss(self) -> PolicyLoss:
        """The loss ``objective.loss`` names, with its clip range."""
        high = self.clip_eps if self.clip_high is None else self.clip_high
        return PolicyLoss(self.loss, self.clip_eps, high, self.tis_cap, self.max_new_tokens)

    def completion_tokens(self) -> int:
        return self.max_new_tokens

    def build(self, config: Config, build_reference: Callable[[], nn.Module]) -> Objective:
        folder = config.data.tokenizer_path or config.model.hf_path
        tokenizer = load_tokenizer(folder)
        template = load_chat_template(config.data.chat_template, folder)
        return GRPO(
            tokenizer=tokenizer,
            stop_tokens=stop_token_ids(tokenizer, template),
            rewards={name: get_reward(name) for name in self.rewards},
            reward_weights=self.reward_weights or [1.0] * len(self.rewards),
            group_size=self.group_size,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            clip_eps=self.clip_eps,
            kl_coef=self.kl_coef,
            updates_per_rollout=self.updates_per_rollout,
            policy_loss=self.policy_loss(),
            overlong=(self.overlong_buffer, self.overlong_penalty),
            accuracy=get_reward(self.accuracy_reward),
            sampling_draws=self.dynamic_sampling_draws if self.dynamic_sampling else 1,
            compile_rollouts=self.compile_rollouts,
            **(reference_policy(config, build_reference) if self.kl_coef else {}),
        )


class GRPO:
    """GRPO with rollouts from the policy itself (see the module docstring)."""

    def __init__(
        self,
        *,
        tokenizer: Tokenizer,
        stop_tokens: set[int],
        rewards: dict[str, Reward],
        reward_weights: Sequence[float],
        group_size: int,
        max_new_tokens: int,
        temperature: float,
        top_k: int | None,
        top_p: float,
        clip_eps: float,
        kl_coef: float,
        updates_per_rollout: int,
        reference: nn.Module | None = None,
        reference_mode: ReferenceMode | None = None,
        policy_loss: PolicyLoss | None = None,
        overlong: tuple[int, float] = (0, 1.0),
        accuracy: Reward = exact_match,
        sampling_draws: int = 1,
        compile_rollouts: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop_tokens = stop_tokens
        self.rewards = rewards
        self.reward_weights = list(reward_weights)
        self.group_size = group_size
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        # The policy trained is the one sampled: logits over the temperature (greedy: 1).
        self.loss_temperature = temperature if temperature > 0 else 1.0
        self.top_k = top_k
        self.top_p = top_p
        self.kl_coef = kl_coef
        self.updates_per_rollout = updates_per_rollout
        self.reference = reference
        self.reference_mode = reference_mode
        self.policy_loss = policy_loss or PolicyLoss(
            clip_low=clip_eps, clip_high=clip_eps, max_new_tokens=max_new_tokens
        )
        self.overlong = overlong
        """(buffer, penalty) of the soft overlong punishment; buffer 0 = off."""
        self.accuracy = accuracy
        self.sampling_draws = sampling_draws
        """Prompt micro-batches a rollout micro-batch may sample (dynamic sampling; 1 = off)."""
        self.compile_rollouts = compile_rollouts

    def count(self, batch: Batch) -> torch.Tensor:
        """The unit the loss is averaged over: completion tokens (see ``PolicyLoss.count``)."""
        return self.policy_loss.count(batch["labels"] != IGNORE_INDEX)

    @torch.no_grad()
    def prepare(
        self, model: nn.Module, prompts: Batch, generator: torch.Generator
    ) -> tuple[Batch, dict[str, float]]:
        """Sample, score and log-prob one micro-batch of prompts; returns the training rows
        (``input_ids``, ``labels``, ``old_log_probs``, ``advantages``, maybe
        ``ref_log_probs``) and the rollout's metrics."""
        mask = prompts["prompt_mask"]
        rows = [ids[m] for ids, m in zip(prompts["prompt_ids"], mask, strict=True)]
        rows = [row for row in rows for _ in range(self.group_size)]
        was_training = model.training
        model.eval()
        out = generate(
            model,
            rows,
            self.max_new_tokens,
            self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            stop_tokens=self.stop_tokens,
            generator=generator,
            return_log_probs=True,
            compile=self.compile_rollouts,
        )
        model.train(was_training)

        input_ids, labels = rollout_rows(rows, out.tokens, out.lengths)
        old, entropy = _log_probs_and_entropy(model, input_ids, labels, self.loss_temperature)
        completion = labels != IGNORE_INDEX
        sampler = torch.zeros_like(old)
        sampler[completion] = out.log_probs[_completion_mask(out.lengths, self.max_new_tokens)]

        records = [decode_record(r) for r in prompts["record_ids"]]
        texts = out.texts(self.tokenizer.decode, self.stop_tokens)
        scores = self._score([self.tokenizer.decode(r.tolist()) for r in rows], texts, records)
        rewards = scores["reward"] + self._overlong_penalty(out.lengths.cpu())
        batch = {
            "input_ids": input_ids,
            "labels": labels,
            "old_log_probs": old,
            "advantages": self.policy_loss.advantages(rewards, self.group_size).to(old.device),
        }
        if self.policy_loss.tis_cap is not None:
            batch["sampler_log_probs"] = sampler
        if self.kl_coef:
            batch["ref_log_probs"] = self._reference_log_probs(model, input_ids, labels)
        n_tokens = completion.sum().clamp(min=1)
        metrics = {name: v.mean().item() for name, v in scores.items() if name != "reward"}
        metrics |= {
            "reward_mean": rewards.mean().item(),
            "reward_std": rewards.view(-1, self.group_size).std(dim=1).mean().item(),
            "response_length": out.lengths.float().mean().item(),
            "entropy": (entropy[completion].sum() / n_tokens).item(),
            "logprob_diff_max": (sampler - old)[completion].abs().max().item(),
        }
        signal = rollout_signal_metrics(rewards, self.group_size, sampler, old, completion)
        return batch, metrics | signal

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
        labels = batch["labels"]
        completion = labels != IGNORE_INDEX
        log_probs = label_log_probs(
            model, batch["input_ids"], labels, temperature=self.loss_temperature
        )
        loss, metrics = self.policy_loss(
            log_probs,
            batch["old_log_probs"],
            batch["advantages"],
            completion,
            batch.get("sampler_log_probs"),
        )
        if self.kl_coef:
            kl = k3_kl(log_probs, batch["ref_log_probs"])
            loss = loss + self.kl_coef * self.policy_loss.reduce(kl, completion)
            metrics["kl"] = kl.detach()[completion].sum() / completion.sum().clamp(min=1)
        return loss, self.count(batch), metrics

    def _score(
        self, prompts: list[str], completions: list[str], records: list[Record]
    ) -> dict[str, torch.Tensor]:
        """Per completion (on CPU): the weighted reward sum, each reward, and the accuracy
        reward's value."""
        per_reward = torch.zeros(len(self.rewards), len(completions))
        accuracy = torch.zeros(len(completions))
        for i, (prompt, text) in enumerate(zip(prompts, completions, strict=True)):
            record = records[i // self.group_size]
            for k, reward in enumerate(self.rewards.values()):
                per_reward[k, i] = reward(prompt, text, record)
            accuracy[i] = self.accuracy(prompt, text, record)
        weights = torch.tensor(self.reward_weights)
        scores = {"reward": weights @ per_reward}
        if len(self.rewards) > 1:
            scores |= {
                f"reward_{name}": row for name, row in zip(self.rewards, per_reward, strict=True)
            }
        return scores | {"accuracy": accuracy}

    def _overlong_penalty(self, lengths: torch.Tensor) -> torch.Tensor:
        """Each completion's soft overlong punishment (0 when ``overlong`` is off)."""
        buffer, penalty = self.overlong
        if not buffer:
            return torch.zeros(lengths.shape)
        return overlong_penalty(lengths, self.max_new_tokens, buffer, penalty)

    def _reference_log_probs(
        self, model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        """The reference's per-token log-probs: the frozen copy, or the policy with its
        adapters off."""
        if self.reference is not None:
            return label_log_probs(
                self.reference, input_ids, labels, temperature=self.loss_temperature
            )
        with self.reference_mode(model):
            return label_log_probs(model, input_ids, labels, temperature=self.loss_temperature)


def _completion_mask(lengths: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """[b, max_new_tokens]: the new tokens each row really produced (its stop token too)."""
    return torch.arange(max_new_tokens, device=lengths.device) < lengths[:, None]


def rollout_rows(
    prompts: list[torch.Tensor], tokens: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt + completion as right-padded rows of inputs and next-token labels that train
    on the completion only, as wide as the longest row needs (its last token is only a
    label). Padding (id 0) follows the real tokens: it is never a label, and causal
    attention keeps it from every real token."""
    width = max(p.numel() + n for p, n in zip(prompts, lengths.tolist(), strict=True)) - 1
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long, device=tokens.device)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    for i, (prompt, n) in enumerate(zip(prompts, lengths.tolist(), strict=True)):
        ids = torch.cat([prompt.to(tokens.device), tokens[i, :n]])
        p = prompt.numel()
        input_ids[i, : ids.numel() - 1] = ids[:-1]
        labels[i, p - 1 : ids.numel() - 1] = ids[p:]
    return input_ids, labels


@torch.no_grad()
def _log_probs_and_entropy(
    model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's per-token log p(label) and the policy's entropy at each position, both
    [b, s] fp32, from full logits at ``temperature`` computed a few rows at a time."""
    vocab = model.args.vocab_size
    step = max(1, LOGITS_BUDGET // (input_ids.shape[1] * vocab))
    log_probs, entropy = [], []
    for rows in range(0, input_ids.shape[0], step):
        logits = model(input_ids[rows : rows + step]).float() / temperature
        picked, lse = log_probs_from_logits(logits, labels[rows : rows + step])
        probs = torch.softmax(logits, dim=-1)
        log_probs.append(picked)
        entropy.append(lse - (probs * logits).sum(dim=-1))
    return torch.cat(log_probs), torch.cat(entropy)
