"""Qwen3.5 vision-language <-> Hugging Face `Qwen3_5ForConditionalGeneration` and
`Qwen3_5MoeForConditionalGeneration` (model types `qwen3_5`, `qwen3_5_moe`): the language
model's config under `text_config` and its weights under `model.language_model.`, the
tower's under `vision_config` and `model.visual.`."""

from __future__ import annotations

import dataclasses
from typing import Any

from temper.models.hf import HFAdapter, KeyRule
from temper.models.layers.vision import VisionArgs
from temper.models.qwen3_5 import hf as dense_hf
from temper.models.qwen3_5_moe import hf as moe_hf
from temper.models.qwen3_5_vl.args import Qwen3_5MoeVLArgs, Qwen3_5VLArgs, VisionTokens

LANGUAGE_PREFIX = "model.language_model."
TOKEN_FIELDS = tuple(f.name for f in dataclasses.fields(VisionTokens))
BLOCK_KEYS = {
    "norm1.{}": "norm1.{}",
    "norm2.{}": "norm2.{}",
    "attn.qkv.{}": "attn.qkv.{}",
    "attn.proj.{}": "attn.proj.{}",
    "mlp.linear_fc1.{}": "mlp.linear_fc1.{}",
    "mlp.linear_fc2.{}": "mlp.linear_fc2.{}",
}
TOWER_KEYS = {
    "patch_embed.{}": "patch_embed.proj.{}",
    "merger.norm.{}": "merger.norm.{}",
    "merger.linear_fc1.{}": "merger.linear_fc1.{}",
    "merger.linear_fc2.{}": "merger.linear_fc2.{}",
}


def vision_from_hf(config: dict[str, Any]) -> VisionArgs:
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"vision rope type {rope['rope_type']!r} is not supported (axial is)")
    for name, size in (("patch_size", 16), ("temporal_patch_size", 2)):
        if not isinstance(config.get(name, size), int):
            raise ValueError(f"vision_config.{name} {config[name]!r}: only square sizes are read")
    return VisionArgs(
        dim=config["hidden_size"],
        n_layers=config["depth"],
        n_heads=config["num_heads"],
        ffn_hidden_dim=config["intermediate_size"],
        out_dim=config["out_hidden_size"],
        patch_size=config.get("patch_size", 16),
        temporal_patch_size=config.get("temporal_patch_size", 2),
        in_channels=config.get("in_channels", 3),
        spatial_merge_size=config.get("spatial_merge_size", 2),
        n_position_embeddings=config.get("num_position_embeddings", 2304),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        activation=config.get("hidden_act", "gelu_pytorch_tanh"),
    )


def vision_to_hf(args: VisionArgs, model_type: str) -> dict[str, Any]:
    return {
        "model_type": model_type,
        "hidden_size": args.dim,
        "depth": args.n_layers,
        "num_heads": args.n_heads,
        "intermediate_size": args.ffn_hidden_dim,
        "out_hidden_size": args.out_dim,
        "patch_size": args.patch_size,
        "temporal_patch_size": args.temporal_patch_size,
        "in_channels": args.in_channels,
        "spatial_merge_size": args.spatial_merge_size,
        "num_position_embeddings": args.n_position_embeddings,
        "hidden_act": args.activation,
        "rope_parameters": {"rope_type": "axial", "rope_theta": args.rope_theta},
    }


def vision_rules(args: VisionArgs) -> list[KeyRule]:
    """Every tower tensor: native ``visual.X`` is HF ``model.visual.X`` but for the patch
    embedding's convolution (``patch_embed.proj``)."""
    keys = dict(TOWER_KEYS)
    for i in range(args.n_layers):
        keys |= {f"blocks.{i}.{n}": f"blocks.{i}.{h}" for n, h in BLOCK_KEYS.items()}
    rules = [
        KeyRule(f"visual.{n.format(p)}", (f"model.visual.{h.format(p)}",))
        for n, h in keys.items()
        for p in ("weight", "bias")
    ]
    rules.append(KeyRule("visual.pos_embed.weight", ("model.visual.pos_embed.weight",)))
    return rules


def _nested(rule: KeyRule) -> KeyRule:
    """A language-model rule as the vision-language checkpoint names it."""
    hf = tuple(
        LANGUAGE_PREFIX + k.removeprefix("model.") if k.startswith("model.") else k for k in rule.hf
    )
    return KeyRule(rule.native, hf)


def _adapter(text: HFAdapter, args_cls: type, model_type: str, architecture: str) -> HFAdapter:
    def args_from_hf(config: dict[str, Any]) -> Any:
        text_config = {**config["text_config"]}
        if "tie_word_embeddings" in config:
            text_config["tie_word_embeddings"] = config["tie_word_embeddings"]
        tokens = {k: config[k] for k in TOKEN_FIELDS if k in config}
        language = dataclasses.asdict(text.args_from_hf(text_config))
        return args_cls(**language, **tokens, vision=vision_from_hf(config["vision_config"]))

    def args_to_hf(args: Any) -> dict[str, Any]:
        text_config = text.args_to_hf(args)
        text_config.pop("architectures")
        return {
            "architectures": [architecture],
            "model_type": model_type,
            "text_config": text_config,
            "vision_config": vision_to_hf(args.vision, f"{model_type}_vision"),
            "tie_word_embeddings": args.tie_embeddings,
            **{k: getattr(args, k) for k in TOKEN_FIELDS},
        }

    def key_rules(args: Any) -> list[KeyRule]:
        return [_nested(r) for r in text.key_rules(args)] + vision_rules(args.vision)

    return HFAdapter(
        model_types=(model_type,),
        args_from_hf=args_from_hf,
        args_to_hf=args_to_hf,
        key_rules=key_rules,
        carried_prefixes=("mtp.",),
    )


ADAPTER = _adapter(dense_hf.ADAPTER, Qwen3_5VLArgs, "qwen3_5", "Qwen3_5ForConditionalGeneration")
MOE_ADAPTER = _adapter(
    moe_hf.ADAPTER, Qwen3_5MoeVLArgs, "qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration"
)
