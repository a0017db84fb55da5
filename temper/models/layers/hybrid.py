"""The decoder skeleton of the Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5, Qwen3.5-MoE).

``layer_types`` names each layer's token mixer: ``linear_attention`` (Gated DeltaNet) or
``full_attention`` (gated attention with partial rotary). Norms are the zero-centred
(1 + w) RMSNorm. Qwen3.5 takes its rotary angles from multimodal positions (mRoPE sections);
a text-only batch gives all three axes the same positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from temper.models.layers.args import GQAArgs, SparseStepMoEArgs, checked_layer_types
from temper.models.layers.attention import GatedAttention
from temper.models.layers.decoder import Decoder
from temper.models.layers.gated_deltanet import GatedDeltaNet, linear_attention_flops_per_token
from temper.models.layers.mlp import FeedForward
from temper.models.layers.moe import MoE
from temper.models.layers.moe_decoder import MoEDecoder
from temper.models.layers.norm import ZeroCenteredRMSNorm
from temper.models.layers.rope import mrope_cos_sin, rope_inv_freq

LAYER_TYPES = ("linear_attention", "full_attention")


def interval_layer_types(n_layers: int, interval: int = 4) -> tuple[str, ...]:
    """Full attention at every ``interval``-th layer, Gated DeltaNet elsewhere (3 of 4)."""
    return tuple(
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)
    )


@dataclass(kw_only=True)
class HybridArgs(GQAArgs):
    """Shapes of a Gated DeltaNet hybrid; ``linear_*`` size the Gated DeltaNet layers."""

    ffn_hidden_dim: int
    layer_types: tuple[str, ...]
    linear_n_k_heads: int
    linear_n_v_heads: int
    linear_k_head_dim: int
    linear_v_head_dim: int
    linear_conv_kernel: int = 4
    partial_rotary_factor: float = 0.25
    """Share of each attention head's dims that rotary rotates (the first ones)."""
    mrope_section: tuple[int, int, int] | None = None
    """Frequencies per (time, height, width) axis of multimodal rotary; None: plain rotary."""
    rope_theta: float = 10000000.0
    max_seq_len: int = 262144

    def __post_init__(self) -> None:
        super().__post_init__()
        self.layer_types = checked_layer_types(self.layer_types, self.n_layers, LAYER_TYPES)
        if self.linear_n_v_heads % self.linear_n_k_heads:
            raise ValueError(
                f"linear_n_v_heads {self.linear_n_v_heads} is not a multiple of "
                f"linear_n_k_heads {self.linear_n_k_heads}"
            )

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


@dataclass(kw_only=True)
class HybridMoeArgs(SparseStepMoEArgs, HybridArgs):
    """A hybrid whose MLPs are routed experts plus a sigmoid-gated shared expert;
    ``ffn_hidden_dim`` sizes the dense layers, if any."""

    shared_expert_hidden_dim: int


class HybridDecoder(Decoder):
    """Gated DeltaNet or gated attention by ``args.layer_types``, zero-centred norms, partial
    (and, with ``mrope_section``, multimodal) rotary. ``linear_attention_cls`` is the Gated
    DeltaNet's projection layout."""

    args: HybridArgs
    norm_cls = ZeroCenteredRMSNorm
    linear_attention_cls: type[GatedDeltaNet] = GatedDeltaNet

    def attention(self, layer_id: int) -> nn.Module:
        args = self.args
        if args.layer_types[layer_id] == "linear_attention":
            return self.linear_attention_cls(
                args.dim,
                args.linear_n_k_heads,
                args.linear_n_v_heads,
                args.linear_k_head_dim,
                args.linear_v_head_dim,
                args.linear_conv_kernel,
                args.norm_eps,
            )
        return GatedAttention(
            args.dim,
            args.n_heads,
            args.n_kv_heads,
            args.head_dim,
            ZeroCenteredRMSNorm,
            args.norm_eps,
            bias=args.attention_bias,
        )

    def rope_inv_freq(self) -> torch.Tensor:
        return rope_inv_freq(self.args.rotary_dim, self.args.rope_theta)

    def rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Text positions [b, s] (or [3, b, s] multimodal ones with ``mrope_section``)."""
        sections = self.args.mrope_section
        if sections is None:
            return super().rope(position_ids)
        return mrope_cos_sin(self.inv_freq, position_ids, sections)

    def flops_per_token(self, seq_len: int) -> float:
        """The weights' (``weight_flops_per_token``), the full-attention layers' scores (as the
        dense count) and each Gated DeltaNet layer's recurrence
        (``linear_attention_flops_per_token``)."""
        args = self.args
        flops = self.weight_flops_per_token()
        for layer in self.layers:
            mixer = layer.attention
            if isinstance(mixer, GatedDeltaNet):
                flops += linear_attention_flops_per_token(mixer)
            else:
                flops += 12.0 * args.n_heads * args.head_dim * seq_len
        return flops


class HybridMoeDecoder(HybridDecoder, MoEDecoder):
    """A hybrid with routed experts and a sigmoid-gated shared expert where
    ``args.is_moe_layer`` (a dense SwiGLU elsewhere)."""

    args: HybridMoeArgs

    def feed_forward(self, layer_id: int) -> nn.Module:
        args = self.args
        if not args.is_moe_layer(layer_id):
            return FeedForward(args.dim, args.ffn_hidden_dim)
        return MoE(
            args.dim,
            args.moe_hidden_dim,
            args.n_experts,
            args.top_k,
            args.norm_topk_prob,
            shared_hidden_dim=args.shared_expert_hidden_dim,
            shared_gate=True,
        )
