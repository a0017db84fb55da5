"""The one training loop: build everything from a Config, then step until done."""

from __future__ import annotations

import contextlib
import hashlib
import math
import shlex
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from temper.checkpoint.manager import checkpoint_dir
from temper.config import Config, ConfigError, load_config, save_config
from temper.data import BatchLoader, Tokenizer, build_text_loader, load_tokenizer
from temper.data.tasks import build_chat_loader
from temper.kernels.dispatch import configure_kernels
from temper.models import build_hf_model, build_model, materialize
from temper.models.lora import apply_lora, init_lora
from temper.objectives import Objective, build_objective
from temper.objectives.causal_lm import Batch
from temper.optim import OptimizerOffload, build_lr_scheduler, build_optimizer
from temper.parallel.collectives import all_reduce_sum, combine_metrics
from temper.parallel.dims import ParallelDims
from temper.parallel.grad_norm import clip_grad_norm_
from temper.parallel.parallelize import parallelize_decoder
from temper.parallel.sharded_init import layout_invariant_init
from temper.trainer.checkpointing import TrainCheckpointer, load_model_weights
from temper.trainer.metrics import MetricsLogger, Throughput, peak_memory_gib
from temper.utils.device import Runtime, init_runtime, resolve_dtype, seed_everything
from temper.utils.peak_flops import peak_flops


class NonFiniteError(RuntimeError):
    """The loss or gradient norm became inf/nan; the step was not applied."""


