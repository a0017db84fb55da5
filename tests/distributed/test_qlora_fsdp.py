"""QLoRA under FSDP2: the NF4 base is quantized whole and split by rows, so FSDP 2 trains like
one process (the gathered base is one process's NF4, bit for bit), each rank holds half of the
NF4 bytes, a checkpoint resumes, and ``dcp-to-hf`` merges the sharded NF4 base into a
full-precision folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from training import FSDP2, SINGLE, assert_same_metrics, parity_config

from temper.config import Config
from temper.recipes.precision import sft_debug_qlora

pytestmark = pytest.mark.slow

STEPS = 2
IDS = torch.randint(0, 2000, (2, 16), generator=torch.Generator().manual_seed(0))


def _config(folder: Path, layout) -> Config:
    config = parity_config(sft_debug_qlora, folder, layout)
    config.training.steps = STEPS
    config.training.deterministic = True
    config.checkpoint.enable = True
    config.checkpoint.interval = 1
    return config


def _train_rank(config: Config) -> dict:
    from torch.distributed.tensor import DTensor

    from temper.models.lora import full_tensor, lora_modules
    from temper.optim.low_bit import tensor_bytes
    from temper.trainer import Trainer

    trainer = Trainer(config)
    resumed_from = trainer.state.step
    trainer.train()
    model = trainer.engine.model.eval()
    weights = [m.weight for m in lora_modules(model)]
    local = [w._local_tensor if isinstance(w, DTensor) else w for w in weights]
    with torch.no_grad():
        logits = model(IDS)
        # Dequantized whole weights as an export or a weight push gathers them (one at a time).
        dense = [full_tensor(w).to(torch.float32) for w in weights]
    codes = [t.quantized_data for t in local]
    if dist.is_initialized():  # row shards: the whole codes are the ranks' in rank order
        codes = [torch.cat(_all_gather(c)) for c in codes]
    metrics = Path(config.job.dump_folder) / "metrics.jsonl"
    return {
        "rows": [json.loads(line) for line in metrics.read_text().splitlines()],
        "resumed_from": resumed_from,
        "types": {type(t).__name__ for t in local},
        "local_bytes": sum(tensor_bytes(t) for t in local),
        "codes": [c.clone() for c in codes],
        "dense": dense,
        "logits": logits,
    }


def _all_gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return parts


def _run(config: Config, layout) -> list[dict]:
    if layout.world == 1:
        return [_train_rank(config)]
    return run_on_ranks(_train_rank, layout.world, config)


def test_qlora_fsdp2_equals_one_process_and_resumes(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from temper.checkpoint.convert import dcp_to_hf

    (single,) = _run(_config(tmp_path, SINGLE), SINGLE)
    ranks = _run(_config(tmp_path, FSDP2), FSDP2)
    sharded = ranks[0]
    assert single["types"] == {"NF4Tensor"} == sharded["types"]
    # The gathered NF4 codes are one process's, the gathered dequantized weights too (each
    # rank dequantizes its rows), and the run trains like it.
    for ours, theirs in zip(sharded["codes"], single["codes"], strict=True):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(sharded["dense"], single["dense"], strict=True):
        assert torch.equal(ours, theirs)
    assert_same_metrics(sharded["rows"], single["rows"])
    torch.testing.assert_close(sharded["logits"], single["logits"], rtol=1e-5, atol=1e-5)
    # Each rank holds half of the NF4 codes and scales (the 16-entry code table and the
    # scales' mean, 68 bytes a tensor, are on both).
    tables = len(single["codes"]) * 17 * 4
    assert [r["local_bytes"] for r in ranks] == [(single["local_bytes"] - tables) / 2 + tables] * 2

    # Resumed from step 1's checkpoint (NF4 shards, adapters, optimizer, data position), step 2
    # is the uninterrupted run's.
    folder = Path(_config(tmp_path, FSDP2).job.dump_folder)
    checkpoints = folder / "checkpoints"
    resumed_dir = tmp_path / "resumed"
    resumed_config = _config(tmp_path, FSDP2)
    resumed_config.job.dump_folder = str(resumed_dir)
    (resumed_dir / "checkpoints").mkdir(parents=True)
    (checkpoints / "step-1").rename(resumed_dir / "checkpoints" / "step-1")
    resumed = _run(resumed_config, FSDP2)[0]
    assert resumed["resumed_from"] == 1
    (last,) = resumed["rows"]
    assert last["step"] == STEPS
    assert last["loss"] == pytest.approx(sharded["rows"][-1]["loss"], rel=1e-6)
    assert last["grad_norm"] == pytest.approx(sharded["rows"][-1]["grad_norm"], rel=1e-6)

    # The export merges the sharded NF4 base: transformers' model gives the trained logits.
    dcp_to_hf(checkpoints / f"step-{STEPS}", tmp_path / "hf")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert {p.dtype for p in exported.parameters()} == {torch.float32}
    with torch.no_grad():
        torch.testing.assert_close(exported(IDS).logits, sharded["logits"], atol=1e-5, rtol=1e-5)
