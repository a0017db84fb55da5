"""One RL rollout of a micro-batch of prompts: completions sampled with the policy itself,
scored by the rewards, and the per-token log-probabilities the loss compares against.

Everything that runs the policy (decoding, the old log-probabilities, the reference's
log-probabilities with LoRA's adapters off) runs in one ``gathered_weights`` region: under
FSDP2 each unit is all-gathered once for the whole rollout. Under sequence parallelism every
rank of an SP group rolls out the same prompts with the same sampler and runs whole sequences
(``whole_sequences``); training then slices the rows.

The old log-probabilities (what the clipped ratio compares against) need a forward of their
own only when they can differ from the first update's forward: when another engine sampled
(vLLM's numerics are not the trainer's) or the rollout serves several updates
(``recompute_old``). When the model itself sampled and one update follows, the loss takes its
own forward's log-probs, detached, as ``old``: the ratio is 1 by construction, as the forward
here would make it (it runs in the loss's precision, ``Engine.autocast``, with the loss's own
function). The policy's entropy comes from the training forward's logits
(``temper.objectives.grpo``), and the sampler's log-probs ride in the batch so the loss
reports the sampler-trainer gap (``logprob_diff_mean``/``_max``).

Every rank runs the same number of forwards whatever its rows' widths: one prefill and then
decoding steps until every rank of ``lockstep_group`` is done (expert parallelism's
all-to-alls pair up token for token), then one forward for the old log-probabilities (when
they are recomputed, on every rank alike) and one for the reference. So collectives inside
the model (an all-to-all, a forward outside the gathered region) always pair up.

With ``router_replay`` (MoE) the decoding forwards record each token's experts; the rows'
``routes`` are replayed in the old log-probabilities' forward, and the loss replays them in
training (``temper.models.layers.route_replay``). The reference routes as its own router
chooses.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed import ProcessGroup

from temper.config import Config, ConfigError, Kernels, check_positive
from temper.data.batch import IGNORE_INDEX, Batch
from temper.data.prompts import decode_record
from temper.data.tokenizer import Tokenizer
from temper.generation import Generation, gathered_weights
from temper.generation.engines import NativeEngine, RolloutEngine, SamplingParams
from temper.generation.sampling import check_sampling
from temper.models.fit import model_args
from temper.models.layers.route_replay import (
    ROUTE_DTYPE,
    ROUTES,
    recording_routes,
    replaying_routes,
    routed_layers,
    stacked,
)
from temper.objectives.causal_lm import label_log_probs
from temper.objectives.policy_loss import overlong_penalty
from temper.objectives.registry import ReferenceMode
from temper.objectives.rewards import Record, Reward, get_reward, reward_names
from temper.objectives.rollout_metrics import no_signal_groups
from temper.parallel.ulysses import whole_sequences

COMPLETION_LENGTHS = "completion_lengths"
"""Batch key of each row's completion tokens [rows], counted on the whole row: the per-completion
losses divide by it, also on a sequence-parallel slice of the row."""


@dataclass
class Sampled:
    """A rollout's completions before scoring."""

    rows: list[torch.Tensor]
    """The prompts, each repeated ``group_size`` times."""
    generation: Generation
    routes: torch.Tensor | None = None
    """With router replay: the experts each fed token was routed to (``generate``'s
    columns)."""
    by_policy: bool = True
    """The model itself sampled (the native engine), with the weights it trains next."""


@dataclass
class Rollout:
    """What a rollout hands the objective: the training rows and their scores."""

    batch: Batch
    """``input_ids``, ``labels``, ``completion_lengths``, the sampler's own
    ``sampler_log_probs``, ``old_log_probs`` when recomputed (module docstring) and, with a
    reference, ``ref_log_probs``; with ``router_replay``, the sampled tokens' ``routes``
    [rows, width, moe_layers, top_k]."""
    rewards: torch.Tensor
    """[rows] fp32 on CPU: each completion's weighted reward sum, with the overlong
    punishment."""
    metrics: dict[str, float]


