"""The global gradient norm over gradients sharded on different meshes, and one clip factor."""

from __future__ import annotations

import pytest
import torch
from harness import run_on_ranks

MAX_NORMS = (1.0, float("inf"))


def _clip_on_two_meshes() -> list[dict[str, object]]:
    """Gradient A sharded 4 ways (rows 2, 2, 2, 0), B replicated x2 and sharded x2 (unevenly)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from temper.parallel.grad_norm import clip_grad_norm_

    dist.init_process_group("gloo")
    fsdp = init_device_mesh("cpu", (4,), mesh_dim_names=("fsdp",))
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    gen = torch.Generator().manual_seed(0)
    full = {"a": torch.randn(6, 3, generator=gen), "b": torch.randn(5, 4, generator=gen)}
    layouts = {"a": (fsdp, [Shard(0)]), "b": (hsdp, [Replicate(), Shard(0)])}
    results = []
    for max_norm in MAX_NORMS:
        params = []
        for name, grad in full.items():
            mesh, placements = layouts[name]
            param = torch.nn.Parameter(distribute_tensor(torch.zeros_like(grad), mesh, placements))
            param.grad = distribute_tensor(grad, mesh, placements)
            params.append(param)
        norm = clip_grad_norm_(params, max_norm)
        assert not isinstance(norm, DTensor)
        results.append({"norm": norm, "clipped": [p.grad.full_tensor() for p in params]})
    return [{"full": full, "results": results}]


@pytest.mark.slow
def test_norm_and_clip_match_the_whole_tensors() -> None:
    ranks = run_on_ranks(_clip_on_two_meshes, 4)
    full = ranks[0][0]["full"]
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in full.values()]).double())
    assert expected > 1.0  # so max_norm 1 does clip
    for rank in ranks:
        for max_norm, result in zip(MAX_NORMS, rank[0]["results"], strict=True):
            assert result["norm"].item() == pytest.approx(expected.item(), rel=1e-6)
            scale = min(1.0, max_norm / (expected.item() + 1e-6))
            for clipped, grad in zip(result["clipped"], full.values(), strict=True):
                torch.testing.assert_close(clipped, grad * scale)
