"""LoRA: starts as the base model, trains only adapters, merges into equal weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from temper.models import build_model, materialize
from temper.models.hf import hf_module_names
from temper.models.lora import (
    LoRALinear,
    adapters_disabled,
    apply_lora,
    init_lora,
    lora_modules,
    lora_targets,
    merge_lora,
)

TARGETS = ["layers.*.attention.w*", "layers.*.feed_forward.w*"]


def _models(rslora: bool = False) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    base = materialize(build_model("llama3", "debug"), "cpu")
    adapted = build_model("llama3", "debug")
    names = apply_lora(adapted, TARGETS, rank=4, alpha=8.0, rslora=rslora)
    assert len(names) == 4 * 7  # wq wk wv wo w1 w2 w3 per layer
    materialize(adapted, "cpu")
    init_lora(adapted)
    adapted.load_state_dict(base.state_dict(), strict=False)
    return base, adapted


def test_init_leaves_outputs_unchanged_and_freezes_the_base() -> None:
    base, adapted = _models()
    ids = torch.randint(0, 2048, (2, 16))
    torch.testing.assert_close(adapted(ids), base(ids), rtol=0, atol=0)
    trainable = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_a", "lora_b")) for n in trainable)


@pytest.mark.parametrize("rslora", [False, True])
def test_merged_weights_equal_the_adapted_forward(rslora: bool) -> None:
    _, adapted = _models(rslora)
    with torch.no_grad():
        for module in lora_modules(adapted):
            module.lora_b.normal_(std=0.02)  # as after training: B no longer zero
    ids = torch.randint(0, 2048, (2, 16))
    adapted_logits = adapted(ids)
    with adapters_disabled(adapted):
        base_logits = adapted(ids)
    assert not torch.allclose(adapted_logits, base_logits)
    merged = merge_lora(adapted)
    assert not any(isinstance(m, LoRALinear) for m in merged.modules())
    torch.testing.assert_close(merged(ids), adapted_logits, rtol=1e-5, atol=1e-5)


def test_lora_scale() -> None:
    args = dict(rank=4, alpha=8.0, dropout=0.0)
    assert LoRALinear(3, 5, False, rslora=False, **args).scale == 2.0
    assert LoRALinear(3, 5, False, rslora=True, **args).scale == 4.0


def test_no_matching_module_fails() -> None:
    with pytest.raises(ValueError, match="'nothing.*' matches no linear layer"):
        apply_lora(build_model("llama3", "debug"), ["nothing.*"], rank=2, alpha=2.0)


@pytest.mark.parametrize("family", ["llama3", "qwen3_moe", "deepseek_v3"])
def test_hugging_face_names_pick_the_same_layers(family: str) -> None:
    """PEFT-style names (a module's last HF name parts) select what Temper's names select."""
    native = {
        "llama3": ["layers.*.attention.wq", "layers.*.attention.wv", "layers.*.feed_forward.w1"],
        "qwen3_moe": ["layers.*.attention.wq", "layers.*.attention.wv"],
        "deepseek_v3": ["layers.*.attention.wq_b", "layers.*.attention.wkv_b"],
    }[family]
    hf = {
        "llama3": ["q_proj", "self_attn.v_proj", "model.layers.*.mlp.gate_proj"],
        "qwen3_moe": ["q_proj", "v_proj"],
        "deepseek_v3": ["q_b_proj", "kv_b_proj"],
    }[family]
    model = build_model(family, "debug")
    names = hf_module_names(model)
    expected = lora_targets(model, native)
    assert expected and lora_targets(model, hf, names) == expected
    every = [n for n, m in model.named_modules() if type(m) is nn.Linear and n != "output"]
    assert lora_targets(model, ["all-linear"], names) == every


def test_an_unmatched_pattern_lists_the_valid_names() -> None:
    model = build_model("llama3", "debug")
    with pytest.raises(ValueError) as error:
        apply_lora(model, ["q_proj", "v_prj"], rank=2, alpha=2.0, hf_names=hf_module_names(model))
    assert str(error.value) == (
        "lora.target_modules 'v_prj' matches no linear layer of Transformer; Hugging Face "
        "names: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj; "
        "Temper names: layers.*.attention.wk, layers.*.attention.wo, layers.*.attention.wq, "
        "layers.*.attention.wv, layers.*.feed_forward.w1, layers.*.feed_forward.w2, "
        "layers.*.feed_forward.w3, output; or all-linear"
    )


def test_export_merges_the_adapters(tmp_path) -> None:
    import dataclasses

    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from temper.checkpoint.convert import load_checkpoint_model
    from temper.checkpoint.manager import write_checkpoint
    from temper.checkpoint.metadata import build_metadata, run_structure
    from temper.config import LoRA

    _, adapted = _models()
    with torch.no_grad():
        for module in lora_modules(adapted):
            module.lora_b.normal_(std=0.02)
    lora = dataclasses.asdict(LoRA(enable=True, rank=4, alpha=8.0, target_modules=TARGETS))
    structure = run_structure(ep=1, lora=lora, param_dtype=torch.float32)
    metadata = build_metadata(adapted, step=1, structure=structure)
    write_checkpoint(tmp_path / "step-1", {"model": get_model_state_dict(adapted)}, metadata)
    exported = load_checkpoint_model(tmp_path / "step-1")
    assert not any(isinstance(m, LoRALinear) for m in exported.modules())
    ids = torch.randint(0, 2048, (2, 16))
    torch.testing.assert_close(exported(ids), adapted(ids), rtol=1e-5, atol=1e-5)


def test_flops_count_no_weight_gradient_for_frozen_weights() -> None:
    """LoRA on wq and wv of the debug Llama (dim 256, 4 layers, 8 heads of 32, 4 KV heads,
    FFN 768, vocab 2048, untied): 6 FLOPs per token for each adapter weight, 4 for each
    frozen one (forward and input gradient, no weight gradient), the input embedding none."""
    model = build_model("llama3", "debug")
    apply_lora(model, ["layers.*.attention.wq", "layers.*.attention.wv"], rank=4, alpha=8.0)
    adapters = 4 * ((4 * 256 + 256 * 4) + (4 * 256 + 128 * 4))
    block = 256 * 256 + 2 * 256 * 128 + 256 * 256 + 3 * 256 * 768 + 2 * 256
    frozen = 4 * block + 256 + 2048 * 256  # blocks, final norm, head
    attention = 12 * 4 * 8 * 32 * 64
    assert model.flops_per_token(64) == 6 * adapters + 4 * frozen + attention
    for param in model.parameters():
        param.requires_grad_(True)  # full fine-tuning: torchtitan's 6 per weight
    assert model.flops_per_token(64) == 6 * (adapters + frozen) + attention