class Trainer:
    """Owns the model, optimizer, data and metrics of one run."""

    def __init__(self, config: Config, runtime: Runtime | None = None) -> None:
        self.config = config
        self.runtime = runtime or init_runtime()
        config.validate(self.runtime.world_size)
        if config.checkpoint.initial_load is None and config.checkpoint.initial_recipe:
            config.checkpoint.initial_load = train_initial_checkpoint(config, self.runtime)
        self.dims = ParallelDims.from_config(config.parallelism, self.runtime.world_size)
        self.device = self.runtime.device
        self.dtype = resolve_dtype(config.training.dtype, self.device)
        seed_everything(config.training.seed, config.training.deterministic)
        configure_kernels(config.kernels, self.device)

        self.tokenizer = load_tokenizer(config.data.tokenizer_path or config.model.hf_path)
        model = build_meta_model(config)
        _check_vocab(self.tokenizer, model.tok_embeddings.num_embeddings, config)
        if config.lora.enable:
            lora = config.lora
            apply_lora(
                model,
                lora.target_modules,
                rank=lora.rank,
                alpha=lora.alpha,
                dropout=lora.dropout,
                rslora=lora.rslora,
            )
        self.checkpointer = TrainCheckpointer(config)
        self.checkpointer.check(model)
        self.meshes = self.dims.build_meshes(self.device.type) if self.dims.sharded else None
        self.sequence_parallel = parallelize_decoder(model, config, self.meshes, self.dtype)
        with layout_invariant_init():
            self.model = materialize(model, self.device, config.model.hf_path)
            init_lora(self.model)
        self.model.attn_backend = config.model.attn
        self.objective: Objective = build_objective(config, self._build_reference)
        self.optimizer = build_optimizer(self.model, config.optimizer)
        self._offload = OptimizerOffload(self.optimizer)
        self.lr_scheduler = build_lr_scheduler(
            self.optimizer, config.lr_scheduler, config.training.steps
        )

        self.grad_accum = config.grad_accum_steps(self.runtime.world_size)
        self.loader: BatchLoader = build_loader(
            config, self.tokenizer, self.dims.data_rank(self.runtime.rank), self.dims.dp
        )
        self.step = 0
        self.tokens_seen = 0
        self._rollout: tuple[list[Batch], dict[str, float]] | None = None
        self.checkpointer.restore(self)
        self.start_step = self.step
        self.metrics = MetricsLogger(
            config.job.dump_folder,
            tensorboard=config.metrics.tensorboard,
            enabled=self.runtime.is_main,
            resume_step=self.step,
        )
        self.throughput = Throughput(
            flops_per_token=self.model.flops_per_token(config.training.seq_len),
            peak_flops=peak_flops(self.device, self.dtype),
            total_steps=config.training.steps,
        )

    def train(self) -> None:
        """Run until `training.steps`; metrics every `metrics.log_freq` steps."""
        config = self.config
        if self.runtime.is_main:
            save_config(config, config.job.dump_folder)
            n_params = sum(p.numel() for p in self.model.parameters())
            print(
                f"temper: {config.model.name}/{config.model.flavor} ({n_params / 1e6:.1f}M "
                f"params) on {self.device} ({self.dtype}), world {self.runtime.world_size}, "
                f"grad accumulation {self.grad_accum}, {config.training.steps} steps, "
                f"run folder {config.job.dump_folder}",
                flush=True,
            )
        batches = iter(self.loader)
        self.model.train()
        try:
            while self.step < config.training.steps:
                micro_batches, rollout_metrics = self._next_batches(batches)
                metrics = self.train_step(micro_batches) | rollout_metrics
                last = self.step == config.training.steps
                self.checkpointer.maybe_save(self, last=last)
                if self.step % config.metrics.log_freq == 0 or last:
                    metrics.update(self.throughput.measure(self.step, self.start_step + 1))
                    metrics["memory_gib"] = peak_memory_gib(self.device)
                    self.metrics.log(self.step, metrics)
        finally:
            self.metrics.close()

    def train_step(self, micro_batches: list[Batch]) -> dict[str, float]:
        """One optimizer step over accumulated micro-batches; returns its metrics.

        Each micro-batch's summed loss is divided by the valid-token count of the
        whole step across ranks, so the gradients equal those of one big batch. With sequence
        parallelism each rank first takes its slice of every micro-batch, and counts only it.
        """
        self._offload.check("step")
        if self.sequence_parallel is not None:
            micro_batches = [self.sequence_parallel.shard(mb) for mb in micro_batches]
        local_tokens = sum(self.objective.count(mb) for mb in micro_batches)
        global_tokens = all_reduce_sum(torch.as_tensor(local_tokens, device=self.device))
        loss_sum = torch.zeros((), device=self.device)
        parts: list[dict[str, float]] = []
        for batch in micro_batches:
            with self._autocast():
                micro_loss, _, micro_metrics = self.objective.loss(self.model, batch)
            (micro_loss / global_tokens).backward()
            loss_sum += micro_loss.detach().float()
            parts.append(micro_metrics)
        # The objective's metrics of the whole step: every micro-batch on every rank.
        extra = combine_metrics(parts, self.device) if parts[0] else {}
        max_norm = self.config.training.max_norm or math.inf
        grad_norm = clip_grad_norm_(self.model.parameters(), max_norm)
        loss = all_reduce_sum(loss_sum) / global_tokens

        self.step += 1
        self.tokens_seen += int(global_tokens)
        if not (torch.isfinite(loss) and torch.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteError(
                f"step {self.step}: loss {loss.item()} / grad norm {grad_norm.item()} is not "
                "finite; the update was skipped. Lower optimizer.lr or check the data."
            )
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        if hasattr(self.model, "update_expert_bias"):
            # Counts summed over every rank: all of them route tokens of the global batch.
            self.model.update_expert_bias(self.model.args.expert_bias_update_rate)
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        # Every sequence the model ran: a DPO pair's chosen and rejected rows both count.
        self.throughput.add_tokens(
            sum(v.numel() for mb in micro_batches for k, v in mb.items() if k.endswith("input_ids"))
        )
        for name, value in getattr(self.loader.dataset, "stats", {}).items():
            extra[f"data_{name}"] = float(value)
        return {"loss": loss.item(), "grad_norm": grad_norm.item(), "lr": lr, **extra}

    def offload_optimizer(self) -> None:
        """Move the optimizer state to CPU (freeing device memory) until `restore_optimizer`.

        Call at a step boundary on every rank; calling it twice does nothing more. Stepping
        or saving a checkpoint meanwhile raises `OptimizerOffloadedError`.
        """
        self._offload.offload()

    def restore_optimizer(self) -> None:
        """Bring the optimizer state back to the parameters' device; idempotent."""
        self._offload.restore()

    def _next_batches(self, batches: Iterator[Batch]) -> tuple[list[Batch], dict[str, float]]:
        """The next step's micro-batches, and the metrics of their rollout (over all ranks)
        if any.

        An objective with ``prepare`` (RL) turns each micro-batch of prompts into a rollout
        every ``updates_per_rollout`` steps and trains on that rollout until the next one.
        The sampler of micro-batch ``j`` on data rank ``r`` is seeded by (seed, step,
        ``r * grad_accum + j``), so one process accumulating micro-batches draws what the
        data-parallel ranks draw.
        """
        prepare = getattr(self.objective, "prepare", None)
        if prepare is None:
            return [self._to_device(next(batches)) for _ in range(self.grad_accum)], {}
        if self._rollout is None or self.step % self.objective.updates_per_rollout == 0:
            prompts = [self._to_device(next(batches)) for _ in range(self.grad_accum)]
            first = self.dims.data_rank(self.runtime.rank) * self.grad_accum
            offload = self.config.optimizer.offload_during_rollout
            if offload:
                self.offload_optimizer()
            try:
                results = [
                    prepare(self.model, mb, self._sampler(first + j))
                    for j, mb in enumerate(prompts)
                ]
            finally:
                if offload:
                    self.restore_optimizer()
            metrics = combine_metrics([m for _, m in results], self.device)
            self._rollout = [batch for batch, _ in results], metrics
        return self._rollout

    def _sampler(self, index: int) -> torch.Generator:
        key = f"{self.config.training.seed}:{self.step}:{index}".encode()
        seed = int.from_bytes(hashlib.sha256(key).digest()[:7], "little")
        return torch.Generator(self.device).manual_seed(seed)

    def _build_reference(self) -> nn.Module:
        """A frozen copy of the policy's starting weights, built and sharded like it: the same
        seed's init or `model.hf_path`, then `checkpoint.initial_load`'s weights if given."""
        config = self.config
        model = build_meta_model(config)
        parallelize_decoder(model, config, self.meshes, self.dtype)
        with torch.random.fork_rng(devices=[]), layout_invariant_init():
            seed_everything(config.training.seed, config.training.deterministic)
            reference = materialize(model, self.device, config.model.hf_path)
        if config.checkpoint.initial_load is not None:
            load_model_weights(reference, config.checkpoint.initial_load)
        reference.attn_backend = config.model.attn
        reference.requires_grad_(False)
        return reference.eval()

    def _autocast(self) -> contextlib.AbstractContextManager[None]:
        """bf16 compute on one rule: a sharded model gets it from FSDP's mixed-precision policy
        (bf16 gathers, fp32 masters and reductions), an unsharded one from autocast."""
        if self.dtype == torch.float32 or self.dims.sharded:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def _to_device(self, batch: Batch) -> Batch:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}


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


