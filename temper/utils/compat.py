"""Every private torch API Temper uses, in one place, each with the torch versions it was
checked on (2.11 and 2.13: CI runs ``tests/unit`` on both, 2.11 in ``.ci/torch-floor``). Code
imports these names from here, so a torch upgrade that moves one breaks this module, not a
training run, and ``tests/unit/test_compat.py`` names it. A public API is used instead
wherever one exists.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# Intercepting aten calls (layout-invariant random init), and the type of the ops it sees.
# Checked: 2.11, 2.13; no public module holds them in these versions.
from torch._ops import OpOverload

# Traceable collectives: a differentiable uneven all-to-all (EP dispatch, Ulysses head
# exchange), a plain one (EP split sizes: its output, unlike the in-place c10d call's, is
# kept by selective activation checkpointing) and an all-reduce (MoE balancing statistics
# over ranks). Checked: 2.11, 2.13.
# torch.distributed.nn.functional has autograd collectives too, but not uneven all-to-all
# on gloo in these versions.
from torch.distributed._functional_collectives import all_reduce as functional_all_reduce
from torch.distributed._functional_collectives import all_to_all_single as functional_all_to_all
from torch.distributed._functional_collectives import all_to_all_single_autograd

# What a DCP ``.metadata`` pickle holds besides the public dataclasses of
# torch.distributed.checkpoint.metadata: the file reader's per-item record (file, offset,
# length), a tensor's memory-format code and torch's layout lookup (how a layout pickles).
# The restricted unpickler of temper.checkpoint.reader admits exactly these. Checked: 2.13;
# the same names and modules are in DCP's source since 2.4, so in 2.11 too.
from torch.distributed.checkpoint.filesystem import _StorageInfo as dcp_storage_info
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING as dcp_memory_format
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

# A DTensor shard's offset in the global tensor (reading only a shard's rows of an HF
# checkpoint). Checked: 2.11, 2.13. No public equivalent.
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

# FSDP2's placement for a dim that expert parallelism already shards (experts over efsdp
# after ep); not a Shard subclass, and only under a private name. Checked: 2.13.
from torch.distributed.tensor.placement_types import Placement, Shard, _StridedShard
from torch.serialization import _get_layout as layout_by_name
from torch.utils._python_dispatch import TorchDispatchMode

# ``outside_dispatch_modes()``: a context that runs ops past every active dispatch mode (a
# one-off probe that must not count as one of a checkpointed region's ops). Checked: 2.11,
# 2.13. No public equivalent.
from torch.utils._python_dispatch import _disable_current_modes as outside_dispatch_modes

# The ops selective activation checkpointing passes through uncounted
# (``sac_ignores_profiler_annotations`` below). In ``torch.utils.checkpoint.__all__``, though
# undocumented. Checked: 2.11, 2.13.
from torch.utils.checkpoint import SAC_IGNORED_OPS as sac_ignored_ops


def sac_ignores_profiler_annotations() -> None:
    """Selective activation checkpointing lets the profiler's annotations (``record_function``)
    through without counting them. SAC replays a recomputation op by op, by each op's count;
    FSDP's hooks annotate a recomputation differently from its forward (a nested unit, such
    as the experts' under EP, annotates ``FSDP::root_pre_forward`` when recomputed), and SAC
    then refuses the region as nondeterministic. An annotation does no tensor work; a torch
    change (pytorch/pytorch#196862) ignores them the same way. ``SAC_IGNORED_OPS``, which
    torch's SAC modes consult at each op: checked 2.11, 2.13."""
    profiler = torch.ops.profiler
    sac_ignored_ops.update(
        {
            profiler._record_function_enter.default,
            profiler._record_function_enter_new.default,
            profiler._record_function_exit.default,
            profiler._record_function_exit._RecordFunction,
        }
    )


def dynamic_size(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """``tensor`` with ``dim`` marked dynamic for torch.compile, which then traces one graph
    for every size of it instead of one per size, also under ``dynamic=False`` (the static
    cache's filled length). Checked: 2.11, 2.13. No public equivalent (``torch.compiler`` has
    none)."""
    from torch._dynamo import mark_dynamic

    mark_dynamic(tensor, dim)
    return tensor


grouped_mm = torch._grouped_mm
"""Grouped GEMM over expert groups (``offs``); CUDA SM80+ bf16, and CPU fp32/bf16 in 2.13.
Checked: 2.11, 2.13. No public equivalent."""

foreach_norm = torch._foreach_norm
foreach_mul_ = torch._foreach_mul_
"""Multi-tensor norm and scale (gradient clipping over many shards). Checked: 2.11, 2.13."""


flex_attention_op = torch.ops.higher_order.flex_attention
"""The higher-order op FlexAttention runs as (what selective checkpointing sees). Checked:
2.11, 2.13."""


def sharded_dim(placement: Placement) -> int | None:
    """The tensor dim a DTensor placement splits (plain or FSDP2's strided shard), None for a
    replicated or partial one."""
    if isinstance(placement, (Shard, _StridedShard)):
        return placement.dim
    return None


def init_fake_process_group(rank: int, world_size: int) -> None:
    """Join a process group of ``world_size`` ranks as ``rank`` in this process alone: torch's
    fake backend, whose collectives return at once without data (the planner builds a large
    layout's meshes and FSDP units with it). Only torch's test package has it. Checked: 2.13."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def record_memory_history(enabled: bool, max_entries: int = 100_000) -> None:
    """Start (or stop and discard) recording the CUDA allocator's history of allocations and
    frees with their stacks (the latest ``max_entries``), what a memory snapshot shows.
    ``torch.cuda.memory`` offers it only under private names. Checked: 2.11, 2.13."""
    torch.cuda.memory._record_memory_history(
        enabled="all" if enabled else None, max_entries=max_entries
    )


def dump_memory_snapshot(path: str) -> None:
    """Write the recorded history as the pickle that pytorch.org/memory_viz opens. Checked:
    2.11, 2.13."""
    torch.cuda.memory._dump_snapshot(path)


def _optional_op(namespace: str, name: str) -> Any:
    """An op's default overload, or None where this torch build does not register it."""
    try:
        return getattr(getattr(torch.ops, namespace), name).default
    except (AttributeError, RuntimeError):
        return None


def varlen_attention_op() -> Any:
    """The op behind ``torch.nn.attention.varlen.varlen_attn``, which that module registers
    (importing it imports dynamo, so only when asked). Checked: 2.13; None in a build that
    does not register it, where varlen is not run either."""
    import torch.nn.attention.varlen  # noqa: F401

    return _optional_op("torch_attn", "_varlen_attn")


def fused_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's fused attention kernel that also returns the log-sum-exp (ring attention merges
    blocks by it; ``F.scaled_dot_product_attention`` does not return it): q [b, h, s_q, d],
    k, v [b, h_kv, s_k, d] (h a multiple of h_kv; one head size) -> output [b, h, s_q, d] in
    q's dtype and log-sum-exp [b, h, s_q] (fp32). ``causal``: square, query i sees keys up to
    i. CPU: the flash kernel (any float dtype, GQA natively); CUDA: the flash kernel (fp16 and
    bf16: ``fused_attention_runs``), k and v repeated per query head. Checked: 2.11, 2.13 on
    CPU; the CUDA branch has not run (no GPU was lent when it was written)."""
    if q.device.type == "cuda":
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )[:2]
        return out, lse
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale
    )


def fused_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of ``fused_attention_forward`` for the given output and log-sum-exp, which
    may be those of more keys than k holds (the whole row's, after ring attention's merge):
    the kernel recomputes this block's probabilities as exp(scores - lse) and the row term as
    grad_out . out, so each block's share of the gradient comes out exactly. Shapes as the
    forward's; dk, dv [b, h_kv, s_k, d]. Checked: 2.11, 2.13 on CPU; CUDA not run."""
    if q.device.type == "cuda":
        groups = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
        # No dropout: the dense (not varlen) kernel, and no random state to replay.
        rng = torch.zeros(2, dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out,
            q,
            k,
            v,
            out,
            lse,
            None,
            None,
            q.shape[2],
            k.shape[2],
            0.0,
            causal,
            rng,
            rng,
            scale=scale,
        )
        b, _, s, d = dk.shape
        dk, dv = (t.view(b, -1, groups, s, t.shape[-1]).sum(dim=2) for t in (dk, dv))
        return dq, dk, dv
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, causal, scale=scale
    )


