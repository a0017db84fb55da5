"""The RL objective's driver: what turns prompt micro-batches into the step's training
batches, so a training loop (the Trainer, or a user's) stays one loop.

Each ``updates_per_rollout`` steps it samples a rollout per micro-batch with the rollout
engine (``--rollout.engine``), scores it with the trainer's forward, and after each update
hands the engine the new weights (``Engine.hf_state_dict``; the native engine samples with
the trained weights themselves and takes nothing). The sampler of micro-batch ``j`` on
data rank ``r`` is seeded by (seed, step, ``j * dp + r``): the position of its rows in the
step's global batch, so one process accumulating one-row micro-batches draws what the
data-parallel ranks draw.

Asynchronous rollouts (``--rollout.mode async``, vLLM only): with staleness 1, step k+1's
completions are sampled on a thread while step k trains, by the weights before step k's
update; the weights after it are pushed once that sampling ended. The trainer still scores
each rollout with its current weights (the ``old`` log-probabilities the clip is taken
against) and corrects for the policy that sampled through the sampler's log-probabilities
(``objective.tis_cap`` / ``mask_band``). With staleness 0 the same code samples each rollout
right before it is trained: synchronous training, drawn alike.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from temper.config import Config
from temper.data.batch import Batch
from temper.generation.engines import NativeEngine, RolloutEngine
from temper.generation.engines.vllm import VLLMSettings, start_vllm
from temper.objectives.dynamic_sampling import DynamicSampling, fill_rollout
from temper.objectives.registry import FinishesRollout, RolloutObjective
from temper.parallel.collectives import all_reduce_sum, combine_metrics

StepRollout = tuple[list[Batch], dict[str, torch.Tensor]]
"""A step's rollout micro-batches and their metrics (over all ranks)."""


class PolicyEngine(Protocol):
    """What the driver uses of ``temper.engine.Engine``."""

    model: nn.Module
    device: torch.device

    def autocast(self) -> contextlib.AbstractContextManager[None]: ...
    def offload_optimizer(self) -> None: ...
    def restore_optimizer(self) -> None: ...
    def hf_state_dict(self) -> Iterator[tuple[str, torch.Tensor]]: ...


class RolloutState(Protocol):
    """The loop's state the driver reads and keeps its rollout in (checkpointed)."""

    step: int
    rollout: StepRollout | None


