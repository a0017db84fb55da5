"""The training loop of ``./run_train.sh``: one loop on the Engine, adding data, the objective,
rollouts, metrics and the checkpoint cadence."""

from __future__ import annotations

import hashlib
import shlex
import shutil
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import torch

from temper.checkpoint.convert import dcp_to_hf
from temper.checkpoint.manager import checkpoint_dir
from temper.config import Config, load_config, save_config
from temper.data.batch import Batch
from temper.data.loader import build_loader
from temper.engine import Engine, NonFiniteError
from temper.objectives import Objective, RolloutObjective, build_objective
from temper.parallel.collectives import all_reduce_sum, combine_metrics, sum_over_data_ranks
from temper.trainer.console import (
    StopRequest,
    complete_line,
    resolve_model_fields,
    resumed_line,
    startup_line,
    stopped_line,
    summary_line,
)
from temper.trainer.metrics import MetricsLogger, Throughput, peak_memory_gib
from temper.trainer.state import TrainState
from temper.trainer.validation import build_validation
from temper.utils.device import Runtime, init_runtime
from temper.utils.peak_flops import peak_flops

StepMetrics = dict[str, torch.Tensor]


class Trainer:
    """Trains ``config`` to ``training.steps``, resuming from its newest checkpoint."""

    def __init__(self, config: Config, runtime: Runtime | None = None) -> None:
        runtime = runtime or init_runtime()
        if config.checkpoint.initial_load is None and config.checkpoint.initial_recipe:
            config.validate(runtime.world_size)
            config.checkpoint.initial_load = train_initial_checkpoint(config, runtime)
        self.config = config
        self.engine = engine = Engine(config, runtime)
        self.objective: Objective = build_objective(config, engine.build_reference)
        self.grad_accum = engine.dims.grad_accum_steps(config.training)
        copies = runtime.world_size // engine.dims.dp  # ranks holding each data rank's lanes
        sum_counts = partial(sum_over_data_ranks, copies=copies, device=engine.device)
        self.loader = build_loader(
            config, engine.tokenizer, engine.dims.dp_rank, engine.dims.dp, sum_counts
        )
        self.state = TrainState(self.loader)
        self.validation = build_validation(config, engine, self.objective, self.grad_accum)
        self.state.step = engine.load(self.state) or 0
        self.start_step = self.state.step
        self.metrics = MetricsLogger(
            config.job.dump_folder,
            tensorboard=config.metrics.tensorboard,
            enabled=runtime.is_main,
            resume_step=self.state.step,
            total_steps=config.training.steps,
        )
        self.throughput = Throughput(
            flops_per_token=engine.model.flops_per_token(config.training.seq_len),
            peak_flops=peak_flops(engine.device, engine.dtype),
            total_steps=config.training.steps,
        )

    def train(self) -> bool:
        """Run until `training.steps`; metrics every `metrics.log_freq` steps. Returns False
        when Ctrl-C (or SIGTERM) stopped it at a step boundary."""
        config, engine, state = self.config, self.engine, self.state
        root, saving = engine.checkpointer.root, config.checkpoint.enable
        if state.step >= config.training.steps:
            self._say(complete_line(state.step, root))
            return True
        if engine.runtime.is_main:
            resolve_model_fields(config, engine.model)
            save_config(config, config.job.dump_folder)
        world = engine.runtime.world_size
        self._say(
            startup_line(config, engine.model, engine.device, engine.dtype, world, self.grad_accum)
        )
        if self.start_step:
            self._say(resumed_line(self.start_step, config.training.steps, root))
        batches = iter(self.loader)
        engine.model.train()
        started, metrics = time.perf_counter(), {}
        try:
            with StopRequest() as stop:
                while state.step < config.training.steps:
                    micro_batches, rollout_metrics = self._next_batches(batches)
                    metrics = self.train_step(micro_batches) | rollout_metrics
                    last = state.step == config.training.steps
                    if self.validation is not None and self.validation.due(state.step, last):
                        metrics |= self.validation.run()
                    self._save_and_log(metrics, last)
                    if not last and stop.agreed(engine.device):
                        engine.checkpointer.wait()
                        self._say(stopped_line(state.step, root, saving))
                        return False
        finally:
            self.metrics.close()
        loss = float(metrics["loss"]) if "loss" in metrics else None
        steps, seconds = state.step - self.start_step, time.perf_counter() - started
        self._say(summary_line(steps, seconds, state.tokens_seen, loss, root, saving))
        return True

    def _save_and_log(self, metrics: StepMetrics, last: bool) -> None:
        state = self.state
        if self._checkpoint_due(last):
            metadata = {"tokens_seen": state.tokens_seen}
            export = self.config.checkpoint.hf_export
            export = export == "every" or (export == "final" and last)
            self.engine.save(state.step, state, metadata=metadata, wait=last or export)
            if export and self.engine.runtime.is_main:
                self._say(f"temper: exported {export_hf(self.config, state.step)}")
        validated = any(name.startswith("val_") for name in metrics)
        if state.step % self.config.metrics.log_freq == 0 or last or validated:
            self._log(metrics)

    def _say(self, line: str) -> None:
        if self.engine.runtime.is_main:
            print(line, flush=True)

    def train_step(self, micro_batches: list[Batch]) -> StepMetrics:
        """One optimizer step over accumulated micro-batches (on any device; with sequence
        parallelism each rank takes its slice here); returns its metrics, on the device.

        Each micro-batch's summed loss is divided by the count of the whole step across
        ranks, so the gradients equal those of one big batch.
        """
        engine = self.engine
        engine.check_can_step()
        micro_batches = [engine.prepare_batch(mb) for mb in micro_batches]
        local = sum(self.objective.count(mb) for mb in micro_batches)
        global_count = all_reduce_sum(torch.as_tensor(local, device=engine.device))
        loss_sum = torch.zeros((), device=engine.device)
        parts = []
        for batch in micro_batches:
            with engine.autocast():
                micro_loss, _, micro_metrics = self.objective.loss(engine.model, batch)
            (micro_loss / global_count).backward()
            loss_sum += micro_loss.detach().float()
            parts.append(micro_metrics)
        # The objective's metrics of the whole step: every micro-batch on every rank.
        metrics = combine_metrics(parts, engine.device) if parts[0] else {}
        loss = all_reduce_sum(loss_sum) / global_count
        self.state.step += 1
        self.state.tokens_seen += int(global_count)
        try:
            metrics |= engine.step(loss)
        except NonFiniteError as error:
            raise NonFiniteError(f"step {self.state.step}: {error}") from None
        # Every sequence the model ran: a DPO pair's chosen and rejected rows both count.
        self.throughput.add_tokens(
            sum(v.numel() for mb in micro_batches for k, v in mb.items() if k.endswith("input_ids"))
        )
        stats = {f"data_{name}": torch.tensor(float(v)) for name, v in self.loader.stats.items()}
        return {"loss": loss, **metrics, **stats}

    def offload_optimizer(self) -> None:
        """See ``Engine.offload_optimizer``."""
        self.engine.offload_optimizer()

    def restore_optimizer(self) -> None:
        """See ``Engine.restore_optimizer``."""
        self.engine.restore_optimizer()

    def _checkpoint_due(self, last: bool) -> bool:
        checkpoint = self.config.checkpoint
        return checkpoint.enable and (last or self.state.step % checkpoint.interval == 0)

    def _log(self, metrics: StepMetrics) -> None:
        """The one host sync of a log step: every metric to a float."""
        state = self.state
        values = {name: float(value) for name, value in metrics.items()}
        values.update(self.throughput.measure(state.step, self.start_step + 1))
        values["memory_gib"] = peak_memory_gib(self.engine.device)
        self.metrics.log(state.step, values)

    def _next_batches(self, batches: Iterator[Batch]) -> tuple[list[Batch], StepMetrics]:
        """The next step's micro-batches, and the metrics of their rollout (over all ranks)
        if any.

        A ``RolloutObjective`` turns each micro-batch of prompts into a rollout every
        ``updates_per_rollout`` steps and trains on that rollout until the next one. The
        sampler of micro-batch ``j`` on data rank ``r`` is seeded by (seed, step,
        ``r * grad_accum + j``), so one process accumulating micro-batches draws what the
        data-parallel ranks draw.
        """
        objective, state, engine = self.objective, self.state, self.engine
        if not isinstance(objective, RolloutObjective):
            return [next(batches) for _ in range(self.grad_accum)], {}
        if state.rollout is None or state.step % objective.updates_per_rollout == 0:
            prompts = [engine.prepare_batch(next(batches)) for _ in range(self.grad_accum)]
            first = engine.dims.dp_rank * self.grad_accum
            offload = self.config.optimizer.offload_during_rollout
            if offload:
                engine.offload_optimizer()
            try:
                results = [
                    objective.prepare(engine.model, mb, self._sampler(first + j))
                    for j, mb in enumerate(prompts)
                ]
            finally:
                if offload:
                    engine.restore_optimizer()
            metrics = combine_metrics([m for _, m in results], engine.device)
            state.rollout = [batch for batch, _ in results], metrics
        return state.rollout

    def _sampler(self, index: int) -> torch.Generator:
        key = f"{self.config.training.seed}:{self.state.step}:{index}".encode()
        seed = int.from_bytes(hashlib.sha256(key).digest()[:7], "little")
        return torch.Generator(self.engine.device).manual_seed(seed)


