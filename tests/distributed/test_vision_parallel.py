"""Vision-language training under SP, FSDP2 and EP equals one process (gloo, CPU).

``test_image_batch_on_sequence_slices_equals_one_process`` (fast): packed rows of the built-in
image task at SP 2 (51 tokens padded to 52; an image's tokens 25-28 cross the slices'
boundary at 26), CP 2 and CP 2 x SP 2 (23 tokens padded to 24; an image's tokens 3-6 cross
the chunk boundary at 6): the images are fused into the whole sequence, then each rank keeps
its tokens; the loss and every parameter's gradient (the tower's included) equal one
process's on the whole batch.

``test_layouts_train_like_one_process`` (slow): the debug VLM recipes at FSDP 2, SP 2 and
SP 2 x EP 2 (the MoE language model): every step's loss and gradient norm over 3 steps
within 1e-5 relative of one process training the same global micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from harness import run_on_ranks
from padded_slices import sp_and_reference
from training import SINGLE, Layout, assert_same_metrics, parity_config
from training import train as train_layout

from temper.config import Config
from temper.recipes.vision import qwen3_5_moe_vl_debug, qwen3_5_vl_debug

FSDP2 = Layout("fsdp2", world=2, local_batch=4)
SP2 = Layout("sp2", world=2, local_batch=4, parallelism={"sp": 2})
SP2_EP2 = Layout("sp2_ep2", world=2, local_batch=4, parallelism={"sp": 2, "ep": 2})
CASES = [(qwen3_5_vl_debug, FSDP2), (qwen3_5_vl_debug, SP2), (qwen3_5_moe_vl_debug, SP2_EP2)]


IMAGE_LAYOUTS = [("sp2", 2, 51), ("cp2", 2, 23), ("cp2_sp2", 4, 23)]
"""(layout, ranks, tokens per row)."""


@pytest.mark.parametrize(
    ("layout", "world", "seq_len"), IMAGE_LAYOUTS, ids=[name for name, _, _ in IMAGE_LAYOUTS]
)
def test_image_batch_on_sequence_slices_equals_one_process(
    layout: str, world: int, seq_len: int
) -> None:
    got, want = run_on_ranks(_image_rank, world, layout, seq_len)[0]
    assert got["image_crosses_ranks"]  # some image's tokens sit on two ranks
    assert got["loss"].item() == pytest.approx(want["loss"].item(), rel=1e-6)
    assert got["grads"].keys() == want["grads"].keys()
    assert any(name.startswith("visual.") for name in got["grads"])
    for name, grad in got["grads"].items():
        scale = want["grads"][name].abs().max().item()
        assert scale > 0, name  # every weight, the tower's included, gets a gradient
        torch.testing.assert_close(grad, want["grads"][name], rtol=1e-5, atol=1e-5 * scale)


def _layout(name: str) -> Any:
    """The layout ``name`` over the world (started): Ulysses SP, CP, or CP 2 x SP 2 on the
    meshes the trainer builds."""
    import torch.distributed as dist

    from temper.config import Parallelism
    from temper.parallel.context_parallel import ContextParallel
    from temper.parallel.dims import ParallelDims
    from temper.parallel.ulysses import SequenceParallel

    if name == "sp2":
        return SequenceParallel(dist.group.WORLD)
    if name == "cp2":
        return ContextParallel(dist.group.WORLD)
    dims = ParallelDims.from_config(Parallelism(cp=2, sp=2), 4, dist.get_rank())
    world = dims.build_meshes("cpu").world
    groups = (world[name].get_group() for name in ("cp", "sp", "cp_sp"))
    return ContextParallel(*groups)


def _image_rank(layout: str, seq_len: int) -> tuple[dict[str, Any], dict[str, Any]] | None:
    import torch.distributed as dist

    from temper.config import Config, Data
    from temper.data.batch import SEQUENCE_SHARD
    from temper.data.loader import build_loader
    from temper.data.tokenizer import load_tokenizer
    from temper.objectives import CausalLM

    reference, model, parallel = sp_and_reference("qwen3_5_vl", layout=lambda: _layout(layout))

    config = Config(data=Data(format="sft", builtin_images=True, builtin_examples=8))
    config.training.seq_len, config.training.local_batch_size = seq_len, 2
    batch = next(iter(build_loader(config, load_tokenizer(None), 0, 1)))
    shard = parallel.shard(batch)

    def run(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        loss, _, _ = CausalLM().loss(model, batch)
        loss.backward()
        grads = {}
        for name, p in model.named_parameters():
            grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            if model is not reference:
                dist.all_reduce(grad)
            grads[name] = grad
        return {"loss": loss.detach(), "grads": grads}

    got = run(model, shard)
    dist.all_reduce(got["loss"])
    want = run(reference, batch)
    # Which rank holds each column of the padded rows, from the shard's layout.
    info = shard[SEQUENCE_SHARD]
    order = torch.arange(info.seq_len) if info.columns is None else info.columns
    owner = torch.empty(info.seq_len, dtype=torch.long)
    owner[order] = torch.arange(info.seq_len) // (info.seq_len // dist.get_world_size())
    image = batch["input_ids"] == reference.args.image_token_id
    split = image[:, 1:] & image[:, :-1] & (owner[1:seq_len] != owner[: seq_len - 1])
    got["image_crosses_ranks"] = bool(split.any())
    dist.barrier()
    return (got, want) if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def references() -> dict[str, Any]:
    return {}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("recipe", "layout"), CASES, ids=[f"{r.__name__}-{layout.name}" for r, layout in CASES]
)
def test_layouts_train_like_one_process(
    recipe: Callable[[], Config],
    layout: Layout,
    tmp_path_factory: pytest.TempPathFactory,
    references: dict[str, Any],
) -> None:
    folder = tmp_path_factory.mktemp(recipe.__name__)

    def config(layout: Layout) -> Config:
        c = parity_config(recipe, folder, layout)
        c.training.seq_len = 48
        c.data.builtin_examples = 96
        return c

    if recipe.__name__ not in references:
        references[recipe.__name__] = train_layout(config(SINGLE), SINGLE)
    run = train_layout(config(layout), layout)
    assert_same_metrics(run.rows, references[recipe.__name__].rows)


def test_sp_slices_keep_the_images_whole() -> None:
    """7 tokens over 2 ranks: each slice has all the pixels and grids, the whole padded ids
    for fusion and its part of the multimodal positions."""
    from temper.data.batch import FUSION_INPUT_IDS, SEQUENCE_SHARD
    from temper.parallel.ulysses import shard_batch

    ids = torch.arange(7)[None]
    batch = {
        "input_ids": ids,
        "labels": ids,
        "pixel_values": torch.randn(16, 8),
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
        "rope_position_ids": torch.arange(21).view(3, 1, 7),
    }
    for rank in range(2):
        shard = shard_batch(batch, rank, 2)
        assert shard["pixel_values"] is batch["pixel_values"]
        assert shard["image_grid_thw"] is batch["image_grid_thw"]
        assert shard[FUSION_INPUT_IDS].tolist() == [[0, 1, 2, 3, 4, 5, 6, 0]]
        assert shard[SEQUENCE_SHARD].start == 4 * rank
        want = torch.nn.functional.pad(batch["rope_position_ids"], (0, 1))[..., 4 * rank :][..., :4]
        assert torch.equal(shard["rope_position_ids"], want)


def test_cp_ranks_keep_the_images_whole() -> None:
    """7 tokens at CP 2 (padded to 8, chunks of 2): each rank has all the pixels and grids,
    the whole padded ids for fusion and the multimodal positions of its chunks (rank 0:
    columns 0, 1, 6, 7; rank 1: 2-5)."""
    from temper.data.batch import FUSION_INPUT_IDS
    from temper.parallel.context_parallel import shard_batch

    ids = torch.arange(1, 8)[None]
    rope = torch.arange(21).view(3, 1, 7)
    batch = {
        "input_ids": ids,
        "labels": ids,
        "pixel_values": torch.randn(16, 8),
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
        "rope_position_ids": rope,
    }
    for rank, columns in enumerate(([0, 1, 6, 7], [2, 3, 4, 5])):
        shard = shard_batch(batch, rank, 2)
        assert shard["pixel_values"] is batch["pixel_values"]
        assert shard["image_grid_thw"] is batch["image_grid_thw"]
        assert shard[FUSION_INPUT_IDS].tolist() == [[1, 2, 3, 4, 5, 6, 7, 0]]
        want = torch.nn.functional.pad(rope, (0, 1))[..., columns]
        assert torch.equal(shard["rope_position_ids"], want)
        assert shard["input_ids"].tolist() == [[c + 1 if c < 7 else 0 for c in columns]]
