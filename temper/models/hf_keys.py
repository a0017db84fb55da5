"""Native <-> Hugging Face names that families share, stated once.

Config fields: ``CONFIG_NAMES`` maps each shared args field to its `config.json` key and
``HF_DEFAULTS`` gives transformers' common defaults for absent keys; a family's
``ConfigNames`` adds its own fields, the shared ones it spells otherwise (gpt-oss's
``num_local_experts``), its other defaults and fixed settings, and reads and writes
config.json with the one table both ways. Weights: the groups most families hold under the
same names (embedding, GQA projections, block and q/k norms, SwiGLU MLPs, the router and
stacked per-expert projections, final norm and head) as ``KeyRule`` builders, so no family
imports another's tables.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from temper.models.hf import KeyRule, rope_from_hf, rope_to_hf
from temper.models.layers.args import DecoderArgs

CONFIG_NAMES: dict[str, str] = {
    # DecoderArgs
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "vocab_size": "vocab_size",
    "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
    "max_seq_len": "max_position_embeddings",
    # GQAArgs, dense MLPs and per-layer attention kinds
    "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "attention_bias": "attention_bias",
    "ffn_hidden_dim": "intermediate_size",
    "mlp_bias": "mlp_bias",
    "layer_types": "layer_types",
    # MoEArgs and SparseStepMoEArgs
    "n_experts": "num_experts",
    "top_k": "num_experts_per_tok",
    "moe_hidden_dim": "moe_intermediate_size",
    "router_aux_loss_coef": "router_aux_loss_coef",
    "norm_topk_prob": "norm_topk_prob",
    "decoder_sparse_step": "decoder_sparse_step",
    "mlp_only_layers": "mlp_only_layers",
}
"""Native args field -> config.json key, for the fields more than one family has."""

HF_DEFAULTS: dict[str, Any] = {
    "norm_eps": 1e-6,
    "tie_embeddings": False,
    "head_dim": 0,
    "attention_bias": False,
    "router_aux_loss_coef": 0.001,
    "decoder_sparse_step": 1,
    "mlp_only_layers": (),
}
"""Field -> value when its config.json key is absent or null, where transformers' config
classes agree (head_dim 0: hidden_size / heads); a family's ``defaults`` take precedence."""

GQA_FALLBACKS = {"n_kv_heads": "n_heads"}
"""Llama-style configs (Llama, Qwen3, gpt-oss): no ``num_key_value_heads`` means one key/value
head per query head."""


SILU = {"hidden_act": "silu"}
"""The activation every family's MLP uses (read and written as a fixed setting)."""