def export_hf(config: Config, step: int) -> Path:
    """``dcp-to-hf`` of checkpoint ``step`` into ``<job.dump_folder>/hf/step-<step>``."""
    output = Path(config.job.dump_folder) / "hf" / f"step-{step}"
    root = Path(config.job.dump_folder) / config.checkpoint.folder
    if output.exists():  # a step trained again after a resume: its new weights replace it
        shutil.rmtree(output)
    dcp_to_hf(checkpoint_dir(root, step), output)
    return output


def train_initial_checkpoint(config: Config, runtime: Runtime) -> str:
    """Train `checkpoint.initial_recipe` (``module:function``, then any overrides) into
    ``<dump_folder>/initial`` and return its final checkpoint, the run's starting weights. A
    finished earlier run is reused, so a restarted run does not train it again."""
    recipe, *overrides = shlex.split(config.checkpoint.initial_recipe)
    module, _, function = recipe.partition(":")
    first = load_config(module, function, overrides)
    first.job.dump_folder = str(Path(config.job.dump_folder) / "initial")
    first.checkpoint.enable = True
    first.metrics.tensorboard = config.metrics.tensorboard
    final = checkpoint_dir(
        Path(first.job.dump_folder) / first.checkpoint.folder, first.training.steps
    )
    if not final.is_dir():
        if runtime.is_main:
            print(
                f"temper: no checkpoint.initial_load; training {module}:{function} first",
                flush=True,
            )
        Trainer(first, runtime).train()
    return str(final)
