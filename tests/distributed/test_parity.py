"""Every layout trains the model one process trains: FSDP2, HSDP, checkpointing, compile.

Llama 3 debug (untied) and Qwen3 debug (tied embedding and head) recipes, random init.
fp32 on CPU: each step's loss and gradient norm within 1e-5 relative of one process
accumulating the same global batch (compile: 1e-4, its kernels fuse and reorder sums).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import pytest
import torch
from training import FSDP2, FSDP4, HSDP2X2, SINGLE, Layout, Run, assert_same_metrics, parity_config
from training import train as train_layout

from temper.config import Config
from temper.models import materialize, save_hf
from temper.models.llama3 import FLAVORS, Transformer
from temper.recipes.llama3 import llama3_debug
from temper.recipes.qwen3 import qwen3_debug

pytestmark = pytest.mark.slow

BLOCKS = {"layers.0", "layers.1", "layers.2", "layers.3"}
UNTIED_UNITS = {"", "tok_embeddings", *BLOCKS, "norm", "output"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("parity")


@pytest.fixture(scope="module")
def references() -> dict[str, Run]:
    """One single-process run per recipe, trained on first use."""
    return {}


def reference(recipe: Callable[[], Config], folder: Path, cache: dict[str, Run]) -> Run:
    if recipe.__name__ not in cache:
        run = train_layout(parity_config(recipe, folder / recipe.__name__, SINGLE), SINGLE)
        assert run.fsdp_units == [] and run.param_dtypes == ["torch.float32"]
        cache[recipe.__name__] = run
    return cache[recipe.__name__]


@pytest.fixture
def llama_reference(folder: Path, references: dict[str, Run]) -> Run:
    return reference(llama3_debug, folder, references)


@pytest.mark.parametrize("layout", [FSDP2, HSDP2X2, FSDP4], ids=lambda layout: layout.name)
@pytest.mark.parametrize("recipe", [llama3_debug, qwen3_debug], ids=lambda r: r.__name__)
def test_layouts_train_like_one_process(
    recipe: Callable[[], Config], layout: Layout, folder: Path, references: dict[str, Run]
) -> None:
    run = train_layout(parity_config(recipe, folder / recipe.__name__, layout), layout)
    tied = recipe is qwen3_debug  # Qwen3's small sizes tie the head to the embedding
    assert run.tied is tied
    assert set(run.fsdp_units) == ({"", *BLOCKS} if tied else UNTIED_UNITS)
    assert run.param_dtypes == ["torch.float32"]
    assert_same_metrics(run.rows, reference(recipe, folder, references).rows)


@pytest.mark.parametrize(
    ("mode", "reshard"), [("full", "always"), ("selective", "never")], ids=["full", "selective"]
)
def test_activation_checkpointing_keeps_the_losses(
    mode: str, reshard: str, llama_reference: Run, folder: Path
) -> None:
    config = parity_config(llama3_debug, folder / f"ac_{mode}", FSDP2)
    config.activation_checkpoint.mode = mode
    config.parallelism.fsdp_reshard_after_forward = reshard
    assert_same_metrics(train_layout(config, FSDP2).rows, llama_reference.rows)


def test_compiled_blocks_keep_the_losses(llama_reference: Run, folder: Path) -> None:
    config = parity_config(llama3_debug, folder / "compile", FSDP2)
    config.compile.enable = True
    config.activation_checkpoint.mode = "selective"
    run = train_layout(config, FSDP2)
    assert run.compiled_graphs == 1 and llama_reference.compiled_graphs == 0  # one for 4 blocks
    assert_same_metrics(run.rows, llama_reference.rows, rel=1e-4)


def test_bf16_shards_compute_in_bf16_from_fp32_masters(llama_reference: Run, folder: Path) -> None:
    config = parity_config(llama3_debug, folder / "bf16", FSDP2)
    config.training.dtype = "bfloat16"
    config.training.steps = 2  # bf16 matmuls are slow on CPU; the first steps do not see steps
    run = train_layout(config, FSDP2)
    assert run.param_dtypes == ["torch.float32"]
    losses = [row["loss"] for row in run.rows]
    reference = [row["loss"] for row in llama_reference.rows[:2]]
    assert losses == pytest.approx(reference, rel=1e-2)
    assert losses != pytest.approx(reference, rel=1e-6)  # bf16 rounding shows: it is not fp32


def _tied_llama_folder(folder: Path) -> Path:
    """A tied debug Llama with the built-in tokenizer, as an HF folder."""
    path = folder / "tied_hf"
    if not path.exists():
        with torch.device("meta"):
            model = Transformer(dataclasses.replace(FLAVORS["debug"], tie_embeddings=True))
        torch.manual_seed(1)
        save_hf(materialize(model, "cpu"), path)
    return path


def _tied_config(folder: Path, layout: Layout) -> Config:
    config = parity_config(llama3_debug, folder / "tied", layout)
    config.model.hf_path = str(_tied_llama_folder(folder))
    config.data.tokenizer_path = str(resources.files("temper.assets") / "tokenizer.json")
    return config


def test_tied_embedding_and_head_share_one_unit_and_load_into_shards(folder: Path) -> None:
    reference = train_layout(_tied_config(folder, SINGLE), SINGLE)
    run = train_layout(_tied_config(folder, FSDP2), FSDP2)
    assert reference.tied and run.tied
    assert set(run.fsdp_units) == {"", *BLOCKS}
    assert_same_metrics(run.rows, reference.rows)