@dataclass(frozen=True)
class ConfigNames:
    """How one family's args are named in config.json: ``CONFIG_NAMES``, then ``own`` (its
    fields no other family has) and ``aliases`` (shared fields under another key)."""

    model_type: str
    architecture: str
    args_cls: type[DecoderArgs]
    own: Mapping[str, str] = field(default_factory=dict)
    aliases: Mapping[str, str] = field(default_factory=dict)
    also_read: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Further keys a field is read from when its own is absent (``num_local_experts``, the
    alias under which transformers' ``save_pretrained`` may write ``num_experts``)."""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """Field -> value when its key is absent or null, where the family's transformers config
    class differs from ``HF_DEFAULTS`` or adds to them. A named field without a default is
    required (KeyError naming the key)."""
    native_only: frozenset[str] = frozenset()
    """Named fields that this family's HF config does not hold: neither read nor written."""
    fallbacks: Mapping[str, str] = field(default_factory=lambda: GQA_FALLBACKS)
    """Field -> the (earlier) field whose value it takes when its key is absent or null."""
    fixed: Mapping[str, Any] = field(default_factory=lambda: SILU)
    """Settings the native model has one way only: refused otherwise, written as they are."""
    rope_types: tuple[str, ...] = ("default", "llama3")
    """The rope types ``args_from_hf`` reads (``rope_from_hf``)."""

    def names(self) -> dict[str, str]:
        return {**CONFIG_NAMES, **self.own, **self.aliases}

    def _named_fields(self) -> list[str]:
        names = self.names()
        return [
            f.name
            for f in dataclasses.fields(self.args_cls)
            if f.init and f.name in names and f.name not in self.native_only
        ]

    def read(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """The named fields from an HF config dict, after checking ``fixed`` (lists as read;
        the args make tuples of them)."""
        check_fixed(config, self.fixed)
        names, defaults, fields = self.names(), HF_DEFAULTS | dict(self.defaults), {}
        for name in self._named_fields():
            keys = (names[name], *self.also_read.get(name, ()))
            present = [config[k] for k in keys if config.get(k) is not None]
            if present:
                fields[name] = present[0]
            elif name in defaults:
                fields[name] = defaults[name]
            elif name in self.fallbacks:
                fields[name] = fields[self.fallbacks[name]]
            else:
                raise KeyError(keys[0])
        return fields

    def write(self, args: DecoderArgs) -> dict[str, Any]:
        """Architecture, model type, the named fields (tuples as lists) and ``fixed``."""
        names = self.names()
        entries: dict[str, Any] = {"architectures": [self.architecture]}
        entries["model_type"] = self.model_type
        for name in self._named_fields():
            value = getattr(args, name)
            entries[names[name]] = list(value) if isinstance(value, tuple) else value
        return entries | dict(self.fixed)

    def args_from_hf(self, config: Mapping[str, Any]) -> Any:
        """The args of an HF config dict whose rotary is ``rope_from_hf``'s."""
        fields = self.read(config)
        theta, scaling = rope_from_hf(config, self.rope_types)
        return self.args_cls(**fields, rope_theta=theta, rope_scaling=scaling)

    def args_to_hf(self, args: DecoderArgs) -> dict[str, Any]:
        return self.write(args) | rope_to_hf(args.rope_theta, args.rope_scaling)


def check_fixed(config: Mapping[str, Any], fixed: Mapping[str, Any]) -> None:
    """Refuse a config whose ``fixed`` keys hold another value than the one the native model
    has; an absent or null key is transformers' default, that value."""
    for key, value in fixed.items():
        if config.get(key) is not None and config[key] != value:
            raise ValueError(f"{key} {config[key]!r} is not supported ({value!r} is)")


ATTENTION_PROJECTIONS = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
}
QK_NORM_KEYS = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
BLOCK_NORM_KEYS = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
EMBEDDING_RULE = KeyRule("tok_embeddings.weight", ("model.embed_tokens.weight",))


def linear_keys(modules: Mapping[str, str], bias: bool) -> dict[str, str]:
    """Native -> HF tensor names of linear layers: each weight, then its bias if any."""
    params = ("weight", "bias") if bias else ("weight",)
    return {f"{n}.{p}": f"{h}.{p}" for n, h in modules.items() for p in params}


def attention_keys(bias: bool = False) -> dict[str, str]:
    """The q, k, v and o projections of GQA attention (and of gated attention)."""
    return linear_keys(ATTENTION_PROJECTIONS, bias)


def mlp_keys(native: str = "feed_forward", hf: str = "mlp", bias: bool = False) -> dict[str, str]:
    """A SwiGLU's gate, up and down projections; ``native``/``hf`` name where it sits (a
    shared expert: ``feed_forward.shared_experts`` and the family's HF module)."""
    projections = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    return linear_keys({f"{native}.{w}": f"{hf}.{p}" for w, p in projections.items()}, bias)


def block_rules(layer_id: int, keys: Mapping[str, str]) -> list[KeyRule]:
    """One rule per entry of ``keys`` (names within a block) in layer ``layer_id``."""
    return [
        KeyRule(f"layers.{layer_id}.{n}", (f"model.layers.{layer_id}.{h}",))
        for n, h in keys.items()
    ]


def router_rule(layer_id: int) -> KeyRule:
    """The router's gate, HF's ``mlp.gate`` (Qwen MoE, Qwen3-Next, DeepSeek V3)."""
    return KeyRule(
        f"layers.{layer_id}.feed_forward.router.gate.weight",
        (f"model.layers.{layer_id}.mlp.gate.weight",),
    )


def stacked_expert_rules(layer_id: int, n_experts: int) -> list[KeyRule]:
    """Each native stacked expert weight (w1, w3, w2) over the n_experts per-expert HF
    tensors (``mlp.experts.E.gate_proj.weight``...), in expert order: how hub checkpoints and
    transformers' ``save_pretrained`` store them."""
    native, hf = f"layers.{layer_id}.feed_forward.experts", f"model.layers.{layer_id}.mlp.experts"
    projections = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    return [
        KeyRule(f"{native}.{w}", tuple(f"{hf}.{e}.{proj}.weight" for e in range(n_experts)))
        for w, proj in projections.items()
    ]


def head_rules(args: DecoderArgs) -> list[KeyRule]:
    """The final norm, then the LM head unless it is the embedding (tied)."""
    rules = [KeyRule("norm.weight", ("model.norm.weight",))]
    if not args.tie_embeddings:
        rules.append(KeyRule("output.weight", ("lm_head.weight",)))
    return rules


def decoder_rules(args: DecoderArgs, block: Callable[[int], list[KeyRule]]) -> list[KeyRule]:
    """Embedding, each layer's ``block(layer_id)``, final norm and head."""
    rules = [EMBEDDING_RULE]
    for i in range(args.n_layers):
        rules += block(i)
    return rules + head_rules(args)


def uniform_rules(args: DecoderArgs, keys: Mapping[str, str]) -> list[KeyRule]:
    """``decoder_rules`` of a model whose every block holds the same ``keys``."""
    return decoder_rules(args, lambda i: block_rules(i, keys))
