"""Hugging Face folders in and out: the adapter contract and the generic load/save.

A family's adapter says how its args map to `config.json` and, as a table of
`KeyRule`s, which HF tensors make each native parameter; the names families share, both
ways, are in `temper.models.hf_keys`. Everything else (reading
shards lazily, checking names and shapes, filling possibly sharded parameters,
writing shards with an index) is done once here for every family.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from temper.models.layers.rope import RopeScaling, YarnScaling
from temper.models.lora import LoRALinear, full_tensor, merged_weight
from temper.models.mxfp4 import Mxfp4Folder
from temper.models.quantized import BlockScaledFolder, quantized_view
from temper.models.registry import ModelSpec, all_model_specs, replace_args, spec_of
from temper.models.safetensors_io import (
    DEFAULT_SHARD_BYTES,
    SafetensorsFolder,
    WeightError,
    describe,
    read_json,
    write_safetensors,
)
from temper.utils.compat import compute_local_shape_and_global_offset
from temper.utils.paths import inside


@dataclass(frozen=True)
class KeyRule:
    """One native parameter and the HF tensors it is made of.

    One HF key: the same tensor. Several: HF keeps one tensor per expert and the
    native parameter stacks them along dim 0, in the listed order.
    """

    native: str
    hf: tuple[str, ...]


@dataclass(frozen=True)
class HFAdapter:
    """How one family reads and writes HF folders."""

    model_types: tuple[str, ...]
    """`model_type` values of `config.json` that this family reads."""
    args_from_hf: Callable[[dict[str, Any]], Any]
    """HF config dict -> the family's ModelArgs (fails naming unsupported settings)."""
    args_to_hf: Callable[[Any], dict[str, Any]]
    """ModelArgs -> config.json content (with `architectures` and `model_type`)."""
    key_rules: Callable[[Any], list[KeyRule]]
    """Every native parameter's rule, for the given args (tied weights listed once)."""
    buffer_rules: Callable[[Any], list[KeyRule]] = lambda args: []
    """Persistent buffers that HF checkpoints hold too (DeepSeek V3's expert bias): read and
    written like parameters, but they have no gradient."""
    fit_to_folder: Callable[[Any, set[str]], Any] = lambda args, tensor_names: args
    """The args read from config.json, fitted to the tensor names the folder holds: DeepSeek
    V3's multi-token-prediction layers, which transformers' configs declare without saving."""
    carried_prefixes: tuple[str, ...] = ()
    """HF tensors the native model does not hold that an export copies from the folder it
    was loaded from, untouched (Qwen3.5's multi-token-prediction layers, ``mtp.``)."""
    hub_spelling: tuple[tuple[str, str], ...] = ()
    """(transformers' name prefix, the released checkpoint's) pairs, for a family whose hub
    folders use the lab's own names (DeepSeek V4's ``embed.weight``): a folder holding the
    first pair's released name is read in that spelling. Exports write transformers'."""


def find_hf_family(hf_config: dict[str, Any], where: Path) -> ModelSpec:
    """The registered family whose adapter reads this `model_type`."""
    model_type = hf_config.get("model_type")
    specs = [s for s in all_model_specs() if s.hf_adapter is not None]
    for spec in specs:
        if model_type in spec.hf_adapter.model_types:
            return spec
    supported = sorted(t for s in specs for t in s.hf_adapter.model_types)
    raise ValueError(
        f"{where}: model_type {model_type!r} is not supported; supported: {', '.join(supported)}"
    )


def read_hf_args(folder: str | os.PathLike[str]) -> tuple[ModelSpec, Any]:
    """The family and ModelArgs described by a folder's config.json, fitted to the tensors
    it holds (``HFAdapter.fit_to_folder``)."""
    path = inside(folder, "config.json")
    hf_config = read_json(path, "HF model config")
    spec = find_hf_family(hf_config, path)
    try:
        args = spec.hf_adapter.args_from_hf(hf_config)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{path}: cannot read a {spec.name} config: {err}") from err
    return spec, spec.hf_adapter.fit_to_folder(args, set(open_tensors(folder).keys()))


