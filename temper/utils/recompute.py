"""A marker for code that eager selective activation checkpointing recomputes whole.

Compiled code (`apply_compile`'s parts, the compiled FlexAttention kernel) runs its ops
without passing them through the dispatcher one by one, so selective checkpointing cannot
keep what they return: in forward nothing is stored, and a recomputation that asked for a
kept output would not find it. Worse, the ops such code does call through the dispatcher
(extern matmuls, collectives) write into buffers the compiled code reuses for later values,
so a kept output could be overwritten before the recomputation reads it (SAC's version check
does not see such writes). Code run inside `recomputed_whole` keeps nothing and is run again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_depth = 0


@contextlib.contextmanager
def recomputed_whole() -> Iterator[None]:
    """Inside, selective checkpointing keeps no op's output."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def inside_recomputed_whole() -> bool:
    return _depth > 0
