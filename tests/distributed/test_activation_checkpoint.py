"""Activation checkpointing recomputes what its mode says, and nothing changes the result."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from temper.models import build_model
from temper.models.layers.rope import rope_cos_sin
from temper.parallel.activation_checkpoint import apply_activation_checkpointing

aten = torch.ops.aten


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[Any] = Counter()

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(mode: str) -> tuple[Counter[Any], torch.Tensor, list[torch.Tensor]]:
    """Ops run by the backward of one debug Llama block in `mode`; its output and grads."""
    torch.manual_seed(0)
    model = build_model("llama3", "debug", device="cpu")
    block = copy.deepcopy(model.layers[0])
    apply_activation_checkpointing([block], mode)
    x = torch.randn(2, 16, model.args.dim, requires_grad=True)
    cos, sin = rope_cos_sin(model.inv_freq, torch.arange(16)[None])
    out = block(x, cos, sin)
    with _CountOps() as ops:
        out.square().sum().backward()
    return ops.counts, out.detach(), [x.grad, *(p.grad for p in block.parameters())]


def test_modes_recompute_what_they_say() -> None:
    none, out_none, grads_none = _backward_ops("none")
    full, out_full, grads_full = _backward_ops("full")
    selective, out_sel, grads_sel = _backward_ops("selective")
    # Backward alone runs no forward op; full reruns the forward (up to the last projection,
    # whose output backward does not need), selective reruns only what is not a matmul or
    # attention (the SwiGLU's silu among them).
    sdpa = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert none[sdpa] == none[aten.silu.default] == 0
    assert full[aten.mm.default] == none[aten.mm.default] + 6 and full[sdpa] == 1
    assert selective[aten.mm.default] == none[aten.mm.default] and selective[sdpa] == 0
    assert full[aten.silu.default] == selective[aten.silu.default] == 1
    for out, grads in ((out_full, grads_full), (out_sel, grads_sel)):
        torch.testing.assert_close(out, out_none, rtol=0, atol=0)
        for grad, grad_none in zip(grads, grads_none, strict=True):
            torch.testing.assert_close(grad, grad_none)


def test_names_of_parameters_do_not_change() -> None:
    model = build_model("llama3", "debug")
    names = [name for name, _ in model.named_parameters()]
    apply_activation_checkpointing(model.layers, "full")
    assert [name for name, _ in model.named_parameters()] == names
