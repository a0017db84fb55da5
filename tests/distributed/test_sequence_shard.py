"""Sequence and expert parallelism as explicit joints of the decoder (gloo, 2 ranks, CPU).

The decoder learns that its input is a slice from the batch's ``SequenceShard``: attention
masks are built at the whole sequence's length, and selective activation checkpointing keeps
the outputs of attention and of the SP/EP all-to-alls, so a backward sends nothing twice.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from harness import run_on_ranks
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
ALL_TO_ALL = "_c10d_functional.all_to_all_single.default"
EAGER_ALL_TO_ALL = "c10d.alltoall_base_.default"
ATTENTION = "aten._scaled_dot_product_flash_attention_for_cpu.default"


def test_flex_on_unpacked_rows_masks_the_whole_sequence() -> None:
    """Flex on continuous rows at SP 2 (15 tokens, padded to 16): the decoder builds flex's
    whole-row mask at the padded global length that attention sees after its all-to-all (a
    mask at the local 8 failed attention's shape check), and the real tokens' logits and the
    MoE load-balancing loss are one process's on the unpadded rows. Forward only: flex has no
    backward on CPU."""
    got, want = run_on_ranks(_flex_unpacked_rank, 2)[0]
    torch.testing.assert_close(got["logits"], want["logits"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["aux"], want["aux"], rtol=1e-6, atol=0)


def _flex_unpacked_rank() -> tuple[dict[str, Any], dict[str, Any]] | None:
    import torch.distributed as dist

    from temper.data.batch import SEQUENCE_SHARD
    from temper.models import build_model
    from temper.objectives.causal_lm import documents
    from temper.parallel.ulysses import SequenceParallel
    from temper.utils.device import init_runtime

    init_runtime()
    torch.manual_seed(0)
    reference = build_model("qwen3_moe", "debug", device="cpu")
    model = build_model("qwen3_moe", "debug", device="cpu")
    model.load_state_dict(reference.state_dict())
    sp = SequenceParallel(dist.group.WORLD)
    sp.apply(model)
    reference.attn_backend = model.attn_backend = "flex"

    ids = torch.randint(1, 1000, (2, 15), generator=torch.Generator().manual_seed(1))
    shard = sp.shard({"input_ids": ids, "labels": ids})
    assert shard["input_ids"].shape == (2, 8) and documents(shard) is None
    with torch.no_grad():
        logits = model(shard["input_ids"], shard["position_ids"], shard=shard[SEQUENCE_SHARD])
        got = {"logits": torch.cat(_gather(logits), dim=1)[:, :15], "aux": model.aux_loss()}
        want = {"logits": reference(ids), "aux": reference.aux_loss()}
    dist.barrier()
    return (got, want) if dist.get_rank() == 0 else None


def _gather(x: torch.Tensor) -> list[torch.Tensor]:
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return parts


def test_selective_checkpoint_runs_no_attention_or_all_to_all_again() -> None:
    """Qwen3-MoE at SP 2 x EP 2 on a packed batch: the backward of selective checkpointing
    runs as many all-to-alls and fused attention forwards as the backward without
    checkpointing (only the gradients' own all-to-alls, no attention forward), while full
    checkpointing re-runs both, so the count sees recomputation; all three give the same
    gradients."""
    runs = run_on_ranks(_checkpoint_ops_rank, 2)
    for counts, grads in runs:
        none, selective, full = (counts[mode] for mode in ("none", "selective", "full"))
        assert none[ATTENTION] == 0 and none[ALL_TO_ALL] > 0
        assert selective[ALL_TO_ALL] == none[ALL_TO_ALL]
        assert selective[ATTENTION] == 0 and selective[EAGER_ALL_TO_ALL] == 0
        # Full reruns each block: its Ulysses pair and expert all-to-alls, its attention.
        assert full[ALL_TO_ALL] > none[ALL_TO_ALL] and full[ATTENTION] > 0
        for mode in ("selective", "full"):
            for grad, grad_none in zip(grads[mode], grads["none"], strict=True):
                torch.testing.assert_close(grad, grad_none, rtol=1e-5, atol=1e-6)


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _checkpoint_ops_rank() -> tuple[dict[str, Counter[str]], dict[str, list[torch.Tensor]]]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from temper.models import build_model
    from temper.objectives import CausalLM
    from temper.parallel.activation_checkpoint import apply_activation_checkpointing
    from temper.parallel.expert import apply_expert_parallel
    from temper.parallel.ulysses import SequenceParallel
    from temper.utils.device import init_runtime

    init_runtime()
    mesh = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("edp", "efsdp", "ep"))
    sp = SequenceParallel(dist.group.WORLD)
    ids = torch.randint(1, 1000, (2, 16), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(7), torch.arange(9)]).expand(2, 16)
    shard = sp.shard({"input_ids": ids, "labels": ids.roll(-1, 1), "position_ids": positions})
    counts, grads = {}, {}
    for mode in ("none", "selective", "full"):
        torch.manual_seed(0)
        model = build_model("qwen3_moe", "debug", device="cpu")
        sp.apply(model)
        apply_expert_parallel(model, mesh)
        apply_activation_checkpointing(model.layers, mode)
        loss, _, _ = CausalLM().loss(model, shard)
        with _CountOps() as ops:
            loss.backward()
        counts[mode] = ops.counts
        grads[mode] = [
            (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
            for p in model.parameters()
        ]
    dist.barrier()
    return counts, grads
