"""The training loop of ``./run_train.sh``: one loop on the Engine, adding data, the objective,
rollouts, metrics and the checkpoint cadence."""

from __future__ import annotations

import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import torch

from temper.checkpoint.manager import DiskFull
from temper.config import Config, save_config
from temper.data.batch import Batch, real_shares
from temper.data.loader import build_loader
from temper.engine import Engine, NonFiniteError
from temper.objectives import Objective, RolloutObjective, build_objective
from temper.objectives.driver import RolloutDriver
from temper.parallel.collectives import all_reduce_sum, combine_metrics, sum_over_data_ranks
from temper.trainer.console import (
    RunCounts,
    StopRequest,
    complete_line,
    resolve_model_fields,
    resumed_line,
    startup_line,
    stopped_line,
    summary_line,
)
from temper.trainer.initial import export_hf, train_initial_checkpoint
from temper.trainer.loggers import open_loggers
from temper.trainer.metrics import MetricsLogger, Throughput, peak_memory_gib
from temper.trainer.moe_load import MoELoad, write_load
from temper.trainer.nonfinite import skip_nonfinite
from temper.trainer.phases import PhaseTimer
from temper.trainer.profiling import StepProfiler
from temper.trainer.run_lock import hold_run_folder
from temper.trainer.state import TrainState
from temper.trainer.validation import build_validation
from temper.utils.device import Runtime, init_runtime
from temper.utils.peak_flops import peak_flops

StepMetrics = dict[str, torch.Tensor]


