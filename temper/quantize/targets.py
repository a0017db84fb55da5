"""Which linear layers a quantization scheme may touch."""

from __future__ import annotations

from torch import nn


def block_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The plain ``nn.Linear`` layers inside ``model.layers`` that are not a router's or a
    gate's: the projections that hold nearly all of a decoder's weights. The LM head and
    embeddings (vocabulary-sized, precision-sensitive) and routers and gates (a few outputs
    whose ranking rounding would perturb) are left alone."""
    chosen = []
    for name, module in model.named_modules():
        parts = name.split(".")
        if (
            type(module) is nn.Linear
            and parts[0] == "layers"
            and "router" not in parts
            and not parts[-1].endswith("gate")
        ):
            chosen.append((name, module))
    return chosen