def build_meta_model(config: Config) -> nn.Module:
    """The run's architecture on meta: from `model.hf_path`'s config.json, else the flavor."""
    overrides = config.model.arg_overrides()
    if config.model.hf_path is not None:
        return build_hf_model(config.model.hf_path, overrides=overrides)
    return build_model(config.model.name, config.model.flavor, overrides=overrides)


def build_loader(config: Config, tokenizer: Tokenizer, dp_rank: int, dp_world: int) -> BatchLoader:
    """Batches of this rank for `data.format`: packed text, or chat (sft, preference, prompt)
    data."""
    training = config.training
    if config.data.format == "text":
        return build_text_loader(
            tokenizer,
            training.seq_len,
            training.local_batch_size,
            path=config.data.path,
            text_field=config.data.text_field,
            seed=training.seed,
            dp_rank=dp_rank,
            dp_world=dp_world,
        )
    # Prompts for rollouts leave room for the completion.
    completion = config.objective.max_new_tokens if config.data.format == "prompt" else 0
    return build_chat_loader(
        config.data,
        tokenizer,
        training.seq_len - completion,
        training.local_batch_size,
        seed=training.seed,
        dp_rank=dp_rank,
        dp_world=dp_world,
        tokenizer_folder=config.data.tokenizer_path or config.model.hf_path,
    )


def _check_vocab(tokenizer: Tokenizer, model_vocab: int, config: Config) -> None:
    if tokenizer.vocab_size > model_vocab:
        raise ConfigError(
            f"data.tokenizer_path: the tokenizer has {tokenizer.vocab_size} tokens but the "
            f"model ({config.model.hf_path or config.model.flavor}) embeds only {model_vocab}"
        )
