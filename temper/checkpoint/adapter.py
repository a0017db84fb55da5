"""A LoRA checkpoint as a PEFT adapter folder: ``adapter_config.json`` and
``adapter_model.safetensors`` under Hugging Face module names, which
``peft.PeftModel.from_pretrained`` loads onto the base model's HF folder."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from temper.models.hf import hf_module_names, hf_rules
from temper.models.lora import LoRALinear
from temper.models.safetensors_io import save_safetensors
from temper.utils.paths import inside

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""PEFT's prefix of a causal LM's module names (its LoraModel wraps the HF model)."""
PEFT_KEY = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.weight$")


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
        "target_modules": _peft_targets(targets, _hf_modules(model)),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    output.mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, output / ADAPTER_WEIGHTS)
    (output / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def _hf_modules(model: nn.Module) -> set[str]:
    """The module name of every weight of the model's HF checkpoint, stacked experts' one per
    expert included (a short target must not pick them up)."""
    hf_names = (name for rule in hf_rules(model) for name in rule.hf)
    return {name.removesuffix(".weight") for name in hf_names if name.endswith(".weight")}


def _peft_targets(targets: list[str], modules: set[str]) -> list[str]:
    """PEFT's ``target_modules``: the adapted layers' last names (``q_proj``), which PEFT
    matches as a suffix of each module's name, when they pick exactly the adapted layers
    among ``modules`` (the model's HF module names); else the full names."""
    short = {target.rsplit(".", 1)[-1] for target in targets}
    picked = {name for name in modules if name.rsplit(".", 1)[-1] in short}
    return sorted(short) if picked == set(targets) else sorted(targets)


def read_peft_adapter(
    model: nn.Module, folder: str | Path, *, rank: int, alpha: float, rslora: bool
) -> dict[str, torch.Tensor]:
    """The tensors of a PEFT LoRA folder by ``model``'s parameter names (``...wq.lora_a``),
    refusing (ValueError) one whose rank, alpha, rsLoRA or layers differ from ``model``'s
    adapters; ``model`` may be on meta (the pre-flight)."""
    folder = Path(folder)
    if not (folder / ADAPTER_CONFIG).is_file() or not (folder / ADAPTER_WEIGHTS).is_file():
        raise FileNotFoundError(f"{folder}: no {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    config = json.loads(inside(folder, ADAPTER_CONFIG).read_text())
    want = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": rslora}
    for key, value in want.items():
        if config.get(key, False if key == "use_rslora" else None) != value:
            raise ValueError(f"{folder}: {key} is {config.get(key)!r}, the run's is {value!r}")
    native = {hf: name for name, hf in hf_module_names(model).items()}
    found = {}
    for key, value in load_file(str(inside(folder, ADAPTER_WEIGHTS))).items():
        match = PEFT_KEY.match(key)
        if match is None or match.group(1) not in native:
            raise ValueError(f"{folder}: {key} is not a LoRA tensor of this model's layers")
        found[f"{native[match.group(1)]}.lora_{match.group(2).lower()}"] = value
    expected = {
        f"{name}.{part}": getattr(module, part).shape
        for name, module in model.named_modules()
        if isinstance(module, LoRALinear)
        for part in ("lora_a", "lora_b")
    }
    missing, extra = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
    if missing or extra:
        raise ValueError(
            f"{folder}: its adapters are not the run's LoRA layers (missing {missing[:4]}, "
            f"unexpected {extra[:4]})"
        )
    for name, shape in expected.items():
        if found[name].shape != shape:
            raise ValueError(
                f"{folder}: {name} has shape {list(found[name].shape)}, not {list(shape)}"
            )
    return found
