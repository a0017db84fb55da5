"""`temper.json`: what a checkpoint holds, so it can be checked, resumed and converted alone."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch
from torch import nn

from temper.models.hf import adapter_of
from temper.models.registry import spec_of

METADATA_FILE = "temper.json"
FORMAT_VERSION = 1


def model_metadata(model: nn.Module) -> dict[str, Any]:
    """Family and arguments of `model`, with the HF config that rebuilds it."""
    return {
        "family": spec_of(model).name,
        "args": _plain(dataclasses.asdict(model.args)),
        "hf_config": adapter_of(model).args_to_hf(model.args),
    }


def _temper_version() -> str:
    """The installed package's version; a checkout run from PYTHONPATH, not installed (as on
    a machine without a package index), has none, and its checkpoints still save."""
    try:
        return version("temper")
    except PackageNotFoundError:
        return "not installed"


def build_metadata(
    model: nn.Module, *, step: int, structure: dict[str, Any], extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "format": FORMAT_VERSION,
        "step": step,
        "model": model_metadata(model),
        "structure": structure,
        "versions": {"temper": _temper_version(), "torch": torch.__version__},
        **(extra or {}),
    }


def structure_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human-readable differences in what must match to resume: model and structure (but
    not its layout, `LAYOUT_FIELDS`)."""
    differences = []
    if saved["model"]["family"] != current["model"]["family"]:
        differences.append(
            f"model family: checkpoint {saved['model']['family']!r}, "
            f"config {current['model']['family']!r}"
        )
    else:
        differences += _dict_differences(
            "model.args", saved["model"]["args"], current["model"]["args"]
        )
    differences += _dict_differences(
        "structure", _without_layout(saved["structure"]), _without_layout(current["structure"])
    )
    return differences


LAYOUT_FIELDS = ("ep",)
"""Structure recorded for the record only: the EP degree lays the same experts out over
ranks, and DCP reshards them on load as it does FSDP shards (every expert is in the
checkpoint whatever the degree), so a run resumes at another EP degree."""


def _without_layout(structure: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in structure.items() if key not in LAYOUT_FIELDS}


def read_metadata(folder: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(folder) / METADATA_FILE
    try:
        metadata = json.loads(path.read_text())
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{path}: not found; {folder} is not a temper checkpoint") from err
    if metadata.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: unknown checkpoint format {metadata.get('format')!r}")
    return metadata


def _dict_differences(prefix: str, saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    return [
        f"{prefix}.{key}: checkpoint {saved.get(key)!r}, config {current.get(key)!r}"
        for key in sorted(saved.keys() | current.keys())
        if saved.get(key) != current.get(key)
    ]


def _plain(value: Any) -> Any:
    """JSON round-trips tuples as lists; store them as lists so comparisons are exact."""
    return json.loads(json.dumps(value))


def run_structure(
    ep: int,
    lora: dict[str, Any] | None,
    param_dtype: torch.dtype,
    freeze: Sequence[str] = (),
) -> dict[str, Any]:
    """The settings besides the model args that change what a checkpoint's tensors are (and,
    with frozen parts, which of them its optimizer state covers); ``freeze`` is recorded only
    when set, so checkpoints from before it existed still resume."""
    structure = {"ep": ep, "lora": lora, "param_dtype": str(param_dtype).removeprefix("torch.")}
    if freeze:
        structure["freeze"] = sorted(freeze)
    return structure