class Trainer:
    """Trains ``config`` to ``training.steps``, resuming from its newest checkpoint."""

    def __init__(self, config: Config, runtime: Runtime | None = None) -> None:
        runtime = runtime or init_runtime()
        config.validate(runtime.world_size)  # a bad layout leaves no run folder behind
        self.run_lock = hold_run_folder(config.job.dump_folder, runtime)
        self.stop = StopRequest()
        """What stopped ``train`` early: its signal, cause and exit code."""
        if config.checkpoint.initial_load is None and config.checkpoint.initial_recipe:
            config.checkpoint.initial_load = train_initial_checkpoint(
                config, lambda first: Trainer(first, runtime).train(), runtime.is_main
            )
        self.config = config
        if config.model.hf_path is not None and runtime.is_main:
            print(f"temper: building the model, weights from {config.model.hf_path}", flush=True)
        self.engine = engine = Engine(config, runtime)
        self.objective: Objective = build_objective(config, engine.build_reference)
        self.grad_accum = engine.dims.grad_accum_steps(config.training)
        copies = runtime.world_size // engine.dims.dp  # ranks holding each data rank's lanes
        self.sum_counts = partial(sum_over_data_ranks, copies=copies, device=engine.device)
        self.counts = RunCounts()
        self.loader = build_loader(
            config, engine.tokenizer, engine.dims.dp_rank, engine.dims.dp, self.sum_counts
        )
        self.driver = None
        if isinstance(self.objective, RolloutObjective):
            data_rank = (engine.dims.dp_rank, engine.dims.dp)
            self.driver = RolloutDriver(self.objective, engine, config, self.grad_accum, data_rank)
        self.state = self._train_state()
        sampler = self.driver.sampler if self.driver is not None else None
        self.validation = build_validation(config, engine, self.objective, self.grad_accum, sampler)
        engine.load(self.state)  # a resumed run's step, data position and rollout
        self.start_step = self.state.step
        self.metrics = MetricsLogger(
            config.job.dump_folder,
            tensorboard=config.metrics.tensorboard,
            enabled=runtime.is_main,
            resume_step=self.state.step,
            total_steps=config.training.steps,
            loggers=open_loggers(config) if runtime.is_main else (),
        )
        self.throughput = Throughput(
            flops_per_token=engine.model.flops_per_token,
            peak_flops=peak_flops(engine.device, engine.dtype),
            total_steps=config.training.steps,
        )
        self.phases = PhaseTimer(engine.device, enabled=config.profiling.phase_times)
        self.profiler = StepProfiler(
            config.profiling, config.job.dump_folder, runtime.rank, engine.device
        )
        self.moe_load = MoELoad(engine.model)

    def _train_state(self) -> TrainState:
        objective, config, device = self.objective, self.config, self.engine.device
        if self.driver is None:
            return TrainState(self.loader, self.counts, self.sum_counts)
        assert isinstance(objective, RolloutObjective)

        def template() -> list[Batch]:
            prompts, width = config.training.local_batch_size, config.training.seq_len
            model = self.engine.model
            empty = [objective.empty_rollout(model, prompts, width) for _ in range(self.grad_accum)]
            return [{k: v.to(device) for k, v in batch.items()} for batch in empty]

        return TrainState(
            self.loader,
            self.counts,
            self.sum_counts,
            updates_per_rollout=objective.updates_per_rollout,
            rollout_template=template,
            rollout_width=config.training.seq_len,
        )

    def train(self) -> bool:
        """Run until `training.steps`; metrics every `metrics.log_freq` steps. Returns False
        when Ctrl-C (or SIGTERM) stopped it at a step boundary."""
        config, engine, state = self.config, self.engine, self.state
        root, saving = engine.checkpointer.root, config.checkpoint.enable
        if state.step >= config.training.steps:
            self.run_lock.release()
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
            with self.stop as stop:
                while state.step < config.training.steps:
                    with self.profiler.step(state.step + 1):
                        with self.phases("data"):
                            micro_batches, rollout_metrics = self._next_batches(batches)
                        metrics = self.train_step(micro_batches) | rollout_metrics
                        if self.driver is not None:
                            self.driver.after_update()
                        last = state.step == config.training.steps
                        if self.validation is not None and self.validation.due(state.step, last):
                            metrics |= self.validation.run()
                        self._save_and_log(metrics, last)
                    if not last and stop.agreed(engine.device):
                        self._save_on_stop()
                        engine.checkpointer.wait()
                        self._say(stopped_line(state.step, root, saving, stop.cause))
                        return False
        finally:
            if self.driver is not None:
                self.driver.close()
            self.metrics.close()
            self.run_lock.release()
        loss = float(metrics["loss"]) if "loss" in metrics else None
        steps, seconds = state.step - self.start_step, time.perf_counter() - started
        counts = {k.removeprefix("data_"): int(v) for k, v in metrics.items() if k[:5] == "data_"}
        self._say(summary_line(steps, seconds, counts, loss, root, saving))
        return True

    def _save_and_log(self, metrics: StepMetrics, last: bool) -> None:
        state = self.state
        if self._checkpoint_due(last):
            metadata = {"tokens_seen": state.tokens_seen}
            export = self.config.checkpoint.hf_export
            export = export == "every" or (export == "final" and last)
            with self.phases("checkpoint"):
                try:
                    self.engine.save(state.step, state, metadata=metadata, wait=last or export)
                except DiskFull:
                    self._log(metrics)  # the step trained: its record outlives the save
                    raise
                if export and self.engine.runtime.is_main:
                    self._say(f"temper: exported {export_hf(self.config, state.step)}")
        self.phases.step_done()
        due = last or state.step % self.config.metrics.log_freq == 0
        if due or "skipped" in metrics or any(name.startswith("val_") for name in metrics):
            self._log(metrics)

    def _save_on_stop(self) -> None:
        """A stop keeps the step reached (``checkpoint.save_on_stop``), unless it was just
        saved."""
        checkpoint, state = self.config.checkpoint, self.state
        if checkpoint.enable and checkpoint.save_on_stop and not self._checkpoint_due(False):
            self._say(f"temper: saving step {state.step} before stopping (Ctrl-C again: exit now)")
            metadata = {"tokens_seen": state.tokens_seen}
            self.engine.save(state.step, state, metadata=metadata, wait=True)

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
        for micro_batch in micro_batches:
            self.counts.add(micro_batch)
        # The real (non-padding) share of each sequence, read before the batch moves.
        shares = [real_shares(mb) for mb in micro_batches]
        micro_batches = [engine.prepare_batch(mb) for mb in micro_batches]
        local = sum(self.objective.count(mb) for mb in micro_batches)
        global_count = all_reduce_sum(torch.as_tensor(local, device=engine.device))
        loss_sum = torch.zeros((), device=engine.device)
        parts = []
        for batch in micro_batches:
            with self.phases("forward"), engine.autocast():
                micro_loss, _, micro_metrics = self.objective.loss(engine.model, batch)
            self.moe_load.add()
            with self.phases("backward"):
                (micro_loss / global_count).backward()
            loss_sum += micro_loss.detach().float()
            parts.append(micro_metrics)
        # The objective's metrics of the whole step: every micro-batch on every rank.
        metrics = combine_metrics(parts, engine.device) if parts[0] else {}
        loss = all_reduce_sum(loss_sum) / global_count
        self.state.step += 1
        self.state.tokens_seen += int(global_count)
        try:
            with self.phases("optimizer"):
                metrics |= engine.step(loss)
        except NonFiniteError as error:
            lr = engine.optimizer.param_groups[0]["lr"]  # the lr the step would have had
            budget = self.config.training.skip_nonfinite
            skipped, line = skip_nonfinite(error, self.state.step, self.state.skipped, budget, lr)
            metrics |= skipped
            self._say(line)
        # Every sequence the model ran: a DPO pair's chosen and rejected rows both count.
        for micro_batch, share in zip(micro_batches, shares, strict=True):
            for key, ids in micro_batch.items():
                if key.endswith("input_ids"):
                    self.throughput.add_rows(ids.shape[0], ids.shape[-1], share.get(key, 1.0))
        counts = self.counts.totals(self.sum_counts(self.loader.dataset.stats | self.counts.local))
        for line in self.counts.notices(self.state.step, counts, self.config):
            self._say(line)
        stats = {f"data_{name}": torch.tensor(float(v)) for name, v in counts.items()}
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
        if self.driver is not None:
            values.update(self.driver.clock.measure(self.driver.asynchronous))
        values.update(self.phases.summary())
        values["memory_gib"] = max(peak_memory_gib(self.engine.device), self.phases.run_peak_gib)
        if self.moe_load:
            moe, counts = self.moe_load.summary()
            values.update(moe)
            freq = self.config.profiling.moe_heatmap_freq
            if freq and state.step % freq == 0 and counts is not None and self.metrics.enabled:
                # The layer x expert map of the tokens routed since the last log step.
                folder = Path(self.config.job.dump_folder) / "moe"
                image = write_load(folder, state.step, self.moe_load.layer_ids(), counts)
                self.metrics.log_image("moe/load", image, state.step)
        self.metrics.log(state.step, values)

    def _next_batches(self, batches: Iterator[Batch]) -> tuple[list[Batch], StepMetrics]:
        """The next step's micro-batches; an RL objective's driver makes them from prompts
        (``temper.objectives.driver``), with its rollout's metrics."""
        if self.driver is None:
            return [next(batches) for _ in range(self.grad_accum)], {}
        with self.phases("rollout"):
            return self.driver.next_batches(batches, self.state)