class RolloutDriver:
    """Rollouts of one RL objective for a loop on ``engine`` (see the module docstring)."""

    def __init__(
        self,
        objective: RolloutObjective,
        engine: PolicyEngine,
        config: Config,
        grad_accum: int,
        data_rank: tuple[int, int],
        rollout_engine: RolloutEngine | None = None,
    ) -> None:
        self.objective, self.engine, self.config = objective, engine, config
        self.grad_accum = grad_accum
        self.dp_rank, self.dp = data_rank
        self.sampler = rollout_engine or build_rollout_engine(config, engine)
        self.native = isinstance(self.sampler, NativeEngine)
        self.asynchronous = config.rollout.mode == "async"
        self.staleness = config.rollout.staleness if self.asynchronous else 0
        self._pool = ThreadPoolExecutor(1) if self.asynchronous else None
        self._pending: tuple[int, list[Batch], Future[list]] | None = None
        self.clock = RolloutClock(engine.device)

    def next_batches(self, batches: Iterator[Batch], state: RolloutState) -> StepRollout:
        """The step's training micro-batches and their rollout's metrics."""
        updates = self.objective.updates_per_rollout
        if state.rollout is None or state.step % updates == 0:
            state.rollout = self._rollout(batches, state.step)
        return state.rollout

    def after_update(self) -> None:
        """Hand the sampler the weights of the update just taken (every rank calls this)."""
        if self.native:
            return
        if self._pending is not None:  # the next rollout samples with the weights it began on
            started = time.perf_counter()
            self._pending[2].result()
            self.clock.add("wait", time.perf_counter() - started)
        started = time.perf_counter()
        self.sampler.update_weights(self.engine.hf_state_dict)
        self.clock.add("weight_push", time.perf_counter() - started)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
        self.sampler.close()

    def _rollout(self, batches: Iterator[Batch], step: int) -> StepRollout:
        offload = self.config.optimizer.offload_during_rollout
        if offload:
            self.engine.offload_optimizer()
        try:  # in the loss's precision, so the first update's ratio is exactly 1
            with self.engine.autocast():
                if self.asynchronous:
                    results = self._async_rollout(batches, step)
                else:
                    started = time.perf_counter()
                    results = [
                        self._prepare(mb, batches, j * self.dp + self.dp_rank, step)
                        for j, mb in enumerate(self._prompts(batches))
                    ]
                    self.clock.add("generation", time.perf_counter() - started)
        finally:
            if offload:
                self.engine.restore_optimizer()
        metrics = combine_metrics([m for _, m in results], self.engine.device)
        batches = [batch for batch, _ in results]
        if isinstance(self.objective, FinishesRollout):
            self.objective.finish_rollout(batches, self._sum_over_data)
        return batches, metrics

    def _sum_over_data(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over the data-parallel ranks (the world's sum over the ranks that
        hold each data rank's rollout alike: its sequence-parallel peers)."""
        copies = dist.get_world_size() // self.dp if dist.is_initialized() else 1
        return all_reduce_sum(value) / copies

    def _async_rollout(
        self, batches: Iterator[Batch], step: int
    ) -> list[tuple[Batch, dict[str, float]]]:
        """This step's rollout, sampled on the thread since the last step (or now: on the
        first step, and always with staleness 0), and with staleness 1 the next step's
        sampling started before scoring this one."""
        if self._pending is None or self._pending[0] != step:
            self._pending = self._submit(batches, step)
        _, prompts, sampled = self._pending
        started = time.perf_counter()
        drawn = sampled.result()
        self.clock.add("wait", time.perf_counter() - started)
        self._pending = self._submit(batches, step + 1) if self.staleness else None
        model = self.engine.model
        return [self.objective.score(model, p, s) for p, s in zip(prompts, drawn, strict=True)]

    def _submit(self, batches: Iterator[Batch], step: int) -> tuple[int, list[Batch], Future]:
        prompts = self._prompts(batches)
        generators = [
            self._generator(step, j * self.dp + self.dp_rank) for j in range(len(prompts))
        ]
        model, objective, clock = self.engine.model, self.objective, self.clock

        def sample() -> list:
            started = time.perf_counter()
            drawn = [
                objective.sample(model, p, g, self.sampler)
                for p, g in zip(prompts, generators, strict=True)
            ]
            clock.add("generation", time.perf_counter() - started)
            return drawn

        assert self._pool is not None
        return step, prompts, self._pool.submit(sample)

    def _prepare(
        self, prompts: Batch, batches: Iterator[Batch], index: int, step: int
    ) -> tuple[Batch, dict[str, float]]:
        """One micro-batch's rollout; with dynamic sampling, refilled from further prompt
        micro-batches (see ``temper.objectives.dynamic_sampling``)."""
        objective, model, engine = self.objective, self.engine.model, self._engine_arg()
        settings = objective.settings if isinstance(objective, DynamicSampling) else None
        if settings is None or settings.sampling_draws == 1:
            return objective.prepare(model, prompts, self._generator(step, index), engine)
        return fill_rollout(
            lambda mb, generator: objective.prepare(model, mb, generator, engine),
            prompts,
            lambda: self._whole_prompts(batches),
            lambda draw: self._generator(step, index, draw),
            settings.group_size,
            settings.sampling_draws,
        )

    def _engine_arg(self) -> RolloutEngine | None:
        """None for the native engine: the objective then decodes inside its one gathered
        region, as it always did."""
        return None if self.native else self.sampler

    def _prompts(self, batches: Iterator[Batch]) -> list[Batch]:
        return [self._whole_prompts(batches) for _ in range(self.grad_accum)]

    def _whole_prompts(self, batches: Iterator[Batch]) -> Batch:
        """The next micro-batch of prompts on the device, whole on every SP rank: a rollout
        decodes whole sequences."""
        return {k: v.to(self.engine.device) for k, v in next(batches).items()}

    def _generator(self, step: int, index: int, draw: int = 0) -> torch.Generator:
        """Micro-batch ``index``'s sampler; a dynamic-sampling refill ``draw`` > 0 gets its own."""
        key = f"{self.config.training.seed}:{step}:{index}" + (f":{draw}" if draw else "")
        seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:7], "little")
        return torch.Generator(self.engine.device).manual_seed(seed)


def build_rollout_engine(config: Config, engine: PolicyEngine) -> RolloutEngine:
    """``--rollout.engine``'s sampler for the policy ``engine`` trains."""
    rollout, model = config.rollout, engine.model
    if rollout.engine == "native":
        return NativeEngine(model)
    run = Path(config.job.dump_folder).resolve()
    tag = hashlib.sha256(str(run).encode()).hexdigest()[:12]
    settings = VLLMSettings(
        url=rollout.url,
        python=rollout.vllm_python,
        weights_dir=Path(rollout.weights_dir) / f"temper-weights-{tag}",
        bucket_bytes=rollout.bucket_mib * 2**20,
        max_model_len=config.training.seq_len + 1,
        kv_cache_bytes=int(rollout.kv_cache_gib * 2**30),
        startup_timeout_s=rollout.startup_timeout_s,
        log=run / "vllm.log",
        extra_args=rollout.vllm_args,
    )
    return start_vllm(settings, model, engine.hf_state_dict)


class RolloutClock:
    """Where the wall time since the last log went: ``generation`` (sampling, on the thread
    in async mode), ``weight_push``, ``wait`` (the loop blocked on sampling), the rest
    training. ``overlap_seconds`` is the sampling time the loop did not wait for."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._mark = time.perf_counter()
        self._spent: dict[str, float] = {}

    def add(self, part: str, seconds: float) -> None:
        self._spent[part] = self._spent.get(part, 0.0) + seconds

    def measure(self, asynchronous: bool) -> dict[str, float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        window, spent = max(now - self._mark, 1e-9), self._spent
        self._mark, self._spent = now, {}
        generation, push = spent.get("generation", 0.0), spent.get("weight_push", 0.0)
        blocked = spent.get("wait", 0.0) if asynchronous else generation
        return {
            "rollout_seconds": generation,
            "weight_push_seconds": push,
            "train_seconds": window - blocked - push,
            "overlap_seconds": max(generation - blocked, 0.0),
            "rollout_time_share": blocked / window,
        }
