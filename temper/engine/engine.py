"""The Engine: a config's model, built, parallelized and materialized, with its optimizer,
scheduler, meshes and checkpoints; what any training loop drives.

A loop computes its loss with ``engine.model`` inside ``engine.autocast()``, divides it by
its global count (all ranks, all micro-batches), calls ``backward()`` and ``engine.step()``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from temper.checkpoint.adapter import read_peft_adapter
from temper.config import Config, ConfigError, LoRA
from temper.data.batch import Batch
from temper.data.formats import image_paths, is_image_data
from temper.data.tokenizer import Tokenizer, builtin_tokenizer_path, load_tokenizer
from temper.engine.checkpointing import Stateful, TrainCheckpointer, load_model_weights
from temper.kernels.dispatch import resolve_kernels
from temper.models import build_hf_model, build_model, materialize
from temper.models.freeze import freeze_parts
from temper.models.hf import hf_module_names, hf_named_tensors
from temper.models.lora import apply_lora, init_lora
from temper.models.protocols import PostStepHook, VisionModel
from temper.optim import OptimizerOffload, build_lr_scheduler, build_optimizer
from temper.parallel.dims import ParallelDims
from temper.parallel.fsdp import move_buffers, parameter_device
from temper.parallel.grad_norm import clip_grad_norm_
from temper.parallel.parallelize import parallelize_decoder
from temper.parallel.sharded_init import layout_invariant_init
from temper.quantize import finish_model, prepare_model
from temper.utils.device import Runtime, init_runtime, resolve_dtype, seed_everything


class NonFiniteError(RuntimeError):
    """The loss or gradient norm became inf/nan; the update was not applied.

    ``values`` names what was not finite (``"loss nan / grad norm nan"``), ``grad_norm`` is
    the norm before clipping: what a loop that skips such steps logs.
    """

    def __init__(self, message: str, values: str, grad_norm: float) -> None:
        super().__init__(message)
        self.values = values
        self.grad_norm = grad_norm


class Engine:
    """The prepared model of one run and everything that updates and saves it.

    Building it validates the config, joins the process group (torchrun's environment),
    builds the model on meta, adds LoRA, checks any checkpoint to resume against it,
    parallelizes (SP, EP, activation checkpointing, compile, FSDP2), materializes (random
    init, ``model.hf_path`` or ``checkpoint.initial_load``) and makes the optimizer and
    scheduler. It does not resume: a loop calls ``load`` with its own state.
    """

    def __init__(self, config: Config, runtime: Runtime | None = None) -> None:
        self.config = config
        self.runtime = runtime or init_runtime()
        config.validate(self.runtime.world_size)
        self.dims = ParallelDims.from_config(
            config.parallelism, self.runtime.world_size, rank=self.runtime.rank
        )
        self.device = self.runtime.device
        self.dtype = resolve_dtype(config.training.dtype, self.device)
        seed_everything(config.training.seed, config.training.deterministic)
        self.kernels = resolve_kernels(config.kernels, self.device)
        """This run's kernel choices, resolved for its device once (fallback notices print
        here); the model runs them (``use_kernels``), the objective takes the config's."""

        self.tokenizer: Tokenizer = load_run_tokenizer(config)
        model = build_run_model(config, self.tokenizer)
        prepare_model(model, config)
        self.checkpointer = TrainCheckpointer(config)
        self.checkpointer.check(model)
        self.meshes = self.dims.build_meshes(self.device.type) if self.dims.sharded else None
        self.sequence_parallel = parallelize_decoder(model, config, self.meshes, self.dtype)
        with layout_invariant_init():
            home = parameter_device(config, self.device)
            self.model: nn.Module = materialize(model, home, config.model.hf_path)
            move_buffers(self.model, self.device)
            init_lora(self.model)
        if config.lora.enable and config.lora.initial_adapter is not None:
            load_initial_adapter(self.model, config.lora)
        if self.checkpointer.resume_step is None and config.checkpoint.initial_load:
            load_model_weights(self.model, config.checkpoint.initial_load)
        finish_model(self.model, config)
        self.model.attn_backend = config.model.attn
        self.model.use_kernels(self.kernels)
        self.optimizer = build_optimizer(self.model, config.optimizer)
        self._offload = OptimizerOffload(self.optimizer)
        self.lr_scheduler = build_lr_scheduler(
            self.optimizer, config.lr_scheduler, config.training.steps
        )

    def prepare_batch(self, batch: Batch) -> Batch:
        """``batch`` on this rank's device, and with sequence parallelism its SP slice (right-
        padded to a multiple of SP): what ``engine.model`` takes."""
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        if self.sequence_parallel is not None:
            batch = self.sequence_parallel.shard(batch)
        return batch

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """The precision context a loss must run in. bf16 compute on one rule: a sharded
        model gets it from FSDP's mixed-precision policy (bf16 gathers, fp32 masters and
        reductions), an unsharded one from autocast."""
        if self.dtype == torch.float32 or self.dims.sharded:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def check_can_step(self) -> None:
        """Raise ``OptimizerOffloadedError`` now, before a forward, where ``step`` would."""
        self._offload.check("step")

    def step(self, loss: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Apply the accumulated gradients: clip across every mesh, refuse a non-finite
        gradient norm (or ``loss``, when given), step the optimizer and scheduler, run the
        model's post-step hook, zero the gradients. Returns ``grad_norm`` (before clipping)
        and ``lr`` (the one applied), as tensors that stay on the device."""
        self._offload.check("step")
        max_norm = self.config.training.max_norm or math.inf
        grad_norm = clip_grad_norm_(self.model.parameters(), max_norm)
        finite = torch.isfinite(grad_norm) if loss is None else torch.isfinite(loss + grad_norm)
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
            norm = grad_norm.item()
            values = ("" if loss is None else f"loss {loss.item()} / ") + f"grad norm {norm}"
            raise NonFiniteError(
                f"{values} is not finite; the update was not applied. "
                "Lower optimizer.lr or check the data.",
                values,
                norm,
            )
        lr = torch.tensor(float(self.optimizer.param_groups[0]["lr"]))  # torchao keeps a tensor
        self.optimizer.step()
        if isinstance(self.model, PostStepHook):
            self.model.after_optimizer_step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": grad_norm.detach(), "lr": lr}

    def save(
        self,
        step: int,
        extra: Stateful | None = None,
        *,
        metadata: dict[str, Any] | None = None,
        wait: bool = False,
    ) -> None:
        """A DCP checkpoint of step ``step`` under ``<dump_folder>/<checkpoint.folder>``:
        model, optimizer, scheduler, RNG, and ``extra``'s state; written to a temporary
        folder and renamed when complete, so a crash never leaves a half checkpoint as the
        latest. ``metadata`` adds facts to its temper.json; ``wait`` blocks until an
        asynchronous save is on disk."""
        self._offload.check("save a checkpoint")
        self.checkpointer.save(
            step,
            self.model,
            self.optimizer,
            self.lr_scheduler,
            extra,
            metadata or {},
        )
        if wait:
            self.checkpointer.wait()

    def load(self, extra: Stateful | None = None) -> int | None:
        """Resume from the checkpoint ``checkpoint.resume`` picked (with ``checkpoint.enable``;
        the newest complete one by default): weights, optimizer, scheduler, RNG and
        ``extra``'s state; returns its step, or None when there is none (the model then
        keeps its initial weights)."""
        return self.checkpointer.restore(self.model, self.optimizer, self.lr_scheduler, extra)

    def offload_optimizer(self) -> None:
        """Move the optimizer state to CPU (freeing device memory) until
        ``restore_optimizer``. Call at a step boundary on every rank; calling it twice does
        nothing more. ``step`` or ``save`` meanwhile raise ``OptimizerOffloadedError``."""
        self._offload.offload()

    def restore_optimizer(self) -> None:
        """Bring the optimizer state back to the parameters' device; idempotent."""
        self._offload.restore()

    def hf_state_dict(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full tensor)`` pairs of the current weights under Hugging Face names,
        one tensor gathered at a time (LoRA merged): for handing weights to an inference
        server. Sharded: every rank must iterate it to the end (each tensor is a
        collective)."""
        return hf_named_tensors(self.model)

    def build_reference(self) -> nn.Module:
        """A frozen copy of the policy's starting weights, built and sharded like it: the same
        seed's init or ``model.hf_path``, then ``checkpoint.initial_load``'s weights if
        given."""
        config = self.config
        model = build_meta_model(config)
        parallelize_decoder(model, config, self.meshes, self.dtype)
        with torch.random.fork_rng(devices=[]), layout_invariant_init():
            seed_everything(config.training.seed, config.training.deterministic)
            reference = materialize(model, self.device, config.model.hf_path)
        if config.checkpoint.initial_load is not None:
            load_model_weights(reference, config.checkpoint.initial_load)
        reference.attn_backend = config.model.attn
        reference.use_kernels(self.kernels)
        reference.requires_grad_(False)
        return reference.eval()


def build_meta_model(config: Config) -> nn.Module:
    """The run's architecture on meta: from `model.hf_path`'s config.json, else the flavor."""
    overrides = config.model.arg_overrides()
    if config.model.hf_path is not None:
        return build_hf_model(config.model.hf_path, overrides=overrides)
    return build_model(config.model.name, config.model.flavor, overrides=overrides)


def read_initial_adapter(model: nn.Module, lora: LoRA) -> dict[str, torch.Tensor]:
    """``lora.initial_adapter``'s tensors by parameter name, checked against ``model``'s
    adapters (on meta for the pre-flight); ConfigError naming the flag."""
    try:
        return read_peft_adapter(
            model, lora.initial_adapter, rank=lora.rank, alpha=lora.alpha, rslora=lora.rslora
        )
    except (OSError, ValueError) as error:
        raise ConfigError(f"lora.initial_adapter {lora.initial_adapter}: {error}") from None


def load_initial_adapter(model: nn.Module, lora: LoRA) -> None:
    """Fill the (possibly sharded) adapters with a PEFT folder's: full tensors on every rank,
    each rank keeping its shard."""
    tensors = read_initial_adapter(model, lora)
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, tensors, options=options)


def tokenizer_flag(config: Config) -> str:
    """The flag that names the run's tokenizer, for error messages."""
    if config.data.tokenizer_path is not None:
        return f"data.tokenizer_path {config.data.tokenizer_path}"
    if config.model.hf_path is not None:
        return f"model.hf_path {config.model.hf_path}"
    return "the built-in tokenizer"


