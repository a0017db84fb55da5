"""Ulysses sequence parallelism trains the model one process trains.

Llama 3, Qwen3 and Qwen3-MoE debug recipes at SP 2 and at SP 2 x FSDP 2, and Qwen3-MoE at
SP 2 x EP 2: each layout's losses and gradient norms over ``training.STEPS`` (5) steps of
8 x 32 tokens are within 1e-5 relative of one process accumulating the same global batch
(``training.py``; 32 tokens rather than its 64 keep the 12 runs inside CI's time). Qwen3-MoE
also trains at 31 tokens, padded to 32 over the SP ranks, and so does DeepSeek V3, whose expert
bias moves after each step by a load that must leave the padding out. Runs use the trainer's
default kernels.

Every layout's global micro-batch holds the reference's micro-batch (data ranks take rows in
turn), so the MoE load-balancing loss, which is not a sum over tokens and is taken over all
ranks' tokens, is comparable too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import run_on_ranks
from padded_slices import sp_and_reference
from training import SINGLE, STEPS, Layout, Run, assert_same_metrics, parity_config
from training import train as train_layout

from temper.config import Config
from temper.recipes.deepseek_v3 import deepseek_v3_debug
from temper.recipes.llama3 import llama3_debug
from temper.recipes.qwen3 import qwen3_debug, qwen3_moe_debug

pytestmark = pytest.mark.slow

SP2 = Layout("sp2", world=2, local_batch=4, parallelism={"sp": 2})
SP2_FSDP2 = Layout("sp2_fsdp2", world=4, local_batch=2, parallelism={"sp": 2})
SP2_EP2 = Layout("sp2_ep2", world=2, local_batch=4, parallelism={"sp": 2, "ep": 2})
SEQ_LEN = 32
RECIPES = (llama3_debug, qwen3_debug, qwen3_moe_debug)
CASES = [
    *((recipe, layout) for layout in (SP2, SP2_FSDP2) for recipe in RECIPES),
    (qwen3_moe_debug, SP2_EP2),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ulysses")


@pytest.fixture(scope="module")
def references() -> dict[tuple[str, int], Run]:
    """One single-process run per recipe and sequence length, trained on first use."""
    return {}


def _config(recipe: Callable[[], Config], folder: Path, layout: Layout, seq_len: int) -> Config:
    config = parity_config(recipe, folder / f"{recipe.__name__}_{seq_len}", layout)
    config.training.seq_len = seq_len
    return config


def _check(
    recipe: Callable[[], Config],
    layout: Layout,
    folder: Path,
    references: dict[tuple[str, int], Run],
    seq_len: int = SEQ_LEN,
) -> None:
    key = (recipe.__name__, seq_len)
    if key not in references:
        references[key] = train_layout(_config(recipe, folder, SINGLE, seq_len), SINGLE)
    run = train_layout(_config(recipe, folder, layout, seq_len), layout)
    assert len(run.rows) == STEPS
    assert_same_metrics(run.rows, references[key].rows)


@pytest.mark.parametrize(
    ("recipe", "layout"), CASES, ids=[f"{r.__name__}-{layout.name}" for r, layout in CASES]
)
def test_layouts_train_like_one_process(
    recipe: Callable[[], Config],
    layout: Layout,
    folder: Path,
    references: dict[tuple[str, int], Run],
) -> None:
    _check(recipe, layout, folder, references)


def test_padded_sequences_train_like_unpadded(
    folder: Path, references: dict[tuple[str, int], Run]
) -> None:
    """31 tokens pad to 32 at SP 2; the losses and grad norms are those of 31 unpadded."""
    _check(qwen3_moe_debug, SP2, folder, references, seq_len=SEQ_LEN - 1)


def test_padding_stays_out_of_the_expert_bias_load(folder: Path) -> None:
    """DeepSeek V3's aux-loss-free balancing at SP 2 on 31 tokens padded to 32: the load that
    moves the expert bias after each step counts real tokens only, so steps 2 and 3 (routed
    with the moved bias) still train like one process on the unpadded 31 (1e-5)."""
    runs = []
    for layout in (SINGLE, SP2):
        config = _config(deepseek_v3_debug, folder, layout, SEQ_LEN - 1)
        config.training.steps = 3
        runs.append(train_layout(config, layout))
    single, sp2 = runs
    assert len(sp2.rows) == 3
    assert_same_metrics(sp2.rows, single.rows)


def test_padding_gets_no_gradient_and_changes_nothing() -> None:
    """A packed batch of 15 tokens (documents of 6 and 9) padded to 16 over 2 SP ranks: every
    real token's logits, the loss with the MoE load-balancing term, and every parameter's
    gradient equal one process's on the unpadded batch."""
    got, want = run_on_ranks(_padded_batch_rank, 2)[0]
    torch.testing.assert_close(got["logits"], want["logits"], rtol=1e-5, atol=1e-5)
    assert got["loss"].item() == pytest.approx(want["loss"].item(), rel=1e-6)
    assert got["grads"].keys() == want["grads"].keys()
    for name, grad in got["grads"].items():
        # Summed losses give large gradients; rank-split sums differ from one sum by ~1e-7.
        scale = want["grads"][name].abs().max().item()
        torch.testing.assert_close(grad, want["grads"][name], rtol=1e-5, atol=1e-5 * scale)


def _padded_batch_rank() -> tuple[dict[str, Any], dict[str, Any]] | None:
    import torch.distributed as dist

    from temper.objectives import CausalLM
    from temper.objectives.causal_lm import documents

    reference, model, sp = sp_and_reference("qwen3_moe")

    ids = torch.randint(1, 1000, (2, 15), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1, dims=1)
    positions = torch.cat([torch.arange(6), torch.arange(9)]).expand(2, 15)
    batch = {"input_ids": ids, "labels": labels, "position_ids": positions}
    shard = sp.shard(batch)
    assert shard["input_ids"].shape == (2, 8)

    def run(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        loss, _, _ = CausalLM().loss(model, batch)
        loss.backward()
        grads = {}
        for name, p in model.named_parameters():
            grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            if dist.get_world_size() > 1 and model is not reference:
                dist.all_reduce(grad)
            grads[name] = grad
        return {"loss": loss.detach(), "grads": grads}

    with torch.no_grad():
        logits = model(shard["input_ids"], shard["position_ids"], documents(shard))
    logits = torch.cat(_gather(logits), dim=1)[:, :15]
    got = run(model, shard)
    dist.all_reduce(got["loss"])
    got["logits"] = logits
    with torch.no_grad():
        want_logits = reference(ids, positions, documents(batch))
    want = run(reference, batch)
    want["logits"] = want_logits
    dist.barrier()  # the ranks' pending collectives finish before any rank exits
    return (got, want) if dist.get_rank() == 0 else None


def _gather(x: torch.Tensor) -> list[torch.Tensor]:
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return parts
