"""Model families by name, so configs and user modules can name or add them."""

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from temper.config import Parallelism
from temper.models.fit import check_decoder_layout
from temper.utils.registry import Registry

if TYPE_CHECKING:
    from temper.models.hf import HFAdapter


@dataclass(frozen=True)
class ModelSpec:
    """A model family: its named argument sets and the module built from one of them.

    ``hf_adapter`` (a ``temper.models.hf.HFAdapter``) reads and writes HF folders;
    ``check_layout(args, parallelism)`` raises ConfigError when the degrees do not fit the
    architecture (experts over EP, heads over SP).
    """

    name: str
    flavors: Mapping[str, Any]
    model_cls: type[nn.Module]
    hf_adapter: "HFAdapter | None" = None
    check_layout: Callable[[Any, Parallelism], None] = check_decoder_layout


_SPECS: Registry[ModelSpec] = Registry("model")


def register_model(spec: ModelSpec) -> ModelSpec:
    """Add a family; a name can be registered once."""
    return _SPECS.add(spec.name, spec)


get_model_spec = _SPECS.get
model_names = _SPECS.names
all_model_specs = _SPECS.values


def spec_of(model: nn.Module) -> ModelSpec:
    """The registered family that built `model`: the most derived class in its MRO wins,
    since wrappers such as FSDP2 subclass the model's class and families may share bases."""
    by_class = {spec.model_cls: spec for spec in _SPECS.values()}
    for cls in type(model).__mro__:
        if cls in by_class:
            return by_class[cls]
    raise ValueError(f"{type(model).__name__} is not a registered model family")


def build_model(
    name: str,
    flavor: str,
    *,
    device: torch.device | str = "meta",
    vocab_size: int | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> nn.Module:
    """Build a flavor on the meta device; on any other device also allocate and init weights.

    ``vocab_size`` replaces the flavor's, e.g. to fit a tokenizer; ``overrides`` other args
    fields (``model.mtp_depth``, say; see ``replace_args``).
    """
    spec = get_model_spec(name)
    if flavor not in spec.flavors:
        raise ValueError(
            f"unknown flavor {flavor!r} for model {name!r}; flavors: {', '.join(spec.flavors)}"
        )
    args = spec.flavors[flavor]
    if vocab_size is not None:
        args = dataclasses.replace(args, vocab_size=vocab_size)
    args = replace_args(name, args, overrides or {})
    with torch.device("meta"):
        model = spec.model_cls(args)
    if torch.device(device).type != "meta":
        from temper.models.hf import materialize

        materialize(model, device)
    return model


def replace_args(family: str, args: Any, overrides: Mapping[str, Any]) -> Any:
    """``args`` with the config's ``model.<field>`` ``overrides``; a field the family's args
    lack fails by name."""
    fields = {f.name for f in dataclasses.fields(args)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(
            f"model.{unknown[0]} is not a setting of the {family} family "
            f"({type(args).__name__} has no such field)"
        )
    return dataclasses.replace(args, **overrides) if overrides else args