def fused_attention_runs(q: torch.Tensor) -> bool:
    """Whether ``fused_attention_forward`` runs on q's device and dtype: on CPU any float
    dtype, on CUDA fp16 or bf16 (flash's). (It also needs one head size for q, k and v.)"""
    if q.device.type == "cuda":
        return q.dtype in (torch.float16, torch.bfloat16)
    return q.device.type == "cpu"


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """``mesh``'s dims as one named dim, registered on its root mesh, where DTensor looks for
    it to run a redistribution over several dims as one collective instead of one per dim.
    DeviceMesh offers this only as the private ``_flatten``. Checked: 2.11, 2.13."""
    return mesh._flatten(name)


def fsdp_reshard_states(unit: FSDPModule) -> list[Any]:
    """Whether each param group of an FSDP2 unit frees its gathered weights after forward.
    FSDP2 offers the public setter ``set_reshard_after_forward`` but no getter; this reads
    the private state so it can be restored exactly. Checked: 2.11, 2.13."""
    return [group.post_forward_mesh_info for group in _param_groups(unit)]


def restore_fsdp_reshard_states(unit: FSDPModule, states: list[Any]) -> None:
    """Put back what ``fsdp_reshard_states`` read."""
    for group, state in zip(_param_groups(unit), states, strict=True):
        group.post_forward_mesh_info = state


