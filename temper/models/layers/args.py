"""The args every family shares, stated once: a family's ModelArgs subclasses ``DecoderArgs``
(or ``GQAArgs``), adds ``MoEArgs`` when it routes experts, and declares only its own fields
and the defaults in which it differs (as transformers' modular configs do).

Every args class is keyword-only, so a subclass may add required fields after the base's
defaulted ones and flavors read as ``name=value`` tables.
"""

from __future__ import annotations

from dataclasses import dataclass

from temper.models.layers.rope import RopeScaling, YarnScaling


@dataclass(kw_only=True)
class DecoderArgs:
    """Sizes and constants of any decoder: embedding, depth, query heads, norms, rotary, head."""

    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | YarnScaling | None = None
    tie_embeddings: bool = False
    max_seq_len: int = 4096

    def __post_init__(self) -> None:
        """The base of the checks chain: each mixin checks its fields, then calls super."""


@dataclass(kw_only=True)
class GQAArgs(DecoderArgs):
    """A decoder with grouped-query attention: ``n_kv_heads`` key/value heads, each shared by
    ``n_heads // n_kv_heads`` query heads; ``head_dim`` 0 means ``dim // n_heads``."""

    n_kv_heads: int
    head_dim: int = 0
    attention_bias: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.head_dim:
            if self.dim % self.n_heads:
                raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}"
            )


@dataclass(kw_only=True)
class MoEArgs:
    """Routed experts: ``top_k`` of ``n_experts`` experts of ``moe_hidden_dim`` per token;
    every layer is MoE unless a subclass says otherwise (``is_moe_layer``).

    A mixin, listed before a family's decoder args (``class A(MoEArgs, Qwen3Args)``): it holds
    no decoder field, so the defaults a family redeclares stay its own, and its checks run
    after the decoder's (``super().__post_init__`` first)."""

    n_experts: int
    top_k: int
    moe_hidden_dim: int
    """Each routed expert's hidden size."""
    router_aux_loss_coef: float = 0.001
    """Weight of the load-balancing loss added to the token-mean cross-entropy."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, n_experts = {self.n_experts}]")

    def is_moe_layer(self, layer_id: int) -> bool:
        return True


@dataclass(kw_only=True)
class SparseStepMoEArgs(MoEArgs):
    """Experts in the layers transformers' Qwen MoE configs pick: not listed in
    ``mlp_only_layers``, and ``layer_id + 1`` a multiple of ``decoder_sparse_step``; a dense
    SwiGLU of the family's ``ffn_hidden_dim`` elsewhere."""

    norm_topk_prob: bool = True
    """Rescale the top-k router probabilities to sum to 1."""
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        self.mlp_only_layers = tuple(self.mlp_only_layers)
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step {self.decoder_sparse_step} must be >= 1")

    def is_moe_layer(self, layer_id: int) -> bool:
        return (
            layer_id not in self.mlp_only_layers and (layer_id + 1) % self.decoder_sparse_step == 0
        )


def checked_layer_types(
    layer_types: tuple[str, ...], n_layers: int, known: tuple[str, ...]
) -> tuple[str, ...]:
    """``layer_types`` as a tuple (a config may give a list), one of ``known`` per layer."""
    layer_types = tuple(layer_types)
    if len(layer_types) != n_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for n_layers {n_layers}")
    unknown = set(layer_types) - set(known)
    if unknown:
        raise ValueError(f"layer_types {sorted(unknown)} unknown; choose from {known}")
    return layer_types
