"""What a training checkpoint holds, and when it is written and read back."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
from temper.config import Config, ConfigError

if TYPE_CHECKING:
    from temper.trainer.trainer import Trainer


class TrainCheckpointer:
    """Saves every `checkpoint.interval` steps and at the end; restores at start."""

    def __init__(self, config: Config) -> None:
        self.config = config.checkpoint
        self.root = Path(config.job.dump_folder) / self.config.folder
        self.manager = CheckpointManager(
            self.root, keep_latest_k=self.config.keep_latest_k, async_mode=self.config.async_mode
        )
        self.ep = config.parallelism.ep
        self.lora = dataclasses.asdict(config.lora) if config.lora.enable else None
        # Absolute, so the converter finds them from any working directory.
        self.tokenizer_source = _absolute(config.data.tokenizer_path or config.model.hf_path)
        self.hf_path = _absolute(config.model.hf_path)
        self._resume_step: int | None = None

    def check(self, model: nn.Module) -> None:
        """Refuse a checkpoint to resume or `initial_load` that does not fit `model` (the meta
        model, LoRA applied): before any weight is allocated, so a wrong flavor fails at once.
        """
        current = self._metadata(model, step=0, tokens_seen=0)
        self._resume_step = (
            resolve_resume(self.root, self.config.resume) if self.config.enable else None
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
            saved = read_metadata(folder)
            if saved["model"] != current["model"]:
                differences = structure_differences(saved, {**saved, "model": current["model"]})
                raise ConfigError(
                    f"checkpoint.initial_load {folder} holds another model: "
                    + "; ".join(differences)
                )

    def restore(self, trainer: Trainer) -> int | None:
        """Resume the run (or start from `initial_load`'s weights), as `check` found it;
        returns the step resumed."""
        if self._resume_step is not None:
            state = self.manager.load(self._resume_step, self._state(trainer))
            self._apply(trainer, state)
            return self._resume_step
        if self.config.initial_load is not None:
            load_model_weights(trainer.model, self.config.initial_load)
        return None

    def maybe_save(self, trainer: Trainer, *, last: bool) -> None:
        if not self.config.enable:
            return
        if last or trainer.step % self.config.interval == 0:
            self.manager.save(
                trainer.step,
                self._state(trainer),
                self._metadata(trainer.model, trainer.step, trainer.tokens_seen),
            )
        if last:
            self.manager.wait()

    def _state(self, trainer: Trainer) -> dict[str, Any]:
        model_state, optimizer_state = get_state_dict(trainer.model, trainer.optimizer)
        return {
            "model": model_state,
            "optimizer": optimizer_state,
            "lr_scheduler": trainer.lr_scheduler.state_dict(),
            "dataloader": trainer.loader.state_dict(),
            "train_state": {"step": trainer.step, "tokens_seen": trainer.tokens_seen},
            "rng": rng_state(),
        }

    def _apply(self, trainer: Trainer, state: dict[str, Any]) -> None:
        set_state_dict(
            trainer.model,
            trainer.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
        trainer.lr_scheduler.load_state_dict(state["lr_scheduler"])
        trainer.loader.load_state_dict(state["dataloader"])
        trainer.step = state["train_state"]["step"]
        trainer.tokens_seen = state["train_state"]["tokens_seen"]
        set_rng_state(state["rng"])

    def _metadata(self, model: nn.Module, step: int, tokens_seen: int) -> dict[str, Any]:
        param_dtype = next(model.parameters()).dtype
        return build_metadata(
            model,
            step=step,
            structure=run_structure(ep=self.ep, lora=self.lora, param_dtype=param_dtype),
            extra={
                "tokens_seen": tokens_seen,
                "tokenizer": self.tokenizer_source,
                "hf_path": self.hf_path,
            },
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
