"""Quantization-aware fine-tuning: the fake-quantized model computes what its real int4
quantization computes, and a QAT run's export loads as that quantized model."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from temper.config import QAT, ConfigError, load_config
from temper.models import build_model
from temper.quantize import load_quantized, prepare_qat, quantize_for_inference
from temper.recipes.llama3 import llama3_debug
from temper.utils.device import Runtime


@pytest.mark.parametrize("activations", [True, False], ids=["int8_int4", "int4_weight_only"])
def test_fake_quantization_is_the_real_quantization(activations: bool) -> None:
    """Prepared on meta (as the Engine does), the blocks' 28 projections are fake-quantized;
    converting them to integer weights changes no logit."""
    from torchao.quantization.qat import FakeQuantizedLinear

    qat = QAT(enable=True, activations=activations)
    torch.manual_seed(0)
    model = build_model("llama3", "debug")
    names = prepare_qat(model, qat)
    assert len(names) == 28 and isinstance(model.layers[0].attention.wq, FakeQuantizedLinear)
    assert type(model.output) is torch.nn.Linear  # the LM head is left alone
    model.to_empty(device="cpu")
    model.init_weights()
    ids = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        fake = model(ids)
        real = quantize_for_inference(copy.deepcopy(model), qat)
        weight = real.layers[0].attention.wq.weight
        assert type(weight).__name__ == "IntxUnpackedToInt8Tensor"
        assert weight.qdata.min() >= -8 and weight.qdata.max() <= 7  # int4 codes
        torch.testing.assert_close(real(ids), fake, rtol=1e-5, atol=1e-5)


def test_qat_rules_name_the_fields() -> None:
    config = llama3_debug()
    config.qat.enable = True
    config.validate(1)
    config.lora.enable = True
    with pytest.raises(ConfigError, match="qat.enable fake-quantizes the weights it trains"):
        config.validate(1)


@pytest.mark.slow
def test_qat_export_loads_as_the_quantized_model(tmp_path: Path) -> None:
    from temper.trainer.trainer import Trainer

    config = load_config(
        "temper.recipes.llama3",
        "llama3_debug",
        [
            "--training.steps", "2",
            "--training.seq_len", "16",
            "--training.local_batch_size", "2",
            "--job.dump_folder", str(tmp_path),
            "--qat.enable",
            "--checkpoint.enable",
            "--checkpoint.interval", "1",
            "--checkpoint.hf_export", "final",
            "--metrics.no-tensorboard",
        ],
    )  # fmt: skip
    runtime = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    trainer = Trainer(config, runtime)
    trainer.train()
    folder = tmp_path / "hf" / "step-2"
    ids = torch.randint(0, 2000, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trained = trainer.engine.model.eval()(ids)
        # transformers loads the full-precision weights; Temper's loader quantizes them.
        plain = AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits
        quantized = load_quantized(folder)
        weight = quantized.layers[1].feed_forward.w2.weight
        assert type(weight).__name__ == "IntxUnpackedToInt8Tensor"
        torch.testing.assert_close(quantized(ids), trained, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain, trained, atol=1e-3)  # the integer rounding is real
