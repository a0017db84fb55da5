"""A LoRA checkpoint as a PEFT adapter folder: ``adapter_config.json`` and
``adapter_model.safetensors`` under Hugging Face module names, which
``peft.PeftModel.from_pretrained`` loads onto the base model's HF folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from temper.models.hf import hf_module_names
from temper.models.lora import LoRALinear

PEFT_PREFIX = "base_model.model."
"""PEFT's prefix of a causal LM's module names (its LoraModel wraps the HF model)."""


def save_peft_adapter(
    model: nn.Module, lora: dict[str, Any], output: Path, base_model: str | None
) -> None:
    """Write the adapters of ``model`` (LoRA applied, not merged) as a PEFT LoRA folder.

    PEFT's update is ``scale * B A x`` with ``scale = lora_alpha / r`` (``/ sqrt(r)`` with
    ``use_rslora``), and its ``lora_A`` [r, in] and ``lora_B`` [out, r] are Temper's
    ``lora_a`` and ``lora_b``: the tensors go as they are."""
    names = hf_module_names(model)
    tensors: dict[str, torch.Tensor] = {}
    targets = []
    for name, module in model.named_modules():
        if not isinstance(module, LoRALinear):
            continue
        if name not in names:
            raise ValueError(f"LoRA module {name} has no single Hugging Face tensor to adapt")
        hf = names[name]
        targets.append(hf)
        tensors[f"{PEFT_PREFIX}{hf}.lora_A.weight"] = module.lora_a.detach().contiguous()
        tensors[f"{PEFT_PREFIX}{hf}.lora_B.weight"] = module.lora_b.detach().contiguous()
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora["rank"],
        "lora_alpha": lora["alpha"],
        "lora_dropout": lora.get("dropout", 0.0),
        "use_rslora": lora["rslora"],
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    output.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(output / "adapter_model.safetensors"), metadata={"format": "pt"})
    (output / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
