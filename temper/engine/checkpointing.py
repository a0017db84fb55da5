"""What a training checkpoint holds: the engine's model, optimizer, scheduler and RNG, and
the loop's own state (a ``Stateful``), written atomically by DCP and read back."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from temper.checkpoint.manager import (
    CheckpointManager,
    check_intact,
    remove_partial_saves,
    resolve_resume,
    rng_state,
    set_rng_state,
)
from temper.checkpoint.metadata import (
    build_metadata,
    read_metadata,
    run_structure,
    structure_differences,
)
from temper.checkpoint.tokenizer_files import tokenizer_files
from temper.config import Config, ConfigError
from temper.data.chat import load_chat_template


class Stateful(Protocol):
    """What a loop hands the engine to checkpoint beside the model: its own state (step,
    data position, ...) as a dict of tensors, numbers and nested dicts. A load fills the
    tensors of ``state_dict()`` (or of ``load_skeleton``, ``StepShaped``) in place."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class StepShaped(Stateful, Protocol):
    """A Stateful whose saved tensors depend on the step saved (the Trainer's holds an RL
    rollout between two of its updates): a checkpoint of ``step`` is loaded into
    ``load_skeleton(step)``, so nothing about the object must be set before the load."""

    def load_skeleton(self, step: int) -> dict[str, Any]: ...


def load_skeleton(extra: Stateful, step: int) -> dict[str, Any]:
    """The state a checkpoint of ``step`` loads ``extra`` from: tensors shaped as saved."""
    return extra.load_skeleton(step) if isinstance(extra, StepShaped) else extra.state_dict()


class TrainCheckpointer:
    """DCP checkpoints of one run folder: ``check`` refuses one that does not fit before any
    weight exists, ``save`` writes one step, ``restore`` resumes the newest (or starts from
    ``checkpoint.initial_load``'s weights)."""

    def __init__(self, config: Config) -> None:
        self.config = config.checkpoint
        self.root = Path(config.job.dump_folder) / self.config.folder
        self.manager = CheckpointManager(
            self.root, keep_latest_k=self.config.keep_latest_k, async_mode=self.config.async_mode
        )
        self.ep = config.parallelism.ep
        self.lora = dataclasses.asdict(config.lora) if config.lora.enable else None
        self.freeze = list(config.model.freeze)
        source = config.data.tokenizer_path or config.model.hf_path
        chat = config.data.format != "text"
        template = load_chat_template(config.data.chat_template, source) if chat else None
        # Read once at the start: every checkpoint carries the run's tokenizer and template.
        self.tokenizer_files = tokenizer_files(source, template)
        self.facts = {
            "tokenizer_source": _absolute(source),
            "hf_path": _absolute(config.model.hf_path),
            "data_format": config.data.format,
            "qat": dataclasses.asdict(config.qat) if config.qat.enable else None,
        }
        self._resume_step: int | None = None

    def check(self, model: nn.Module, digests: bool = True) -> None:
        """Refuse a checkpoint to resume or `initial_load` that does not fit `model` (the meta
        model, LoRA applied), would run code or read outside its folder: before any weight
        is allocated, so a wrong flavor fails at once. A damaged one is passed over (resume
        auto) or refused; ``digests=False`` (the pre-flight) checks sizes, not every byte.
        """
        current = self.metadata(model, step=0, extra={"tokens_seen": 0})
        if self.config.enable:
            remove_partial_saves(self.root)
        self._resume_step = (
            resolve_resume(self.root, self.config.resume, digests) if self.config.enable else None
        )
        if self._resume_step is not None:
            where = f"{self.root}/step-{self._resume_step}"
            differences = structure_differences(self.manager.metadata(self._resume_step), current)
            if differences:
                raise ConfigError(
                    f"checkpoint {where} does not match this config: {'; '.join(differences)}. "
                    "Use a new job.dump_folder, --checkpoint.resume never, or "
                    "--checkpoint.initial_load for weights only"
                )
        elif self.config.initial_load is not None:
            folder = Path(self.config.initial_load)
            check_intact(folder, digests)
            saved = read_metadata(folder)
            if saved["model"] != current["model"]:
                differences = structure_differences(saved, {**saved, "model": current["model"]})
                raise ConfigError(
                    f"checkpoint.initial_load {folder} holds another model: "
                    + "; ".join(differences)
                )

    def restore(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any,
        extra: Stateful | None,
    ) -> int | None:
        """Resume the run as `check` found it; returns the step resumed, None when there is
        nothing to resume."""
        if self._resume_step is not None:
            skeleton = None if extra is None else load_skeleton(extra, self._resume_step)
            state = self._state(model, optimizer, lr_scheduler, skeleton)
            state = self.manager.load(self._resume_step, state)
            set_state_dict(
                model,
                optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
            )
            lr_scheduler.load_state_dict(state["lr_scheduler"])
            set_rng_state(state["rng"])
            if extra is not None:
                extra.load_state_dict(state["extra"])
        return self._resume_step

    @property
    def resume_step(self) -> int | None:
        """The step ``check`` found to resume, or None."""
        return self._resume_step

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any,
        extra: Stateful | None,
        metadata: dict[str, Any],
    ) -> None:
        """Write step ``step`` (asynchronously with ``checkpoint.async_mode``)."""
        extra_state = None if extra is None else extra.state_dict()
        state = self._state(model, optimizer, lr_scheduler, extra_state)
        self.manager.save(step, state, self.metadata(model, step, metadata), self.tokenizer_files)

    def wait(self) -> None:
        """Block until an asynchronous save is on disk."""
        self.manager.wait()

    @staticmethod
    def _state(
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any,
        extra: dict[str, Any] | None,
    ) -> dict[str, Any]:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {
            "model": model_state,
            "optimizer": optimizer_state,
            "lr_scheduler": lr_scheduler.state_dict(),
            "rng": rng_state(),
        }
        if extra is not None:
            state["extra"] = extra
        return state

    def metadata(self, model: nn.Module, step: int, extra: dict[str, Any]) -> dict[str, Any]:
        """temper.json: the model, the run's structure, where its tokenizer came from, its data
        format, and ``extra`` facts (tokens seen)."""
        param_dtype = next(model.parameters()).dtype
        return build_metadata(
            model,
            step=step,
            structure=run_structure(
                ep=self.ep, lora=self.lora, param_dtype=param_dtype, freeze=self.freeze
            ),
            extra={**extra, **self.facts},
        )


def _absolute(path: str | None) -> str | None:
    return None if path is None else str(Path(path).resolve())


def load_model_weights(model: Any, folder: str | Path) -> None:
    """Fill a materialized (possibly sharded) model with a checkpoint's model weights.

    A LoRA model started from a checkpoint without adapters (an SFT run, say) takes only the
    base weights; its adapters keep their fresh init.
    """
    folder = Path(folder)
    state = get_model_state_dict(model)
    if not read_metadata(folder)["structure"].get("lora"):
        state = {k: v for k, v in state.items() if not k.rpartition(".")[2].startswith("lora_")}
    CheckpointManager(folder.parent, keep_latest_k=0, async_mode=False).load(
        folder, {"model": state}
    )
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))
