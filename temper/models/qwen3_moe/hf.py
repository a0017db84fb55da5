"""Qwen3-MoE <-> Hugging Face `Qwen3MoeForCausalLM`: Qwen3's table plus the experts.

Hub checkpoints, and `save_pretrained` of transformers 5 (which fuses gate/up in memory but
writes the per-expert layout back), hold one tensor per expert and projection; each native
stacked parameter is a `KeyRule` over the n_experts HF tensors in expert order.
"""

from __future__ import annotations

from typing import Any

from temper.models.hf import HFAdapter, KeyRule
from temper.models.qwen3.hf import args_to_hf as dense_args_to_hf
from temper.models.qwen3.hf import decoder_rules, dense_fields, dense_mlp_rules
from temper.models.qwen3_moe.args import Qwen3MoeArgs

# Native stacked expert weight -> HF per-expert projection.
EXPERT_KEYS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def args_from_hf(config: dict[str, Any]) -> Qwen3MoeArgs:
    # Unlike Qwen3Config, Qwen3MoeConfig has no head_dim default: attention falls back to
    # hidden_size / heads. save_pretrained writes num_experts under its alias num_local_experts.
    default_head_dim = config["hidden_size"] // config["num_attention_heads"]
    return Qwen3MoeArgs(
        **dense_fields(config, default_head_dim),
        n_experts=config.get("num_experts") or config["num_local_experts"],
        top_k=config["num_experts_per_tok"],
        moe_hidden_dim=config["moe_intermediate_size"],
        norm_topk_prob=config.get("norm_topk_prob", False),
        decoder_sparse_step=config.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(config.get("mlp_only_layers") or ()),
        router_aux_loss_coef=config.get("router_aux_loss_coef", 0.001),
    )


def args_to_hf(args: Qwen3MoeArgs) -> dict[str, Any]:
    return {
        **dense_args_to_hf(args),
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": args.n_experts,
        "num_experts_per_tok": args.top_k,
        "moe_intermediate_size": args.moe_hidden_dim,
        "norm_topk_prob": args.norm_topk_prob,
        "decoder_sparse_step": args.decoder_sparse_step,
        "mlp_only_layers": list(args.mlp_only_layers),
        "router_aux_loss_coef": args.router_aux_loss_coef,
    }


def moe_rules(args: Qwen3MoeArgs, layer_id: int) -> list[KeyRule]:
    native, hf = f"layers.{layer_id}.feed_forward", f"model.layers.{layer_id}.mlp"
    rules = [KeyRule(f"{native}.router.gate.weight", (f"{hf}.gate.weight",))]
    for w, proj in EXPERT_KEYS.items():
        experts = tuple(f"{hf}.experts.{e}.{proj}.weight" for e in range(args.n_experts))
        rules.append(KeyRule(f"{native}.experts.{w}", experts))
    return rules


def key_rules(args: Qwen3MoeArgs) -> list[KeyRule]:
    return decoder_rules(
        args, lambda i: moe_rules(args, i) if args.is_moe_layer(i) else dense_mlp_rules(i)
    )


ADAPTER = HFAdapter(
    model_types=("qwen3_moe",),
    args_from_hf=args_from_hf,
    args_to_hf=args_to_hf,
    key_rules=key_rules,
)
