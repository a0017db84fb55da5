"""QLoRA: NF4 base weights under full-precision adapters. The forward against the dequantized
base plus the adapters (exactly) and against the fp32 base (within NF4's error), the bytes
saved, and a run whose checkpoint exports a full-precision HF folder that transformers
loads."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from temper.config import ConfigError, load_config
from temper.models import build_model
from temper.models.lora import apply_lora, init_lora, lora_modules
from temper.optim.low_bit import tensor_bytes
from temper.quantize import quantize_lora_base
from temper.quantize.nf4 import scaler_block
from temper.recipes.llama3 import llama3_debug
from temper.utils.device import Runtime


def _lora_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model("llama3", "debug")
    apply_lora(model, ["all-linear"], rank=8, alpha=16.0)
    model.to_empty(device="cpu")
    model.init_weights()
    init_lora(model)
    with torch.no_grad():
        for module in lora_modules(model):
            module.lora_b.normal_(std=0.02)  # as after training: the adapters matter
    return model


def test_forward_is_the_dequantized_base_plus_adapters() -> None:
    model = _lora_model()
    full_precision = copy.deepcopy(model)
    names = quantize_lora_base(model)
    assert len(names) == 4 * 7  # every block's projections (dims are multiples of 64)
    dequantized = copy.deepcopy(full_precision)
    errors = []
    with torch.no_grad():
        triples = zip(
            lora_modules(model),
            lora_modules(dequantized),
            lora_modules(full_precision),
            strict=True,
        )
        for nf4, plain, exact in triples:
            plain.weight.copy_(nf4.weight.to(torch.float32))
            errors.append(((plain.weight - exact.weight).norm() / exact.weight.norm()).item())
    # NF4's own error on these (uniformly initialised) weights: ~10% of each weight's norm.
    assert 0.05 < max(errors) < 0.15
    ids = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids)
        torch.testing.assert_close(logits, dequantized(ids), rtol=1e-6, atol=1e-6)
        exact = full_precision(ids)
    # Against the fp32 base: 28 weights each ~10% off compound to ~20% on the logits of this
    # random-init model; the NF4 forward adds nothing to its weights' own error.
    assert 0 < ((logits - exact).norm() / exact.norm()).item() < 0.3


def test_the_base_takes_an_eighth_of_fp32s_bytes() -> None:
    """4 bits a value, plus an 8-bit scale per 64 values and an fp32 scale per 256 of those:
    0.516 bytes, against fp32's 4; and per tensor its 16-entry fp32 code table and the fp32
    mean of its scales."""
    model = _lora_model()
    before = sum(tensor_bytes(m.weight) for m in lora_modules(model))
    quantize_lora_base(model)
    after = sum(tensor_bytes(m.weight) for m in lora_modules(model))
    values = sum(m.weight.numel() for m in lora_modules(model))
    assert before == 4 * values
    tensors = len(list(lora_modules(model)))
    assert after == values * (0.5 + 1 / 64 + 4 / (64 * 256)) + tensors * (16 + 1) * 4


def test_qlora_is_refused_without_lora_or_beside_other_parallelism() -> None:
    config = llama3_debug()
    config.lora.quantize_base = "nf4"
    with pytest.raises(ConfigError, match="lora.quantize_base nf4 quantizes LoRA's frozen base"):
        config.validate(1)
    config.lora.enable = True
    config.validate(1)
    config.validate(2)  # FSDP2 shards the NF4 base
    for field in ("dp_replicate", "sp"):  # (ep needs an MoE model, refused before)
        other = copy.deepcopy(config)
        setattr(other.parallelism, field, 2)
        with pytest.raises(ConfigError, match=f"parallelism.{field} 2 is not supported with it"):
            other.validate(4)
    config.parallelism.fsdp_cpu_offload = True
    with pytest.raises(ConfigError, match="with parallelism.fsdp_cpu_offload is not supported"):
        config.validate(2)


def test_scaler_blocks_split_evenly_into_fsdp_shards() -> None:
    """FSDP2 splits an NF4 tensor by rows into its codes, scales and scale factors: each
    shard must hold whole blocks of 64 values and whole second-level blocks of scales."""
    assert scaler_block(torch.empty(128, 256)) == 256  # 512 scales: 2 blocks of 256
    assert scaler_block(torch.empty(128, 256), shards=2) == 256
    assert scaler_block(torch.empty(128, 256), shards=4) == 128
    assert scaler_block(torch.empty(64, 64), shards=8) == 8
    assert scaler_block(torch.empty(6, 64), shards=4) is None  # rows do not split
    assert scaler_block(torch.empty(4, 40)) is None  # 160 values: not whole blocks of 64


@pytest.mark.slow
def test_qlora_run_exports_a_full_precision_folder(tmp_path: Path) -> None:
    from temper.trainer.trainer import Trainer

    config = load_config(
        "temper.recipes.llama3",
        "llama3_debug",
        [
            "--training.steps", "2",
            "--training.seq_len", "16",
            "--training.local_batch_size", "2",
            "--job.dump_folder", str(tmp_path),
            "--lora.enable",
            "--lora.quantize_base", "nf4",
            "--optimizer.lr", "0.01",
            "--checkpoint.enable",
            "--checkpoint.interval", "1",
            "--checkpoint.hf_export", "final",
            "--metrics.no-tensorboard",
        ],
    )  # fmt: skip
    runtime = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    trainer = Trainer(config, runtime)
    trainer.train()
    model = trainer.engine.model.eval()
    assert all(type(m.weight).__name__ == "NF4Tensor" for m in lora_modules(model))
    assert any(m.lora_b.abs().sum() > 0 for m in lora_modules(model))  # the adapters trained
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf" / "step-2").eval()
    assert {p.dtype for p in exported.parameters()} == {torch.float32}
    ids = torch.randint(0, 2000, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, model(ids), atol=1e-5, rtol=1e-5)
