"""DeepSeek V4 <-> Hugging Face `DeepseekV4ForCausalLM`: config fields and the weight table.

transformers 5 saves V4 under DeepSeek's own tensor names (``model.layers.{i}.attn.wq_a``,
``attn.compressor.wkv``, ``attn.indexer.compressor.ape``, ``hc_attn_fn``, ``ffn.experts.E.w1``,
``head.weight``...), one tensor per routed expert, which is what is read and written here. Two
buffers travel too: each top-k layer's balancing bias (``ffn.gate.bias``) and each hash layer's
token-to-experts table (``ffn.gate.tid2eid``).

Configs: the compressed layers' rotary is ``rope_parameters["compress"]`` (YaRN, whose attention
factor transformers fixes at 1 for V4 when absent; another value is refused), the sliding
layers' ``rope_parameters["main"]``. The older flat keys (``compress_ratios`` per layer,
``num_hash_layers``, ``compress_rate_csa`` / ``_hca``, ``qk_rope_head_dim``) are read as
transformers folds them in.

Multi-token-prediction depths (``num_nextn_predict_layers``) are read and written under the
released checkpoint's names, ``mtp.{k}.*``: ``e_proj``, ``h_proj``, ``enorm``, ``hnorm``,
``norm``, ``hc_head_{fn,base,scale}`` and a block's tensors as a layer's (``mtp.{k}.attn.wq_a``,
``mtp.{k}.ffn.experts.E.w1``...), the embedding and head shared with the main model
(``temper.models.deepseek_v4.mtp``). transformers reads none of them (it drops ``mtp.*``) and
writes ``num_nextn_predict_layers: 1``, its default, into configs whose folders hold none, so a
folder's depth is the count of depths it holds (``fit_to_folder``); ``--model.mtp_depth 0``
leaves them out, and an export then carries the folder's ``mtp.*`` tensors untouched.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from temper.models.deepseek_v4.args import (
    CSA,
    HCA,
    SLIDING,
    DeepseekV4Args,
    default_layer_types,
    default_mlp_layer_types,
)
from temper.models.deepseek_v4.mtp import mtp_block_args
from temper.models.hf import HFAdapter, KeyRule, rope_from_hf, rope_to_hf
from temper.models.hf_keys import SILU, ConfigNames, block_rules
from temper.models.layers.rope import YarnScaling

CONFIG = ConfigNames(
    model_type="deepseek_v4",
    architecture="DeepseekV4ForCausalLM",
    args_cls=DeepseekV4Args,
    own={
        name: name
        for name in (
            "q_lora_rank",
            "o_groups",
            "o_lora_rank",
            "sliding_window",
            "compress_rope_theta",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
            "hc_mult",
            "hc_sinkhorn_iters",
            "hc_eps",
            "n_shared_experts",
            "routed_scaling_factor",
            "swiglu_limit",
        )
    }
    | {"mtp_depth": "num_nextn_predict_layers"},
    aliases={"n_experts": "n_routed_experts"},
    also_read={"n_experts": ("num_local_experts",)},
    # DeepseekV4Config's defaults.
    defaults={
        "head_dim": 512,
        "q_lora_rank": 1024,
        "o_groups": 8,
        "o_lora_rank": 1024,
        "sliding_window": 128,
        "compress_rope_theta": 160000.0,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "n_shared_experts": 1,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "max_seq_len": 1048576,
        "mtp_depth": 1,
    },
    # Read and written below: the layer schedules (older configs spell them otherwise).
    native_only=frozenset({"router_aux_loss_coef", "layer_types"}),
    fixed={
        **SILU,
        "scoring_func": "sqrtsoftplus",
        "attention_bias": False,
        "mlp_bias": False,
        "num_key_value_heads": 1,
    },
    rope_types=("default", "yarn"),
)

DEFAULT_RATIOS = {CSA: 4, HCA: 128}


def args_from_hf(config: dict[str, Any]) -> DeepseekV4Args:
    fields = CONFIG.read(config)
    n = fields["n_layers"]
    ratios = {**DEFAULT_RATIOS, **(config.get("compress_rates") or {})}
    for kind, legacy in ((CSA, "compress_rate_csa"), (HCA, "compress_rate_hca")):
        if config.get(legacy) is not None:
            ratios[kind] = config[legacy]
    layer_types = config.get("layer_types")
    if layer_types is None and config.get("compress_ratios") is not None:
        by_ratio = {0: SLIDING, ratios[CSA]: CSA, ratios[HCA]: HCA}
        layer_types = [by_ratio[r] for r in config["compress_ratios"]]
    mlp_layer_types = config.get("mlp_layer_types") or default_mlp_layer_types(
        n, config.get("num_hash_layers") or 3
    )
    head_dim = fields["head_dim"]
    factor = config.get("partial_rotary_factor")
    if factor is not None:
        rope_dim = int(head_dim * factor)
    else:
        rope_dim = config.get("qk_rope_head_dim") or head_dim * 64 // 512
    main_theta, compress_theta, scaling = _rotaries(config)
    fields.update(compress_rope_theta=compress_theta)
    return DeepseekV4Args(
        **fields,
        qk_rope_head_dim=rope_dim,
        layer_types=tuple(layer_types or default_layer_types(n))[:n],
        mlp_layer_types=tuple(mlp_layer_types)[:n],
        csa_ratio=ratios[CSA],
        hca_ratio=ratios[HCA],
        rope_theta=main_theta,
        rope_scaling=scaling,
    )


def _rotaries(config: dict[str, Any]) -> tuple[float, float, YarnScaling | None]:
    """(main theta, compress theta, the compress rotary's YaRN or None) of a config, nested
    (``rope_parameters`` with ``main`` and ``compress``) or flat (``rope_theta``,
    ``compress_rope_theta`` and YaRN's fields in ``rope_parameters`` or ``rope_scaling``)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    main_theta = float(config.get("rope_theta") or 10000.0)
    compress_theta = float(config.get("compress_rope_theta") or 160000.0)
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main_theta = float(params["main"]["rope_theta"])
        if params["main"].get("rope_type", "default") != "default":
            raise ValueError("rope_parameters.main must be the default rotary (no scaling)")
        compress = params["compress"]
    else:
        compress = {"rope_type": "default", **params, "rope_theta": compress_theta}
    compress_theta, scaling = rope_from_hf({"rope_parameters": compress}, CONFIG.rope_types)
    if isinstance(scaling, YarnScaling):
        if scaling.attention_factor is None:
            scaling = dataclasses.replace(scaling, attention_factor=1.0)
        if scaling.rope_scale() != 1.0:
            raise ValueError(
                f"rope_parameters.compress.attention_factor {scaling.attention_factor} is not "
                "supported (1.0, transformers' value for DeepSeek V4, is)"
            )
    return main_theta, compress_theta, scaling


def args_to_hf(args: DeepseekV4Args) -> dict[str, Any]:
    rotary = {"partial_rotary_factor": args.qk_rope_head_dim / args.head_dim}
    main = rope_to_hf(args.rope_theta, None)["rope_parameters"] | rotary
    compress = rope_to_hf(args.compress_rope_theta, args.rope_scaling)["rope_parameters"]
    return CONFIG.write(args) | {
        "layer_types": list(args.layer_types),
        "mlp_layer_types": list(args.mlp_layer_types),
        "compress_rates": {CSA: args.csa_ratio, HCA: args.hca_ratio},
        "rope_theta": args.rope_theta,
        "partial_rotary_factor": rotary["partial_rotary_factor"],
        "rope_parameters": {"main": main, "compress": compress | rotary},
    }


def _compressor_keys(native: str, hf: str) -> dict[str, str]:
    names = {
        "kv_proj.weight": "wkv.weight",
        "gate_proj.weight": "wgate.weight",
        "position_bias": "ape",
        "kv_norm.weight": "norm.weight",
    }
    return {f"{native}.{n}": f"{hf}.{h}" for n, h in names.items()}


BLOCK_KEYS = {
    "attention.wq_a.weight": "attn.wq_a.weight",
    "attention.q_norm.weight": "attn.q_norm.weight",
    "attention.wq_b.weight": "attn.wq_b.weight",
    "attention.wkv.weight": "attn.wkv.weight",
    "attention.kv_norm.weight": "attn.norm.weight",
    "attention.wo_a.weight": "attn.wo_a.weight",
    "attention.wo_b.weight": "attn.wo_b.weight",
    "attention.sinks": "attn.attn_sink",
    "attention_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    **{
        f"{n}_hc.{p}": f"hc_{h}_{p}"
        for n, h in (("attention", "attn"), ("ffn", "ffn"))
        for p in ("fn", "base", "scale")
    },
    "feed_forward.router.gate.weight": "ffn.gate.weight",
    **{f"shared_experts.{w}.weight": f"ffn.shared_experts.{w}.weight" for w in ("w1", "w2", "w3")},
}
HCA_KEYS = _compressor_keys("attention.compressor", "attn.compressor")
CSA_KEYS = {
    **HCA_KEYS,
    **_compressor_keys("attention.indexer.compressor", "attn.indexer.compressor"),
    "attention.indexer.q_proj.weight": "attn.indexer.wq_b.weight",
    "attention.indexer.weights_proj.weight": "attn.indexer.weights_proj.weight",
}
ATTENTION_KEYS = {SLIDING: {}, HCA: HCA_KEYS, CSA: CSA_KEYS}


def layer_rules(args: DeepseekV4Args, i: int) -> list[KeyRule]:
    """Layer ``i``: attention (with its compressor and indexer), hyper-connections, norms,
    router, stacked routed experts (DeepSeek's w1, w3, w2 per expert) and the shared one."""
    rules = block_rules(i, {**BLOCK_KEYS, **ATTENTION_KEYS[args.layer_types[i]]})
    native, hf = f"layers.{i}.feed_forward.experts", f"model.layers.{i}.ffn.experts"
    for w in ("w1", "w3", "w2"):
        rules.append(
            KeyRule(f"{native}.{w}", tuple(f"{hf}.{e}.{w}.weight" for e in range(args.n_experts)))
        )
    return rules


# Native name within an MTP depth -> the released checkpoint's name within ``mtp.{k}``.
MTP_KEYS = {
    **{f"{n}.weight": f"{n}.weight" for n in ("e_proj", "h_proj", "enorm", "hnorm", "norm")},
    **{f"hc_head.{p}": f"hc_head_{p}" for p in ("fn", "base", "scale")},
}


def mtp_rules(args: DeepseekV4Args, k: int) -> list[KeyRule]:
    """MTP depth ``k``: its own tensors, then its block's, a sliding top-k layer's rules
    moved from ``layers.0`` / ``model.layers.0`` to ``mtp.k.block`` / ``mtp.k``."""
    rules = [KeyRule(f"mtp.{k}.{n}", (f"mtp.{k}.{h}",)) for n, h in MTP_KEYS.items()]
    return rules + [_into_mtp(rule, k) for rule in layer_rules(mtp_block_args(args), 0)]


def _into_mtp(rule: KeyRule, k: int) -> KeyRule:
    native = rule.native.replace("layers.0.", f"mtp.{k}.block.", 1)
    return KeyRule(native, tuple(h.replace("model.layers.0.", f"mtp.{k}.", 1) for h in rule.hf))


def key_rules(args: DeepseekV4Args) -> list[KeyRule]:
    rules = [KeyRule("tok_embeddings.weight", ("model.embed_tokens.weight",))]
    for i in range(args.n_layers):
        rules += layer_rules(args, i)
    for k in range(args.mtp_depth):
        rules += mtp_rules(args, k)
    rules += [KeyRule(f"hc_head.{p}", (f"model.hc_head.hc_{p}",)) for p in ("fn", "base", "scale")]
    rules.append(KeyRule("norm.weight", ("model.norm.weight",)))
    if not args.tie_embeddings:
        rules.append(KeyRule("output.weight", ("head.weight",)))
    return rules


def buffer_rules(args: DeepseekV4Args) -> list[KeyRule]:
    """Each hash layer's token-to-experts table, each top-k layer's balancing bias (the MTP
    depths' too)."""
    rules = []
    for i in range(args.n_layers):
        native, hf = ("tid2eid", "tid2eid") if args.is_hash_layer(i) else ("expert_bias", "bias")
        rules.append(
            KeyRule(
                f"layers.{i}.feed_forward.router.{native}", (f"model.layers.{i}.ffn.gate.{hf}",)
            )
        )
    bias = KeyRule("layers.0.feed_forward.router.expert_bias", ("model.layers.0.ffn.gate.bias",))
    return rules + [_into_mtp(bias, k) for k in range(args.mtp_depth)]


def fit_to_folder(args: DeepseekV4Args, tensor_names: set[str]) -> DeepseekV4Args:
    """``num_nextn_predict_layers`` MTP depths only as far as the folder holds them (their
    ``e_proj``): transformers writes 1 and saves none."""
    depth = 0
    while depth < args.mtp_depth and f"mtp.{depth}.e_proj.weight" in tensor_names:
        depth += 1
    return dataclasses.replace(args, mtp_depth=depth)


HUB_SPELLING = (
    ("model.embed_tokens.weight", "embed.weight"),
    ("model.layers.", "layers."),
    ("model.norm.weight", "norm.weight"),
    ("model.hc_head.hc_", "hc_head_"),
)
"""transformers' names -> the released checkpoints' (deepseek-ai/DeepSeek-V4-*), which drop
``model.`` and spell the embedding and the head's hyper-connection otherwise; ``head.weight``
and ``mtp.*`` are the same in both."""

ADAPTER = HFAdapter(
    model_types=("deepseek_v4",),
    args_from_hf=args_from_hf,
    args_to_hf=args_to_hf,
    key_rules=key_rules,
    buffer_rules=buffer_rules,
    fit_to_folder=fit_to_folder,
    # The MTP depths the model leaves out (mtp_depth below the folder's), as they are.
    carried_prefixes=("mtp.",),
    hub_spelling=HUB_SPELLING,
)
