"""Training runs for the distributed tests: one recipe in several layouts, metrics back.

Every layout trains the same global batch of 8 sequences per step; the reference is one
process doing it as 2 accumulated micro-batches of 4. Three steps: the first compares the
gradients, the next two the updates made from the optimizer's sharded state (Adam's moments
after one and after two updates).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import run_on_ranks

from temper.config import Config

STEPS = 3
GLOBAL_BATCH = 8


@dataclass(frozen=True)
class Layout:
    name: str
    world: int
    local_batch: int
    parallelism: dict[str, Any] = field(default_factory=dict)


SINGLE = Layout("single", world=1, local_batch=4)
FSDP2 = Layout("fsdp2", world=2, local_batch=4)
HSDP2X2 = Layout("hsdp2x2", world=4, local_batch=2, parallelism={"dp_replicate": 2})
FSDP4 = Layout("fsdp4", world=4, local_batch=2)


@dataclass(frozen=True)
class Run:
    """What rank 0 saw: the logged metrics and how the model was wrapped and compiled."""

    rows: list[dict[str, float]]
    fsdp_units: list[str]
    tied: bool
    param_dtypes: list[str]
    compiled_graphs: int


def parity_config(recipe: Callable[[], Config], folder: Path, layout: Layout) -> Config:
    """`recipe` shortened to STEPS steps of GLOBAL_BATCH x 64 tokens, laid out as `layout`."""
    config = recipe()
    config.job.dump_folder = str(folder / layout.name)
    config.training.steps = STEPS
    config.training.seq_len = 64
    config.training.local_batch_size = layout.local_batch
    config.training.global_batch_size = GLOBAL_BATCH
    config.metrics.tensorboard = False
    for name, value in layout.parallelism.items():
        setattr(config.parallelism, name, value)
    return config


def train(config: Config, layout: Layout) -> Run:
    """Train `config` on `layout.world` gloo ranks; rank 0's view of the run."""
    return run_on_ranks(_train_rank, layout.world, config)[0]


def assert_same_metrics(
    rows: list[dict[str, float]], reference: list[dict[str, float]], rel: float = 1e-5
) -> None:
    """Every step's loss and gradient norm within `rel` of the reference's."""
    steps = [row["step"] for row in rows]
    assert steps == [row["step"] for row in reference] == list(range(1, len(steps) + 1))
    for row, ref in zip(rows, reference, strict=True):
        assert row["loss"] == pytest.approx(ref["loss"], rel=rel), f"step {row['step']}"
        assert row["grad_norm"] == pytest.approx(ref["grad_norm"], rel=rel), f"step {row['step']}"


def assert_same_logits_loss_and_grads(
    family: str, got: dict[str, Any], want: dict[str, Any]
) -> None:
    """A layout's real tokens' logits, loss and every gradient (summed over the ranks) equal
    one process's within 1e-5, each gradient's tolerance scaled by its largest entry."""
    torch.testing.assert_close(got["logits"], want["logits"], rtol=1e-5, atol=1e-5)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), family
    assert got["grads"].keys() == want["grads"].keys()
    for name, grad in got["grads"].items():
        scale = want["grads"][name].abs().max().item()
        torch.testing.assert_close(
            grad, want["grads"][name], rtol=1e-5, atol=1e-5 * scale, msg=f"{family} {name}"
        )


def families_against_one_process(
    parallel: Any,
    families: tuple[str, ...],
    documents: tuple[int, ...],
    gather: Callable[[torch.Tensor], torch.Tensor],
    overrides: dict[str, Any] | None = None,
) -> list[tuple[dict[str, Any], dict[str, Any]]] | None:
    """On rank 0, per family: the logits, loss, the loss's metrics and rank-summed gradients
    of its debug model (with ``overrides`` to its args) wired by ``parallel`` (a sequence- or
    context-parallel layout: ``apply``, ``shard``) on two packed rows of ``documents``
    (``gather``: this rank's logits -> the whole rows'), and the same weights' on the whole
    rows in one process."""
    import torch.distributed as dist

    from temper.data.batch import SEQUENCE_SHARD
    from temper.models import build_model, materialize
    from temper.objectives import CausalLM
    from temper.objectives.causal_lm import documents as document_mask
    from temper.parallel.ulysses import whole_sequences

    s = sum(documents)
    ids = torch.randint(1, 1000, (2, s), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(n) for n in documents]).expand(2, s)
    batch = {"input_ids": ids, "labels": ids.roll(-1, dims=1), "position_ids": positions}
    shard = parallel.shard(batch)

    def run(model: torch.nn.Module, rows: dict[str, Any], split: bool) -> dict[str, Any]:
        """Loss, gradients and logits; ``split``: the rows are this rank's part."""
        model.zero_grad(set_to_none=True)
        loss, _, metrics = CausalLM().loss(model, rows)
        loss.backward()
        with torch.no_grad():
            args = (rows["input_ids"], rows["position_ids"], document_mask(rows))
            logits = model(*args, shard=rows.get(SEQUENCE_SHARD))
        grads = {}
        for name, p in model.named_parameters():
            grads[name] = (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
            if split:
                dist.all_reduce(grads[name])
        if split:
            dist.all_reduce(loss)
            logits = gather(logits)[:, :s]
        values = {name: float(value) for name, value in metrics.items()}
        return {"logits": logits, "loss": loss.item(), "grads": grads, "metrics": values}

    results = []
    for family in families:
        torch.manual_seed(0)
        model = build_model(family, "debug", overrides=overrides)
        parallel.apply(model)
        model = materialize(model, "cpu")
        with whole_sequences(model):  # the same weights on one rank's whole rows
            want = run(model, batch, split=False)
        results.append((run(model, shard, split=True), want))
    return results if dist.get_rank() == 0 else None


def _train_rank(config: Config) -> Run | None:
    from torch._dynamo.utils import counters
    from torch.distributed.fsdp import FSDPModule

    from temper.trainer import Trainer

    trainer = Trainer(config)
    trainer.train()
    if not trainer.engine.runtime.is_main:
        return None
    model = trainer.engine.model
    metrics = Path(config.job.dump_folder) / "metrics.jsonl"
    return Run(
        rows=[json.loads(line) for line in metrics.read_text().splitlines()],
        fsdp_units=[name for name, m in model.named_modules() if isinstance(m, FSDPModule)],
        tied=model.output.weight is model.tok_embeddings.weight,
        param_dtypes=sorted({str(p.dtype) for p in model.parameters()}),
        compiled_graphs=counters["stats"]["unique_graphs"],
    )
