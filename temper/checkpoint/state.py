"""Split a nested training state into tensors (for DCP) and a JSON skeleton (the rest).

DCP would pickle non-tensor values and unpickle them on load; keeping them in JSON
means loading a checkpoint never executes pickled code, and the small values
(step, lr, data position) stay readable in a text file.
"""

from __future__ import annotations

from typing import Any

import torch

TENSOR = "__tensor__"
INT_KEYS = "__int_keys__"


def split_tensors(state: Any, prefix: str = "") -> tuple[dict[str, torch.Tensor], Any]:
    """(tensors by dotted path, the same structure with each tensor replaced by its path)."""
    if isinstance(state, torch.Tensor):
        return {prefix: state}, {TENSOR: prefix}
    if isinstance(state, dict):
        tensors: dict[str, torch.Tensor] = {}
        skeleton: dict[str, Any] = {}
        for key, value in state.items():
            if not isinstance(key, str | int):
                raise TypeError(f"{prefix or 'state'}: key {key!r} is not a str or int")
            found, skeleton[str(key)] = split_tensors(
                value, f"{prefix}.{key}" if prefix else str(key)
            )
            tensors.update(found)
        int_keys = [str(k) for k in state if isinstance(k, int)]
        if int_keys:  # JSON keys are strings; remember which were ints
            skeleton = {INT_KEYS: int_keys, "items": skeleton}
        return tensors, skeleton
    if isinstance(state, list | tuple):
        tensors, items = {}, []
        for index, value in enumerate(state):
            found, item = split_tensors(value, f"{prefix}.{index}")
            tensors.update(found)
            items.append(item)
        return tensors, items
    if state is None or isinstance(state, bool | int | float | str):
        return {}, state
    raise TypeError(f"{prefix}: cannot checkpoint a {type(state).__name__}")


def join_tensors(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of `split_tensors` (tuples come back as lists)."""
    if isinstance(skeleton, dict):
        if TENSOR in skeleton and len(skeleton) == 1:
            return tensors[skeleton[TENSOR]]
        if INT_KEYS in skeleton:
            ints = set(skeleton[INT_KEYS])
            return {
                int(k) if k in ints else k: join_tensors(v, tensors)
                for k, v in skeleton["items"].items()
            }
        return {k: join_tensors(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [join_tensors(item, tensors) for item in skeleton]
    return skeleton
