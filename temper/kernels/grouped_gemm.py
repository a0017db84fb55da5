"""Grouped GEMM for mixture-of-experts: rows sorted by group, one weight matrix per group.

``grouped_mm`` runs ``torch._grouped_mm`` on CUDA in bf16 where its layout rules hold and on
CPU in fp32 or bf16 where this torch build has the CPU kernel, and the plain-PyTorch loop
over groups everywhere else; the loop is also the reference that tests hold the fast path to.

Both run inside one opaque custom op, ``torch.ops.temper.grouped_mm`` (its backward another
two: itself for the rows' gradient and ``temper::grouped_mm_weight_grad`` for the weights'),
so ``torch.compile`` sees a single node with a known output shape, never the loop's host read
of the group sizes or the fast path's pointer checks: a block with experts compiles to one
graph (``fullgraph=True``) and a decode step does not recompile for each token's groups.
"""

from __future__ import annotations

import functools

import torch

from temper.utils.compat import grouped_mm as torch_grouped_mm
from temper.utils.compat import outside_dispatch_modes

_ALIGN_BYTES = 16
"""torch._grouped_mm needs 16-byte aligned data pointers and leading strides (CPU too)."""


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x[rows of g] @ w[g]`` for every group g: x [T, K], w [G, K, N] -> [T, N].

    ``offsets`` [G] int32 holds each group's cumulative end row, so ``offsets[-1] == T``. Both
    operands are cast to the autocast dtype when autocast is on, since ``torch._grouped_mm`` is
    not on autocast's lists.
    """
    if x.device.type == "meta":  # the planner's shape-only forward: no autocast, no offsets
        return grouped_mm_shapes(x, w)
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
    else:
        dtype = torch.promote_types(x.dtype, w.dtype)
    x, w = x.to(dtype).contiguous(), w.to(dtype)
    return grouped_mm_op(x, w, offsets)


@torch.library.custom_op("temper::grouped_mm", mutates_args=())
def grouped_mm_op(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The grouped GEMM as one op: x [T, K], w [G, K, N] of one dtype -> [T, N];
    ``torch._grouped_mm`` where it fits, else the loop. Rows past ``offsets[-1]`` are zero."""
    if _fast_path_fits(x, w):
        return torch_grouped_mm(x, w, offs=offsets)
    return grouped_mm_reference(x, w, offsets)


@grouped_mm_op.register_fake
def _grouped_mm_shape(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.custom_op("temper::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(
    x: torch.Tensor, grad: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """``x[rows of g].T @ grad[rows of g]`` for every group g: x [T, K], grad [T, N] ->
    [G, K, N] (zero for an empty group); ``torch._grouped_mm`` where it fits, else a loop."""
    if _fast_path_fits(x.mT, grad):
        return torch_grouped_mm(x.mT, grad, offs=offsets)
    ends = offsets.tolist()
    sizes = [e - s for s, e in zip([0, *ends[:-1]], ends, strict=True)]
    pairs = zip(x[: ends[-1]].split(sizes), grad[: ends[-1]].split(sizes), strict=True)
    return torch.stack([xg.mT @ gg for xg, gg in pairs])


@grouped_mm_weight_grad.register_fake
def _weight_grad_shape(x: torch.Tensor, grad: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(offsets.shape[0], x.shape[-1], grad.shape[-1])


def _save_operands(ctx: object, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
    x, w, offsets = inputs
    ctx.save_for_backward(x, w, offsets)  # type: ignore[attr-defined]


def _grouped_mm_backward(
    ctx: object, grad: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
    x, w, offsets = ctx.saved_tensors  # type: ignore[attr-defined]
    grad = grad.contiguous()  # e.g. sum()'s expanded gradient, which _grouped_mm rejects
    needs_x, needs_w, _ = ctx.needs_input_grad  # type: ignore[attr-defined]
    grad_x = grouped_mm_op(grad, w.mT, offsets) if needs_x else None
    grad_w = grouped_mm_weight_grad(x, grad, offsets) if needs_w else None
    return grad_x, grad_w, None


grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_save_operands)


def grouped_mm_reference(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """One matmul per group; runs on any device and dtype (reads ``offsets`` on the host).

    ``split`` and ``unbind`` rather than slicing and indexing: their backward concatenates
    the pieces' gradients once, where each slice or index would add a zero tensor the size
    of all rows (all experts) per group (measured 9x slower at 64 experts on CPU). Rows past
    the last group (none, as the experts call it) come out zero, as the op's shape says."""
    ends = offsets.tolist()
    sizes = [e - s for s, e in zip([0, *ends[:-1]], ends, strict=True)]
    rows = x[: ends[-1]].split(sizes)
    out = [r @ wg for r, wg in zip(rows, w.unbind(0), strict=True)]
    if ends[-1] < x.shape[0]:
        out.append(x.new_zeros(x.shape[0] - ends[-1], w.shape[-1]))
    return torch.cat(out)


def grouped_mm_shapes(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """On meta: a matmul with the grouped GEMM's output shape that, like it, saves ``x`` (and a
    weight) for backward; the group sizes, which only real data has, change neither."""
    return x @ w[0]


def grouped_mm_fast(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm``; its backward fails on a non-contiguous (e.g. expanded) gradient,
    so a hook hands it a contiguous one. A hook, not an identity autograd Function: that
    returns a view, and FSDP2 (expert FSDP wraps the experts) warns that an in-place op on a
    module's view output would drop its pre-backward hook."""
    out = torch_grouped_mm(x, w, offs=offsets)
    if out.requires_grad:
        out.register_hook(lambda grad: grad.contiguous())
    return out


def _fast_path_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Both operands' leading strides and pointers 16-byte aligned, and: on CPU, fp32 or bf16
    if the kernel exists; on CUDA, SM80+ and bf16. Asked inside the custom op only, which
    torch.compile does not trace (its shape rule for ``_grouped_mm`` takes bf16 only)."""
    if x.device.type == "cpu":
        if x.dtype not in (torch.float32, torch.bfloat16):
            return False
        supported = _cpu_kernel_exists(x.dtype)
    else:
        supported = (
            x.is_cuda
            and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (8, 0)
        )
    return supported and all(_aligned(t) for t in (x, w))


@functools.cache
def _cpu_kernel_exists(dtype: torch.dtype) -> bool:
    """Builds without the op's CPU kernel declare it all the same: ask once, past any
    dispatch mode, since the first ask can come inside a selectively checkpointed block,
    whose recomputation (the answer cached) would otherwise find one grouped GEMM fewer
    than its forward saved, and take each saved output for the one before it."""
    try:
        with outside_dispatch_modes():
            torch_grouped_mm(
                torch.ones(8, 8, dtype=dtype),
                torch.ones(1, 8, 8, dtype=dtype),
                offs=torch.tensor([8], dtype=torch.int32),
            )
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _aligned(t: torch.Tensor) -> bool:
    """Row- or column-major in the last two dims, with the non-unit stride 16-byte aligned."""
    rows, cols = t.stride()[-2:]
    if cols == 1:
        lead = rows
    elif rows == 1:
        lead = cols
    else:
        return False
    size = t.element_size()
    return (lead * size) % _ALIGN_BYTES == 0 and t.data_ptr() % _ALIGN_BYTES == 0
