"""The one training loop: build everything from a Config, then step until done."""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from temper.config import Config, ConfigError, save_config
from temper.data import BatchLoader, Tokenizer, build_text_loader, load_tokenizer
from temper.models import build_hf_model, build_model, materialize
from temper.objectives import CausalLM, Objective, count_tokens
from temper.objectives.causal_lm import Batch
from temper.optim import build_lr_scheduler, build_optimizer
from temper.parallel.collectives import all_reduce_sum
from temper.parallel.dims import ParallelDims
from temper.parallel.grad_norm import clip_grad_norm_
from temper.parallel.parallelize import parallelize_decoder
from temper.parallel.sharded_init import layout_invariant_init
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
        self.dims = ParallelDims.from_config(config.parallelism, self.runtime.world_size)
        self.device = self.runtime.device
        self.dtype = resolve_dtype(config.training.dtype, self.device)
        seed_everything(config.training.seed, config.training.deterministic)

        self.tokenizer = load_tokenizer(config.data.tokenizer_path or config.model.hf_path)
        model = build_meta_model(config)
        _check_vocab(self.tokenizer, model.tok_embeddings.num_embeddings, config)
        meshes = self.dims.build_meshes(self.device.type) if self.dims.sharded else None
        parallelize_decoder(model, config, meshes, self.dtype)
        with layout_invariant_init():
            self.model = materialize(model, self.device, config.model.hf_path)
        self.objective: Objective = CausalLM()
        self.optimizer = build_optimizer(self.model, config.optimizer)
        self.lr_scheduler = build_lr_scheduler(
            self.optimizer, config.lr_scheduler, config.training.steps
        )

        self.grad_accum = config.grad_accum_steps(self.runtime.world_size)
        self.loader: BatchLoader = build_text_loader(
            self.tokenizer,
            config.training.seq_len,
            config.training.local_batch_size,
            path=config.data.path,
            text_field=config.data.text_field,
            seed=config.training.seed,
            dp_rank=self.dims.data_rank(self.runtime.rank),
            dp_world=self.dims.dp,
        )
        self.step = 0
        self.metrics = MetricsLogger(
            config.job.dump_folder,
            tensorboard=config.metrics.tensorboard,
            enabled=self.runtime.is_main,
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
                micro_batches = [self._to_device(next(batches)) for _ in range(self.grad_accum)]
                metrics = self.train_step(micro_batches)
                if self.step % config.metrics.log_freq == 0 or self.step == config.training.steps:
                    metrics.update(self.throughput.measure(self.step))
                    metrics["memory_gib"] = peak_memory_gib(self.device)
                    self.metrics.log(self.step, metrics)
        finally:
            self.metrics.close()

    def train_step(self, micro_batches: list[Batch]) -> dict[str, float]:
        """One optimizer step over accumulated micro-batches; returns its metrics.

        Each micro-batch's summed loss is divided by the valid-token count of the
        whole step across ranks, so the gradients equal those of one big batch.
        """
        local_tokens = sum(count_tokens(mb) for mb in micro_batches)
        global_tokens = all_reduce_sum(torch.as_tensor(local_tokens, device=self.device))
        loss_sum = torch.zeros((), device=self.device)
        for batch in micro_batches:
            with self._autocast():
                micro_loss, _, _ = self.objective.loss(self.model, batch)
            (micro_loss / global_tokens).backward()
            loss_sum += micro_loss.detach().float()
        max_norm = self.config.training.max_norm or math.inf
        grad_norm = clip_grad_norm_(self.model.parameters(), max_norm)
        loss = all_reduce_sum(loss_sum) / global_tokens

        self.step += 1
        if not (torch.isfinite(loss) and torch.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteError(
                f"step {self.step}: loss {loss.item()} / grad norm {grad_norm.item()} is not "
                "finite; the update was skipped. Lower optimizer.lr or check the data."
            )
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.throughput.add_tokens(sum(mb["input_ids"].numel() for mb in micro_batches))
        return {"loss": loss.item(), "grad_norm": grad_norm.item(), "lr": lr}

    def _autocast(self) -> contextlib.AbstractContextManager[None]:
        """bf16 compute on one rule: a sharded model gets it from FSDP's mixed-precision policy
        (bf16 gathers, fp32 masters and reductions), an unsharded one from autocast."""
        if self.dtype == torch.float32 or self.dims.sharded:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def _to_device(self, batch: Batch) -> Batch:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}


def build_meta_model(config: Config) -> nn.Module:
    """The run's architecture on meta: from `model.hf_path`'s config.json, else the flavor."""
    if config.model.hf_path is not None:
        return build_hf_model(config.model.hf_path)
    return build_model(config.model.name, config.model.flavor)


def _check_vocab(tokenizer: Tokenizer, model_vocab: int, config: Config) -> None:
    if tokenizer.vocab_size > model_vocab:
        raise ConfigError(
            f"data.tokenizer_path: the tokenizer has {tokenizer.vocab_size} tokens but the "
            f"model ({config.model.hf_path or config.model.flavor}) embeds only {model_vocab}"
        )
