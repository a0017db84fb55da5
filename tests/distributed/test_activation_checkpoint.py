"""Activation checkpointing recomputes what its mode says, and nothing changes the result."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from temper.kernels.attention import ATTENTION_OPS, Backend, attention
from temper.models import build_model
from temper.models.layers.context import ForwardContext
from temper.models.layers.rope import rope_cos_sin
from temper.parallel.activation_checkpoint import _save_matmuls, apply_activation_checkpointing

aten = torch.ops.aten
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[Any] = Counter()
        # Flex attention is a higher-order op; counted like the others.
        self.supports_higher_order_operators = True

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(
    mode: str, device: str = "cpu", dtype: torch.dtype = torch.float32, backend: Backend = "auto"
) -> tuple[Counter[Any], torch.Tensor, list[torch.Tensor]]:
    """Ops run by the backward of one debug Llama block in `mode`; its output and grads."""
    torch.manual_seed(0)
    model = build_model("llama3", "debug", device=device)
    block = copy.deepcopy(model.layers[0]).to(dtype)
    apply_activation_checkpointing([block], mode)
    x = torch.randn(2, 16, model.args.dim, device=device, dtype=dtype, requires_grad=True)
    cos, sin = rope_cos_sin(model.inv_freq, torch.arange(16, device=device)[None])
    out, _ = block(x, ForwardContext(cos, sin, backend=backend))
    with _CountOps() as ops:
        out.square().sum().backward()
    return ops.counts, out.detach(), [x.grad, *(p.grad for p in block.parameters())]


def test_modes_recompute_what_they_say() -> None:
    none, out_none, grads_none = _backward_ops("none")
    full, out_full, grads_full = _backward_ops("full")
    selective, out_sel, grads_sel = _backward_ops("selective")
    # Backward alone runs no forward op but the one silu the SwiGLU reference recomputes
    # instead of keeping; full reruns the forward (up to the last projection, whose output
    # backward does not need), selective reruns only what is not a matmul or attention (the
    # SwiGLU's silu among them).
    sdpa = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert none[sdpa] == 0 and none[aten.silu.default] == 1
    assert full[aten.mm.default] == none[aten.mm.default] + 6 and full[sdpa] == 1
    assert selective[aten.mm.default] == none[aten.mm.default] and selective[sdpa] == 0
    assert full[aten.silu.default] == selective[aten.silu.default] == 2
    for out, grads in ((out_full, grads_full), (out_sel, grads_sel)):
        torch.testing.assert_close(out, out_none, rtol=0, atol=0)
        for grad, grad_none in zip(grads, grads_none, strict=True):
            torch.testing.assert_close(grad, grad_none)


def test_names_of_parameters_do_not_change() -> None:
    model = build_model("llama3", "debug")
    names = [name for name, _ in model.named_parameters()]
    apply_activation_checkpointing(model.layers, "full")
    assert [name for name, _ in model.named_parameters()] == names


def test_selective_keeps_the_output_of_flex_attention() -> None:
    """Flex computes attention in a higher-order op, not in an aten kernel; selective keeps its
    output too. FlexAttention has no backward on CPU (no input may need a gradient), so this
    checks the policy's decision inside a checkpointed forward; a CUDA backward is counted
    below."""
    decisions: list[tuple[Any, CheckpointPolicy]] = []

    def recording(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        decisions.append((op, _save_matmuls(ctx, op, *args, **kwargs)))
        return decisions[-1][1]

    q = torch.randn(1, 16, 2, 8)
    checkpoint(
        lambda q: attention(q, q, q, backend="flex"),
        q,
        use_reentrant=False,
        context_fn=lambda: create_selective_checkpoint_contexts(recording),
    )
    policies = {op: policy for op, policy in decisions}
    assert policies[torch.ops.higher_order.flex_attention] == CheckpointPolicy.MUST_SAVE


@cuda
@pytest.mark.parametrize("backend", ["sdpa", "flex", "varlen"])
def test_selective_runs_no_attention_again_on_cuda(backend: Backend) -> None:
    """bf16 on CUDA, each backend: selective's backward runs no attention forward (flex,
    a compiled kernel whose output cannot be kept, runs again as under full), full's runs
    one; the gradients are the uncheckpointed ones."""

    def attention_forwards(counts: Counter[Any]) -> int:
        return sum(counts[op] for op in ATTENTION_OPS)

    none, _, grads_none = _backward_ops("none", "cuda", torch.bfloat16, backend)
    selective, _, grads_sel = _backward_ops("selective", "cuda", torch.bfloat16, backend)
    full, _, _ = _backward_ops("full", "cuda", torch.bfloat16, backend)
    assert attention_forwards(none) == 0
    assert attention_forwards(selective) == (1 if backend == "flex" else 0)
    assert attention_forwards(full) == 1
    for grad, grad_none in zip(grads_sel, grads_none, strict=True):
        torch.testing.assert_close(grad, grad_none)


def test_selective_replays_a_region_that_annotates_its_recomputation_more_often() -> None:
    """FSDP's hooks annotate a recomputation with more ``record_function`` calls than its
    forward (EP's experts unit inside a block); selective checkpointing counts ops to replay
    them, and without `sac_ignores_profiler_annotations` refuses such a region."""
    runs: list[int] = []

    def region(x: torch.Tensor) -> torch.Tensor:
        runs.append(1)
        for _ in runs:  # one annotation in the forward, two in the recomputation
            with torch.profiler.record_function("annotation"):
                pass
        return (x @ x).sin()

    block = torch.nn.Module()
    block.forward = region
    apply_activation_checkpointing([block], "selective")
    x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    block.forward(x).sum().backward()
    reference = x.detach().requires_grad_()
    (reference @ reference).sin().sum().backward()
    assert len(runs) == 2  # the forward and its recomputation
    torch.testing.assert_close(x.grad, reference.grad, rtol=0, atol=0)
