"""Random init of sharded parameters that gives the same weights for every layout.

A random fill of a DTensor shard draws only the shard's numbers, so the weights would
depend on how the model is split (on CPU every shard even gets the same numbers). Under
`layout_invariant_init`, an in-place random fill of a DTensor draws the whole tensor from
the generator, exactly as one process would, and keeps this rank's part; a DTensor read as
a Python value (`bool`, `item`) is read whole. The cost is one full-size temporary of the
tensor being filled and every rank drawing every tensor.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from temper.utils.compat import OpOverload, TorchDispatchMode

_TO_PYTHON = {torch.ops.aten.is_nonzero.default, torch.ops.aten._local_scalar_dense.default}


def layout_invariant_init() -> AbstractContextManager[Any]:
    """Context for `init_weights` of a sharded model: any layout gets one process's weights."""
    return _FullTensorDraws()


class _FullTensorDraws(TorchDispatchMode):
    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if not (args and isinstance(args[0], DTensor)):
            return func(*args, **kwargs)
        target = args[0]
        if func in _TO_PYTHON:
            # Init code that branches on data (trunc_normal_ redraws until no value is out
            # of range) must branch on the whole tensor, or ranks and layouts draw apart.
            return func(target.full_tensor(), *args[1:], **kwargs)
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **kwargs)
        if not func._schema.name.endswith("_"):
            raise NotImplementedError(
                f"{func} creates a new random DTensor during init; fill the parameter in place "
                "(e.g. nn.init.normal_) so every layout draws the same numbers"
            )
        local = target.to_local()
        full = torch.empty(target.shape, dtype=target.dtype, device=local.device)
        func(full, *args[1:], **kwargs)
        mine = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
        local.copy_(mine.to_local())
        return target
