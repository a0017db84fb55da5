"""DeepSeek V4's multi-token prediction: extra depths, each a V4 block predicting one token
further, trained jointly with the backbone (DeepSeek V3's scheme, ``temper.models.layers.mtp``,
on V4's streams).

What differs from V3, as DeepSeek's V4 inference code (``MTPBlock``) and released checkpoint
(``mtp.0.*``) hold it: a depth reads the ``hc_mult`` residual streams, not a normed hidden
state. At position t, depth k (0-based) takes the previous depth's streams (depth 0: the main
model's last block's output, before its hyper head) and the embedding of token t + k + 1::

    streams = e_proj(enorm(embed(token t + k + 1)))[:, :, None] + h_proj(hnorm(streams))
    streams = block(streams)                    # a V4 block: hyper-connections, attention, MoE
    hidden  = norm(hc_head(streams))            # its own hyper head and norm

and predicts token t + k + 2 through the main model's head; the embedding and head are the
main model's, shared. The block is a sliding-window layer with top-k routed experts: the
released config lists compression ratio 0 at the MTP layer's index (``compress_ratios[43]``
of V4-Flash's 44), its ``mtp.0`` tensors hold no compressor or indexer, and its gate has a
balancing bias (it is past the hash-routed layers). The loss is V3's (``mtp_loss``).

Under Ulysses sequence parallelism a depth's next tokens and targets at a slice's end sit on
the next rank: V3's ``shifted_ids`` and ``mtp_loss`` join the slices' token ids and labels
into the whole sequence before each rank keeps its slice; the block itself gathers its
attention inputs as the main layers do.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from temper.models.deepseek_v4.args import SLIDING, DeepseekV4Args
from temper.models.layers.compressed_attention import CompressedContext
from temper.models.layers.decoder import BlockAux
from temper.models.layers.hyper_connections import HyperHead
from temper.models.layers.init import init_linear
from temper.models.layers.moe import RoutingStats, keep_routing
from temper.models.layers.mtp import shifted_ids
from temper.models.layers.norm import RMSNorm


def mtp_block_args(args: DeepseekV4Args) -> DeepseekV4Args:
    """The args of a one-layer model whose layer is an MTP depth's block: sliding-window
    attention, top-k routed experts."""
    return dataclasses.replace(args, n_layers=1, layer_types=(SLIDING,), mlp_layer_types=("moe",))


class DeepseekV4MTP(nn.Module):
    """One MTP depth (HF's ``mtp.{k}``): ``e_proj``, ``h_proj``, ``enorm``, ``hnorm``, a V4
    ``block``, its ``hc_head`` and ``norm``."""

    def __init__(self, args: DeepseekV4Args, block: nn.Module) -> None:
        super().__init__()
        dim, eps = args.dim, args.norm_eps
        self.e_proj = nn.Linear(dim, dim, bias=False)
        self.h_proj = nn.Linear(dim, dim, bias=False)
        self.enorm = RMSNorm(dim, eps)
        self.hnorm = RMSNorm(dim, eps)
        self.block = block
        self.hc_head = HyperHead(dim, args.hc_mult, eps=args.hc_eps, norm_eps=eps)
        self.norm = RMSNorm(dim, eps)

    def init_weights(self, std: float, out_std: float) -> None:
        for norm in (self.enorm, self.hnorm, self.norm):
            norm.reset_parameters()
        init_linear(self.e_proj, std)
        init_linear(self.h_proj, std)
        self.block.init_weights(std, out_std)
        self.hc_head.init_weights(std)

    def forward(
        self, streams: torch.Tensor, embedded: torch.Tensor, ctx: CompressedContext
    ) -> tuple[torch.Tensor, BlockAux]:
        """streams [b, s, hc_mult, dim] and the next tokens' embeddings [b, s, dim] -> this
        depth's streams (the next depth's input) and its block's auxiliary outputs; ``ctx``
        as a main sliding layer's (no cache, no routes to replay)."""
        kernels = ctx.kernels
        embedded, streams = self.enorm(embedded, kernels), self.hnorm(streams, kernels)
        return self.block(self.e_proj(embedded).unsqueeze(2) + self.h_proj(streams), ctx)


def predict_ahead(
    depths: nn.ModuleList,
    streams: torch.Tensor,
    embedding: nn.Embedding,
    input_ids: torch.Tensor,
    ctx: CompressedContext,
    routing: list[RoutingStats],
) -> list[torch.Tensor]:
    """Each depth's normed hidden state [b, s, dim] from the main model's last streams, its
    block run on ``ctx``; each depth's routing statistics join ``routing`` (the forward's,
    ``keep_routing``)."""
    normed = []
    for k, depth in enumerate(depths):
        embedded = embedding(shifted_ids(input_ids, k + 1, ctx.shard))
        streams, aux = depth(streams, embedded, ctx)
        keep_routing(routing, depth.block.feed_forward, aux.routing)
        normed.append(depth.norm(depth.hc_head(streams), ctx.kernels))
    return normed