def load_run_tokenizer(config: Config) -> Tokenizer:
    """``data.tokenizer_path``'s tokenizer, else ``model.hf_path``'s, else the built-in one;
    ConfigError naming the flag when it cannot be read."""
    try:
        return load_tokenizer(config.data.tokenizer_path or config.model.hf_path)
    except FileNotFoundError as error:
        if config.data.tokenizer_path is not None:
            raise ConfigError(f"{tokenizer_flag(config)}: {error}") from None
        # A model folder without its tokenizer (weights saved alone): say where to get one.
        raise ConfigError(
            f"{tokenizer_flag(config)}: {error}; name the model's tokenizer with "
            "--data.tokenizer_path (a tokenizer.json, or a folder holding one such as the base "
            "model's), or train with the built-in tokenizer: --data.tokenizer_path "
            f"{builtin_tokenizer_path()}"
        ) from None
    except (OSError, ValueError) as error:
        raise ConfigError(f"{tokenizer_flag(config)}: {error}") from None


def build_run_model(config: Config, tokenizer: Tokenizer) -> nn.Module:
    """The run's model on meta with its LoRA adapters, refusing (ConfigError naming the
    flag) an HF folder it cannot read, a tokenizer larger than the embedding, or LoRA
    targets that match nothing: what the Engine builds on, and what the pre-flight checks."""
    try:
        model = build_meta_model(config)
    except (OSError, ValueError) as error:
        if isinstance(error, ConfigError) or config.model.hf_path is None:
            raise
        raise ConfigError(f"model.hf_path {config.model.hf_path}: {error}") from None
    model_vocab = model.tok_embeddings.num_embeddings
    if tokenizer.vocab_size > model_vocab:
        raise ConfigError(
            f"{tokenizer_flag(config)}: the tokenizer has {tokenizer.vocab_size} tokens but the "
            f"model ({config.model.hf_path or config.model.flavor}) embeds only {model_vocab}"
        )
    if config.lora.enable:
        lora = config.lora
        try:
            apply_lora(
                model,
                lora.target_modules,
                rank=lora.rank,
                alpha=lora.alpha,
                dropout=lora.dropout,
                rslora=lora.rslora,
                hf_names=hf_module_names(model),
            )
        except ValueError as error:
            raise ConfigError(str(error)) from None
    try:
        freeze_parts(model, config.model.freeze)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if is_image_data(config.data) and not isinstance(model, VisionModel):
        raise ConfigError(
            f"data {image_paths(config.data) or '(built-in image task)'} holds images, but "
            f"{type(model).__name__} has no vision tower: train a vision-language model "
            "(qwen3_5_vl, qwen3_5_moe_vl or such an HF folder)"
        )
    return model