@dataclass
class RolloutSettings:
    """What a GRPO rollout samples and how it scores it: the rollout's ``--objective.*``
    fields. ``GRPOConfig`` inherits them (so their flags stay ``--objective.group_size`` ...)
    and hands itself whole to ``RolloutSampler``; a new rollout option is a field here, read
    where it is used (the sampler, or the driver for dynamic sampling), with its rule in
    ``check`` if it has one."""

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
    router_replay: bool = False
    """MoE only: record the experts each sampled token was routed to and route it so in the
    old log-probs' and every training forward of that rollout (R3); see
    docs/post-training.md."""
    ignore_eos: bool = False
    """Decode every completion to max_new_tokens: the end-of-turn and EOS tokens no longer end
    it (they are sampled and trained as any token). For benchmarks that need equal work per
    row (vLLM's and TRL's ignore_eos / min_new_tokens), not for training a policy."""

    @property
    def sampling_draws(self) -> int:
        """Prompt micro-batches one rollout micro-batch may sample (1: no dynamic sampling)."""
        return self.dynamic_sampling_draws if self.dynamic_sampling else 1

    def check(self, config: Config) -> None:
        """The rollout fields' own rules; ConfigError naming the ``objective.*`` field."""
        if self.group_size < 2:
            raise ConfigError(
                "objective.group_size must be >= 2 (advantages compare a prompt's "
                f"completions), got {self.group_size}"
            )
        check_positive(config, "objective.max_new_tokens", "objective.dynamic_sampling_draws")
        if self.max_new_tokens >= config.training.seq_len:
            raise ConfigError(
                f"objective.max_new_tokens ({self.max_new_tokens}) must be below "
                f"training.seq_len ({config.training.seq_len}): the prompt needs room"
            )
        try:  # the sampler's own rules; its messages start with the argument's name
            check_sampling(self.temperature, self.top_k, self.top_p)
        except ValueError as error:
            raise ConfigError(f"objective.{error}") from None
        if not 0 <= self.overlong_buffer <= self.max_new_tokens:
            raise ConfigError(
                f"objective.overlong_buffer must be in [0, objective.max_new_tokens "
                f"({self.max_new_tokens})], got {self.overlong_buffer}"
            )
        if self.router_replay:
            _check_router_replay(self, config)
        if not self.rewards:
            raise ConfigError("objective.rewards must name at least one reward")
        for name, names in (("rewards", self.rewards), ("accuracy_reward", [self.accuracy_reward])):
            unknown = [r for r in names if r not in reward_names()]
            if unknown:
                raise ConfigError(
                    f"objective.{name}: {', '.join(map(repr, unknown))} not registered; choose "
                    f"from {', '.join(reward_names())} or register one with @register_reward"
                )
        if self.reward_weights and len(self.reward_weights) != len(self.rewards):
            raise ConfigError(
                f"objective.reward_weights has {len(self.reward_weights)} values for "
                f"{len(self.rewards)} objective.rewards"
            )


def _check_router_replay(settings: RolloutSettings, config: Config) -> None:
    """Router replay needs routed experts and the eager decode step, which records them."""
    _, args, source = model_args(config)
    if not getattr(args, "n_experts", 0):  # 0 or absent: a dense model (see check_model)
        raise ConfigError(
            f"objective.router_replay needs a mixture-of-experts model; {source} has no "
            "routed experts"
        )
    if settings.compile_rollouts:
        raise ConfigError(
            "objective.router_replay with objective.compile_rollouts: the compiled decode "
            "step does not record routes; turn one off"
        )


