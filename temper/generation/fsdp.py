"""FSDP2 during a rollout: gather each unit's weights once, keep them until the rollout ends."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

from torch import nn
from torch.distributed.fsdp import FSDPModule

from temper.utils.compat import fsdp_reshard_states, restore_fsdp_reshard_states

_GATHERED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Models inside a ``gathered_weights`` region: a nested region (``generate`` within a
rollout) keeps the outer one's weights instead of resharding them on its way out."""


@contextlib.contextmanager
def gathered_weights(model: nn.Module) -> Iterator[None]:
    """All-gather every FSDP2 unit of ``model`` on entry and reshard them all on exit, so
    decoding costs one all-gather per unit for the whole rollout instead of one per unit per
    token, and needs no collective between tokens (ranks may stop after different numbers of
    steps). Memory: the whole model, gathered, on every rank. A model without FSDP is left as
    it is.

    Units free their weights after each forward when ``reshard_after_forward`` is set; it is
    cleared with FSDP2's public setter and restored from what ``temper.utils.compat`` read
    (FSDP2 has no public getter). The root (``model`` itself) is left alone: FSDP2 already
    keeps its weights after forward, and its first forward would overwrite the setting
    (lazy initialization). Nested regions on one model gather once: the outermost owns it.
    """
    if model in _GATHERED:
        yield
        return
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    inner = [unit for unit in units if unit is not model]
    saved = [fsdp_reshard_states(unit) for unit in inner]
    for unit in inner:
        unit.set_reshard_after_forward(False, recurse=False)
    _GATHERED.add(model)
    try:
        handles = [unit.unshard(async_op=True) for unit in units]
        for handle in handles:
            handle.wait()
        yield
    finally:
        _GATHERED.discard(model)
        for unit, states in zip(inner, saved, strict=True):
            restore_fsdp_reshard_states(unit, states)
        for unit in units:
            unit.reshard()
