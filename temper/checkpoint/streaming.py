"""A checkpoint's Hugging Face tensors one at a time, never the whole model in memory.

The model is built on the meta device only for its names, shapes and HF rules; each HF
tensor is then read from DCP alone (DCP reshards it from however it was saved: FSDP
shards, EP-sharded experts, any world size), its LoRA adapters merged, renamed (stacked
experts split) and handed on, so a writer can put it in its safetensors shard and drop
it. Peak memory: the shard being written plus one native tensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from temper.checkpoint.integrity import verify
from temper.checkpoint.metadata import read_metadata
from temper.checkpoint.reader import CheckpointReader
from temper.models import get_model_spec
from temper.models.hf import hf_module_names, hf_rules, named_tensors
from temper.models.lora import LoRALinear, apply_lora, merge_adapters

MODEL_PREFIX = "model."
"""Where a checkpoint keeps the model's tensors (its ``{"model": state_dict}`` section)."""


def checkpoint_meta_model(checkpoint: Path) -> nn.Module:
    """The model a checkpoint's temper.json describes, on meta, its LoRA adapters applied."""
    metadata = read_metadata(checkpoint)
    spec = get_model_spec(metadata["model"]["family"])
    args = spec.hf_adapter.args_from_hf(metadata["model"]["hf_config"])
    with torch.device("meta"):
        model = spec.model_cls(args)
    lora = metadata["structure"].get("lora")
    if lora:
        apply_lora(
            model,
            lora["target_modules"],
            rank=lora["rank"],
            alpha=lora["alpha"],
            rslora=lora["rslora"],
            hf_names=hf_module_names(model),
        )
    return model


def hf_tensor_plan(model: nn.Module, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Every HF tensor `streamed_hf_tensors` yields, in its order, as a meta tensor of its
    shape and output dtype: enough to lay out the safetensors shards before reading any."""
    tensors = named_tensors(model)
    plan = {}
    for rule in hf_rules(model):
        native = tensors[rule.native]
        shape = native.shape if len(rule.hf) == 1 else native.shape[1:]
        for key in rule.hf:
            plan[key] = torch.empty(shape, dtype=dtype or native.dtype, device="meta")
    return plan


def streamed_hf_tensors(
    checkpoint: Path, model: nn.Module, dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` of `checkpoint` (the `checkpoint_meta_model` of it) as
    `temper.models.hf_named_tensors` gives them for the loaded model with its LoRA merged,
    cast to `dtype` when given, each read from DCP only when asked for."""
    verify(checkpoint)
    reader = CheckpointReader(checkpoint)
    tensors = named_tensors(model)
    adapters = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, LoRALinear)}

    def read(name: str, cast: torch.dtype | None = None) -> torch.Tensor:
        """One native tensor, cast on reading to `cast` (else to the model's dtype, as loading
        into the model casts it)."""
        meta = tensors[name]
        state = {MODEL_PREFIX + name: torch.empty(meta.shape, dtype=cast or meta.dtype)}
        dcp.load(state, storage_reader=reader)
        return state[MODEL_PREFIX + name]

    for rule in hf_rules(model):
        module = adapters.get(rule.native)
        if module is None:
            # Straight into the output dtype: the one rounding that casting the loaded model
            # gives, without a second copy of the tensor.
            value = read(rule.native, dtype)
        else:  # merged in the model's dtype, then cast, as the whole model is
            prefix = rule.native.removesuffix("weight")
            weights = (read(rule.native), read(prefix + "lora_a"), read(prefix + "lora_b"))
            value = merge_adapters(*weights, module.scale).to(dtype or weights[0].dtype)
        parts = [value] if len(rule.hf) == 1 else list(value.unbind(0))
        yield from zip(rule.hf, parts, strict=True)


def load_adapters(checkpoint: Path, model: nn.Module) -> nn.Module:
    """`model` (the `checkpoint_meta_model`) with only its LoRA adapters read from the
    checkpoint, every base weight left on meta: what a PEFT adapter export needs."""
    verify(checkpoint)
    adapters = {
        f"{name}.{part}": getattr(module, part)
        for name, module in model.named_modules()
        if isinstance(module, LoRALinear)
        for part in ("lora_a", "lora_b")
    }
    state = {MODEL_PREFIX + n: torch.empty(p.shape, dtype=p.dtype) for n, p in adapters.items()}
    dcp.load(state, storage_reader=CheckpointReader(checkpoint))
    for name in adapters:
        owner, _, part = name.rpartition(".")
        value = nn.Parameter(state[MODEL_PREFIX + name], requires_grad=False)
        setattr(model.get_submodule(owner), part, value)
    return model