class RolloutSampler:
    """Samples ``group_size`` completions per prompt and records what the loss needs, as its
    ``settings`` say."""

    def __init__(
        self,
        settings: RolloutSettings,
        *,
        tokenizer: Tokenizer,
        stop_tokens: set[int],
        with_reference: bool = False,
        reference: nn.Module | None = None,
        reference_mode: ReferenceMode | None = None,
        lockstep_group: ProcessGroup | None = None,
        recompute_old: bool = False,
        kernels: Kernels | None = None,
    ) -> None:
        """``kernels``: the run's choices for the head's log-probs (None: the references,
        full logits)."""
        self.settings = settings
        self.kernels = kernels
        self.tokenizer = tokenizer
        self.stop_tokens = set() if settings.ignore_eos else stop_tokens
        self.rewards: dict[str, Reward] = {name: get_reward(name) for name in settings.rewards}
        self.accuracy = get_reward(settings.accuracy_reward)
        """The reward reported as the ``accuracy`` metric."""
        # The policy trained is the one sampled: logits over the temperature (greedy: 1).
        self.loss_temperature = settings.temperature if settings.temperature > 0 else 1.0
        self.with_reference = with_reference
        self.reference = reference
        self.reference_mode = reference_mode
        self.lockstep_group = lockstep_group
        self.recompute_old = recompute_old
        """Run the old log-probs' forward also when the model itself sampled (several updates
        per rollout; forced on, the path the ratio-1 shortcut is checked against)."""

    @property
    def params(self) -> SamplingParams:
        settings = self.settings
        return SamplingParams(
            settings.max_new_tokens,
            settings.temperature,
            settings.top_k,
            settings.top_p,
            frozenset(self.stop_tokens),
        )

    @torch.no_grad()
    def __call__(
        self,
        model: nn.Module,
        prompts: Batch,
        generator: torch.Generator,
        engine: RolloutEngine | None = None,
    ) -> Rollout:
        """Sample with ``engine`` (the model itself when None) and score: one gathered region
        for every forward of the rollout."""
        with gathered_weights(model), whole_sequences(model):
            return self.score(model, prompts, self.sample(model, prompts, generator, engine))

    def sample(
        self,
        model: nn.Module,
        prompts: Batch,
        generator: torch.Generator,
        engine: RolloutEngine | None = None,
    ) -> Sampled:
        """The completions of ``group_size`` copies of each prompt. With an engine other than
        the native one this touches no model, so it may run while the model trains."""
        rows = [
            ids[m] for ids, m in zip(prompts["prompt_ids"], prompts["prompt_mask"], strict=True)
        ]
        rows = [row for row in rows for _ in range(self.settings.group_size)]
        engine = engine or NativeEngine(model, self.lockstep_group, self.settings.compile_rollouts)
        recording = recording_routes(model) if self.settings.router_replay else nullcontext()
        with recording as record:
            out = engine.generate(rows, self.params, generator)
        routes = None if record is None else stacked(record)
        return Sampled(rows, out, routes, by_policy=isinstance(engine, NativeEngine))

    @torch.no_grad()
    def score(self, model: nn.Module, prompts: Batch, sampled: Sampled) -> Rollout:
        """The training rows of ``sampled``, the trainer's own log-probabilities of them where
        the loss needs them (old, reference: in the mode the loss runs in), the rewards and the
        metrics."""
        rows, device = sampled.rows, prompts["prompt_ids"].device
        out = sampled.generation
        tokens, lengths = out.tokens.to(device), out.lengths.to(device)
        input_ids, labels = rollout_rows(rows, tokens, lengths)
        routes = None
        if sampled.routes is not None:
            routes = rollout_routes(sampled.routes, rows, lengths, input_ids.shape[1])
        completion = labels != IGNORE_INDEX
        sampler = torch.zeros(input_ids.shape, device=device)
        sampler[completion] = out.log_probs.to(device)[
            _completion_mask(lengths, self.settings.max_new_tokens)
        ].float()
        batch = {
            "input_ids": input_ids,
            "labels": labels,
            COMPLETION_LENGTHS: completion.sum(dim=1),
            "sampler_log_probs": sampler,
        }
        if self.recompute_old or not sampled.by_policy:
            with replaying_routes(model, routes):
                batch["old_log_probs"] = self._log_probs(model, input_ids, labels)
        if routes is not None:
            batch[ROUTES] = routes
        if self.with_reference:
            batch["ref_log_probs"] = self._reference_log_probs(model, input_ids, labels)

        records = [decode_record(r) for r in prompts["record_ids"]]
        texts = out.texts(self.tokenizer.decode, self.stop_tokens)
        scores = self._score([self.tokenizer.decode(r.tolist()) for r in rows], texts, records)
        rewards = scores["reward"] + self._overlong_penalty(lengths.cpu())
        metrics = {name: v.mean().item() for name, v in scores.items() if name != "reward"}
        group_size = self.settings.group_size
        metrics |= {
            "reward_mean": rewards.mean().item(),
            "reward_std": rewards.view(-1, group_size).std(dim=1).mean().item(),
            "response_length": lengths.float().mean().item(),
            "no_signal_groups": no_signal_groups(rewards, group_size),
        }
        return Rollout(batch, rewards, metrics)

    def empty_rollout(self, model: nn.Module, rows: int, width: int) -> Batch:
        """Zeros shaped like a rollout of ``model`` of ``rows`` rows ``width`` wide."""
        ids = torch.zeros(rows, width, dtype=torch.long)
        batch = {
            "input_ids": ids,
            "labels": ids.clone(),
            COMPLETION_LENGTHS: torch.zeros(rows, dtype=torch.long),
            "sampler_log_probs": torch.zeros(rows, width),
            "old_log_probs": torch.zeros(rows, width),
        }
        if self.settings.router_replay:
            layers = routed_layers(model)
            shape = (rows, width, len(layers), layers[0].top_k)
            batch[ROUTES] = torch.zeros(shape, dtype=ROUTE_DTYPE)
        if self.with_reference:
            batch["ref_log_probs"] = torch.zeros(rows, width)
        return batch

    def _score(
        self, prompts: list[str], completions: list[str], records: list[Record]
    ) -> dict[str, torch.Tensor]:
        """Per completion (on CPU): the weighted reward sum, each reward, and the accuracy
        reward's value."""
        per_reward = torch.zeros(len(self.rewards), len(completions))
        accuracy = torch.zeros(len(completions))
        for i, (prompt, text) in enumerate(zip(prompts, completions, strict=True)):
            record = records[i // self.settings.group_size]
            for k, reward in enumerate(self.rewards.values()):
                per_reward[k, i] = reward(prompt, text, record)
            accuracy[i] = self.accuracy(prompt, text, record)
        weights = torch.tensor(self.settings.reward_weights or [1.0] * len(self.rewards))
        scores = {"reward": weights @ per_reward}
        if len(self.rewards) > 1:
            scores |= {
                f"reward_{name}": row for name, row in zip(self.rewards, per_reward, strict=True)
            }
        return scores | {"accuracy": accuracy}

    def _overlong_penalty(self, lengths: torch.Tensor) -> torch.Tensor:
        """Each completion's soft overlong punishment (0 when ``overlong_buffer`` is off)."""
        settings = self.settings
        if not settings.overlong_buffer:
            return torch.zeros(lengths.shape)
        return overlong_penalty(
            lengths, settings.max_new_tokens, settings.overlong_buffer, settings.overlong_penalty
        )

    def _reference_log_probs(
        self, model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        """The reference's per-token log-probs: the frozen copy, or the policy with its
        adapters off."""
        if self.reference is not None:
            with whole_sequences(self.reference):
                return self._log_probs(self.reference, input_ids, labels)
        with self.reference_mode(model):
            return self._log_probs(model, input_ids, labels)

    def _log_probs(
        self, model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        """Per-token log-probs of whole rows at the loss's temperature."""
        return label_log_probs(
            model, input_ids, labels, temperature=self.loss_temperature, kernels=self.kernels
        )


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


def rollout_routes(
    columns: torch.Tensor, prompts: list[torch.Tensor], lengths: torch.Tensor, width: int
) -> torch.Tensor:
    """The routes ``generate``'s forwards recorded, ``columns`` [b, prompt width + steps,
    moe_layers, top_k] (left-padded prompts, then one column per decode step), laid out as
    ``rollout_rows`` lays out the tokens: [b, width, moe_layers, top_k] in ``ROUTE_DTYPE``.
    Each fed token keeps the experts that routed it when it was fed; padding gets experts
    0..top_k-1 (any valid route: it is never trained on)."""
    b, _, n_layers, k = columns.shape
    prompt_width = max(p.numel() for p in prompts)
    fill = torch.arange(k, dtype=ROUTE_DTYPE, device=columns.device)
    routes = fill.expand(b, width, n_layers, k).clone()
    for i, (prompt, n) in enumerate(zip(prompts, lengths.tolist(), strict=True)):
        fed = prompt.numel() + n - 1  # the last new token is only a label
        start = prompt_width - prompt.numel()
        routes[i, :fed] = columns[i, start : start + fed].to(ROUTE_DTYPE)
    return routes