def replace_fsdp_sharded_param(model: nn.Module, module: nn.Module, name: str, param: Any) -> None:
    """Make ``param`` (a DTensor whose local tensor is this rank's shard, in the shape FSDP2
    gave the old one) the sharded parameter ``module.<name>`` of the FSDP2 unit that manages
    it, including a local tensor subclass with FSDP2's all-gather extensions (torchao's
    NF4Tensor). FSDP2 swaps parameters only via ``load_state_dict(assign=True)`` for the same
    tensor type and reads the extensions once, in its private ``FSDPParam``; this sets both.
    Checked: 2.11, 2.13 (tests/distributed/test_qlora_fsdp.py ran on both)."""
    for unit in model.modules():
        if not isinstance(unit, FSDPModule):
            continue
        for group in _param_groups(unit):
            for fsdp_param in group.fsdp_params:
                info = fsdp_param._module_info
                if info.module is module and info.param_name == name:
                    setattr(module, name, param)
                    # A subclass's storage cannot be compared with the old plain shard's.
                    fsdp_param._sharded_param_data = param._local_tensor.view(-1)
                    fsdp_param.reset_sharded_param()
                    fsdp_param._init_extensions()
                    return
    raise ValueError(f"no FSDP2 unit of the model manages {name} of {type(module).__name__}")


def _param_groups(unit: FSDPModule) -> list[Any]:
    state = unit._get_fsdp_state()
    if hasattr(state, "_fsdp_param_groups"):  # 2.13: a list of groups
        return list(state._fsdp_param_groups)
    group = state._fsdp_param_group  # 2.11: one group or None
    return [] if group is None else [group]


__all__ = [
    "OpOverload",
    "TorchDispatchMode",
    "all_to_all_single_autograd",
    "compute_local_shape_and_global_offset",
    "flatten_mesh",
    "fused_attention_backward",
    "fused_attention_forward",
    "fused_attention_runs",
    "dcp_memory_format",
    "dcp_storage_info",
    "dump_memory_snapshot",
    "foreach_mul_",
    "functional_all_reduce",
    "functional_all_to_all",
    "foreach_norm",
    "flex_attention_op",
    "fsdp_reshard_states",
    "grouped_mm",
    "layout_by_name",
    "outside_dispatch_modes",
    "init_fake_process_group",
    "record_memory_history",
    "replace_fsdp_sharded_param",
    "restore_fsdp_reshard_states",
    "sharded_dim",
    "varlen_attention_op",
]
