"""FSDP2 during a rollout: gather each unit's weights once, keep them until the rollout ends."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.distributed.fsdp import FSDPModule


@contextlib.contextmanager
def gathered_weights(model: nn.Module) -> Iterator[None]:
    """All-gather every FSDP2 unit of ``model`` on entry and reshard them all on exit, so
    decoding costs one all-gather per unit for the whole rollout instead of one per unit per
    token, and needs no collective between tokens (ranks may stop after different numbers of
    steps). Memory: the whole model, gathered, on every rank. A model without FSDP is left as
    it is.

    Units free their weights after each forward when ``reshard_after_forward`` is set; FSDP2
    has no public getter for that setting, so it is cleared and restored on the units' param
    groups directly. The root (``model`` itself) is left alone: FSDP2 already keeps its weights
    after forward, and its first forward would overwrite the setting (lazy initialization).
    """
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    groups = [
        group
        for unit in units
        if unit is not model
        for group in unit._get_fsdp_state()._fsdp_param_groups
    ]
    saved = [group.post_forward_mesh_info for group in groups]
    for group in groups:
        group.post_forward_mesh_info = None
    try:
        handles = [unit.unshard(async_op=True) for unit in units]
        for handle in handles:
            handle.wait()
        yield
    finally:
        for group, info in zip(groups, saved, strict=True):
            group.post_forward_mesh_info = info
        for unit in units:
            unit.reshard()