def build_hf_model(
    folder: str | os.PathLike[str],
    vocab_size: int | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> nn.Module:
    """The folder's architecture on the meta device, ready to parallelize and load;
    ``overrides`` replace args fields as in ``build_model``."""
    spec, args = read_hf_args(folder)
    if vocab_size is not None:
        args = dataclasses.replace(args, vocab_size=vocab_size)
    args = replace_args(spec.name, args, overrides or {})
    with torch.device("meta"):
        return spec.model_cls(args)


def load_hf(
    path: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    overrides: Mapping[str, Any] | None = None,
) -> nn.Module:
    """The native model of an HF folder, with its weights, on `device` in `dtype`;
    ``overrides`` replace args fields (``{"mtp_depth": 1}`` reads DeepSeek's MTP layer)."""
    model = build_hf_model(path, overrides=overrides)
    return materialize(model, device, hf_path=path).to(dtype)


def materialize(
    model: nn.Module, device: torch.device | str, hf_path: str | os.PathLike[str] | None = None
) -> nn.Module:
    """Allocate a meta (possibly already sharded) model on `device`: fresh init or HF weights.

    `init_weights` runs in both cases: it also computes buffers and re-ties embeddings.
    """
    model.to_empty(device=device)
    model.init_weights()
    if hf_path is not None:
        load_hf_weights(model, hf_path)
    return model


def load_hf_weights(model: nn.Module, folder: str | os.PathLike[str]) -> None:
    """Fill a materialized model (plain or DTensor-sharded) from an HF folder.

    Every missing, mis-shaped and integer-typed tensor is named in one error before anything
    is copied (`check_hf_weights`), and a tensor holding NaN or inf is refused as it is read
    (WeightError). Floating tensors are cast to the parameter's dtype as they are (a bf16
    folder into an fp32 model). A sharded parameter reads only its own rows of stacked
    experts. A folder whose config.json says ``quant_method: mxfp4`` (gpt-oss releases) or
    ``fp8`` (DeepSeek V3 / V4 releases: block-scaled FP8, FP4 experts) has its quantized
    tensors dequantized as they are read (``open_tensors``).
    """
    rules, tensors = _checked_sources(model, folder)
    params = named_tensors(model)
    with torch.no_grad():
        for rule in rules:
            _fill(params[rule.native], rule, tensors)


def hf_weight_readers(
    model: nn.Module, folder: str | os.PathLike[str]
) -> dict[str, Callable[[], torch.Tensor]]:
    """Native name -> a function that reads that whole tensor from an HF folder, in the
    model's dtype (tied weights under each name): the values `load_hf_weights` fills in,
    for a writer that takes them one at a time. `model` may be on meta; the folder is
    checked as `load_hf_weights` checks it, before anything is read."""
    rules, tensors = _checked_sources(model, folder)
    params = named_tensors(model)
    rule_of = {id(params[rule.native]): rule for rule in rules}

    def reader(param: torch.Tensor) -> Callable[[], torch.Tensor]:
        rule = rule_of[id(param)]
        return lambda: _read_rows(rule, tensors, slice(0, param.shape[0])).to(param.dtype)

    return {name: reader(param) for name, param in params.items() if id(param) in rule_of}


def check_hf_weights(model: nn.Module, folder: str | os.PathLike[str]) -> None:
    """Whether the folder's tensors fit `model` (meta will do), from the shards' headers only:
    what the pre-flight checks before launch. WeightError naming every missing, mis-shaped
    and integer-typed tensor; UnsafePath for a file outside the folder."""
    _checked_sources(model, folder)


def _checked_sources(
    model: nn.Module, folder: str | os.PathLike[str]
) -> tuple[list[KeyRule], Tensors]:
    """The model's rules and the folder's tensors, every missing, mis-shaped and integer-typed
    tensor (for a floating parameter: an integer cast to float is never a weight) named in one
    error."""
    tensors = open_tensors(folder)
    rules = hf_rules(model)
    params = named_tensors(model)
    missing, wrong, typed = [], [], []
    for rule in rules:
        param = params[rule.native]
        expected = tuple(param.shape)
        part = expected[1:] if len(rule.hf) > 1 else expected
        for key in rule.hf:
            if key not in tensors:
                missing.append(key)
            elif tensors.shape(key) != part:
                wrong.append(f"{key} has shape {tensors.shape(key)}, expected {part}")
            elif param.is_floating_point() and not tensors.dtype(key).is_floating_point:
                typed.append(f"{key} is {str(tensors.dtype(key)).removeprefix('torch.')}")
    problems = []
    if missing:
        problems.append(f"missing tensors: {describe(missing)}")
    if wrong:
        problems.append(f"mis-shaped tensors: {describe(wrong)}")
    if typed:
        problems.append(f"non-floating tensors for floating parameters: {describe(typed)}")
    if problems:
        raise WeightError(f"{folder}: does not fit {type(model).__name__}: " + "; ".join(problems))
    return rules, tensors


def open_tensors(folder: str | os.PathLike[str]) -> Tensors:
    """The folder's tensors by transformers' names, quantized weights read as their
    dequantized tensor when its config.json declares a quantization (MXFP4, or block-scaled
    FP8 / FP4: ``temper.models.quantized``), and a hub folder in its lab's own names
    (``HFAdapter.hub_spelling``) read under transformers'."""
    tensors: Tensors = SafetensorsFolder(folder)
    path = inside(folder, "config.json")
    if not path.is_file():
        return tensors
    config = read_json(path, "HF model config")
    quantization = config.get("quantization_config") or {}
    if quantization.get("quant_method") == "mxfp4":
        tensors = Mxfp4Folder(tensors)
    elif quantization:
        tensors = quantized_view(tensors, quantization)
    spelling = find_hf_family(config, path).hf_adapter.hub_spelling
    if spelling and spelling[0][1] in tensors and spelling[0][0] not in tensors:
        return HubSpelled(tensors, spelling)
    return tensors


class HubSpelled:
    """A folder's tensors in a lab's own names, seen under transformers' names."""

    def __init__(self, tensors: Tensors, spelling: tuple[tuple[str, str], ...]) -> None:
        self.tensors = tensors
        self.spelling = spelling
        names = tensors.keys()
        self._stored = {self._ours(key): key for key in names}

    def _ours(self, key: str) -> str:
        for ours, theirs in self.spelling:
            if key.startswith(theirs):
                return ours + key.removeprefix(theirs)
        return key

    def keys(self) -> list[str]:
        return sorted(self._stored)

    def __contains__(self, key: str) -> bool:
        return key in self._stored

    def shape(self, key: str) -> tuple[int, ...]:
        return self.tensors.shape(self._stored[key])

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors.dtype(self._stored[key])

    def read(self, key: str, rows: slice | None = None) -> torch.Tensor:
        return self.tensors.read(self._stored[key], rows)


Tensors = SafetensorsFolder | Mxfp4Folder | BlockScaledFolder | HubSpelled
"""A folder's tensors by name, as ``open_tensors`` gives them."""


def save_hf(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    extra_config: dict[str, Any] | None = None,
    generation_config: dict[str, Any] | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    carry_from: str | os.PathLike[str] | None = None,
) -> None:
    """Write safetensors shards, config.json and generation_config.json for `model`.

    `extra_config` adds fields the args do not carry (token ids, say); generation_config.json
    takes config.json's token ids, then `generation_config`'s fields. `carry_from` (the HF
    folder the model came from) gives the tensors the family carries without modelling them
    (``HFAdapter.carried_prefixes``), copied as they are. A sharded model must be gathered
    first (`full_tensor`); this writes what the process holds.
    """
    folder = Path(path)
    tensors = dict(hf_named_tensors(model))
    if carry_from is not None:
        # The model's own tensors win: a carried prefix may hold layers it models too.
        tensors = carried_tensors(model, carry_from) | tensors
    write_safetensors(folder, tensors, max_shard_bytes)
    dtype = next(model.parameters()).dtype
    write_hf_config(folder, model, dtype, extra_config, generation_config)


def carried_tensors(model: nn.Module, folder: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The tensors of the HF `folder` that `model`'s family carries through an export without
    modelling them (``HFAdapter.carried_prefixes``: a few layers, read whole), as stored."""
    prefixes = adapter_of(model).carried_prefixes
    if not prefixes:
        return {}
    source = open_tensors(folder)
    names = source.keys()
    return {key: source.read(key) for key in names if key.startswith(prefixes)}


def write_hf_config(
    folder: Path,
    model: nn.Module,
    dtype: torch.dtype,
    extra_config: dict[str, Any] | None = None,
    generation_config: dict[str, Any] | None = None,
) -> None:
    """config.json and generation_config.json of `model` (meta will do) as `save_hf` writes
    them, for weights of `dtype`."""
    config = {**adapter_of(model).args_to_hf(model.args), **(extra_config or {})}
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {
        k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config
    } | (generation_config or {})
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def hf_named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` for every tensor of the model's HF checkpoint, gathering one
    native parameter at a time (a collective on every rank when sharded), LoRA adapters merged
    into their base weights: what an inference server loads, without a whole copy in memory."""
    tensors = named_tensors(model)
    yielded: set[str] = set()
    adapters = {
        f"{name}.weight": m for name, m in model.named_modules() if isinstance(m, LoRALinear)
    }
    for rule in hf_rules(model):
        value = full_tensor(tensors[rule.native].detach())
        if rule.native in adapters:
            value = merged_weight(value, adapters[rule.native])
        if rule.native in yielded:  # a second HF copy (MTP's head): its own storage
            value = value.clone()
        yielded.add(rule.native)
        parts = [value] if len(rule.hf) == 1 else list(value.unbind(0))
        yield from zip(rule.hf, parts, strict=True)


def hf_module_names(model: nn.Module) -> dict[str, str]:
    """Native name -> HF name of every module whose weight is one HF tensor (each linear
    layer, ``layers.0.attention.wq`` -> ``model.layers.0.self_attn.q_proj``): how LoRA
    targets and adapters are named the Hugging Face way."""
    return {
        rule.native.removesuffix(".weight"): rule.hf[0].removesuffix(".weight")
        for rule in adapter_of(model).key_rules(model.args)
        if len(rule.hf) == 1 and rule.native.endswith(".weight")
    }


def adapter_of(model: nn.Module) -> HFAdapter:
    adapter = spec_of(model).hf_adapter
    if adapter is None:
        raise ValueError(f"{type(model).__name__} has no Hugging Face adapter")
    return adapter


def hf_rules(model: nn.Module) -> list[KeyRule]:
    """The rules of every HF tensor of `model`: its parameters', then its buffers'."""
    adapter = adapter_of(model)
    return adapter.key_rules(model.args) + adapter.buffer_rules(model.args)


def named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters (tied ones under every name) and buffers, by native name."""
    return {**dict(model.named_buffers()), **dict(model.named_parameters(remove_duplicate=False))}


def _fill(param: torch.Tensor, rule: KeyRule, tensors: Tensors) -> None:
    if not isinstance(param, DTensor):
        param.copy_(_read_rows(rule, tensors, slice(0, param.shape[0])))
        return
    local = param.to_local()
    offset = _global_offset(param)
    rows = slice(offset[0], offset[0] + local.shape[0])
    value = _read_rows(rule, tensors, rows)
    for dim in range(1, local.dim()):
        value = value.narrow(dim, offset[dim], local.shape[dim])
    local.copy_(value)


def _read_rows(rule: KeyRule, tensors: Tensors, rows: slice) -> torch.Tensor:
    """Rows `rows` of dim 0: a slice of one tensor, or a stack of only the needed experts."""
    if len(rule.hf) == 1:
        return tensors.read(rule.hf[0], rows)
    return torch.stack([tensors.read(key) for key in rule.hf[rows]])


def _global_offset(param: DTensor) -> Sequence[int]:
    _, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    return offset


def rope_from_hf(
    hf_config: dict[str, Any], supported: tuple[str, ...] = ("default", "llama3")
) -> tuple[float, RopeScaling | YarnScaling | None]:
    """(theta, scaling or None) from `rope_parameters` (transformers 5) or the older
    `rope_theta` + `rope_scaling` pair; a rope type the family does not list in `supported`
    (default, llama3, yarn) is refused by name."""
    params = hf_config.get("rope_parameters") or {
        "rope_theta": hf_config.get("rope_theta", 10000.0),
        **(hf_config.get("rope_scaling") or {}),
    }
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in supported:
        raise ValueError(
            f"rope type {rope_type!r} is not supported ({' and '.join(supported)} are)"
        )
    theta = float(params["rope_theta"])
    if rope_type == "default":
        return theta, None
    original = int(params["original_max_position_embeddings"])
    if rope_type == "llama3":
        return theta, RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=original,
        )
    optional = {
        k: float(params[k])
        for k in ("mscale", "mscale_all_dim", "attention_factor")
        if params.get(k) is not None
    }
    # transformers reads a missing or zero beta as its default.
    return theta, YarnScaling(
        factor=float(params["factor"]),
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        **optional,
    )


def rope_to_hf(theta: float, scaling: RopeScaling | YarnScaling | None) -> dict[str, Any]:
    """The `rope_parameters` entry of config.json (unset optional YaRN fields left out)."""
    if scaling is None:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    fields = {k: v for k, v in dataclasses.asdict(scaling).items() if v is not None}
    return {
        "rope_parameters": {
            "rope_type": "yarn" if isinstance(scaling, YarnScaling) else "llama3",
            "rope_theta": theta,
            **fields,
        }
    }
