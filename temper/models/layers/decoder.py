"""The decoder skeleton that Llama-style families share; a family states only what differs.

Embedding, pre-norm blocks of rotary GQA attention and an MLP, final norm and LM head, with
optional tied embeddings. A family subclasses ``Decoder`` and sets ``qk_norm`` or overrides
``attention(layer_id)`` (MLA) and ``feed_forward(layer_id)`` (dense, bias or MoE). Its args
subclass ``layers.args.DecoderArgs``; the default hooks read ``GQAArgs``' heads and
``ffn_hidden_dim``, which a family that overrides them (DeepSeek's MLA, gpt-oss) need not have.
``attn_backend`` is a run-time choice, not part of the architecture: it never enters the
state dict. Under sequence parallelism the decoder runs on a slice of each sequence and is
told so by a ``SequenceShard`` argument.

Each forward builds one ``ForwardContext`` (rotary tables, documents, backend, the slice, the
KV cache, the kernel choices, router replay's routes) and hands every block its layer's view;
blocks call their sublayers ``(x, ctx)``. A block returns its output and, if its MLP is a
mixture of experts, that layer's ``RoutingStats``, and if its attention is DeepSeek sparse
attention, the indexer's KL term, in one ``BlockAux``; the decoder collects them at its top
level, outside any checkpointed or compiled block, into ``last_routing`` and
``last_indexer_kl``. The kernel choices are the model's own (``use_kernels``, which an Engine
calls with its run's): a model nobody configured runs every op's reference. ``LanguageModel``
is what every family's model offers its callers (``forward``, ``hidden_states``,
``use_kernels``), DeepSeek V4's too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from temper.data.batch import SequenceShard
from temper.kernels.attention import Backend, DocumentMask, prepare_documents
from temper.kernels.dispatch import REFERENCE, Kernels
from temper.models.layers.args import DecoderArgs
from temper.models.layers.attention import Attention
from temper.models.layers.context import ForwardContext
from temper.models.layers.init import depth_scaled_std, trunc_normal_
from temper.models.layers.kv_cache import KVCache
from temper.models.layers.mlp import FeedForward
from temper.models.layers.moe import MoE, RoutingStats, keep_routing
from temper.models.layers.norm import RMSNorm
from temper.models.layers.rope import rope_cos_sin, rope_inv_freq
from temper.models.layers.route_replay import RouterReplay
from temper.models.layers.sparse_attention import SparseMLA

INIT_STD = 0.02


class BlockAux(NamedTuple):
    """What a block returns beside its hidden state: its sublayers' auxiliary outputs of one
    forward, each None where the block has no such sublayer or it computed none. Outputs, not
    state the layers keep: a pytree that activation checkpointing, torch.compile and FSDP pass
    through as they pass the hidden state, so a recomputation has nothing to overwrite."""

    routing: RoutingStats | None = None
    """Its MoE layer's routing statistics."""
    indexer_kl: torch.Tensor | None = None
    """[] its sparse-attention indexer's KL term (``SparseMLA``, when the indexer trains)."""
    selected: torch.Tensor | None = None
    """[b, s, t] the keys its sparse attention chose, which the next blocks without an
    indexer reuse (``ForwardContext.reused_selection``)."""


class Block(nn.Module):
    """Pre-norm block: attention then the MLP, each added to the residual stream."""

    def __init__(
        self,
        args: DecoderArgs,
        attention: nn.Module,
        feed_forward: nn.Module,
        norm_cls: Callable[[int, float], nn.Module] = RMSNorm,
    ) -> None:
        super().__init__()
        self.attention = attention
        self.feed_forward = feed_forward
        self.attention_norm = norm_cls(args.dim, args.norm_eps)
        self.ffn_norm = norm_cls(args.dim, args.norm_eps)
        self.routed = isinstance(feed_forward, MoE)
        self.indexed = isinstance(attention, SparseMLA)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, BlockAux]:
        """The block's output and its auxiliary outputs (``BlockAux``)."""
        kl = selected = None
        if self.indexed:
            out, (kl, selected) = self.attention(self.attention_norm(x, ctx.kernels), ctx)
        else:
            out = self.attention(self.attention_norm(x, ctx.kernels), ctx)
        h = x + out
        if not self.routed:
            h = h + self.feed_forward(self.ffn_norm(h, ctx.kernels), ctx)
            return h, BlockAux(None, kl, selected)
        out, stats = self.feed_forward(self.ffn_norm(h, ctx.kernels), ctx)
        return h + out, BlockAux(stats, kl, selected)


class LanguageModel(nn.Module):
    """What every family's causal LM offers its callers (objectives, the Engine, generation):
    ``forward`` gives logits, ``hidden_states`` the head's input, ``use_kernels`` sets the
    fused ops' implementations. A family writes ``_hidden_states`` and has an ``output``
    head."""

    output: nn.Linear
    kernels: Kernels = REFERENCE
    """The fused ops' implementations each forward's context carries (``use_kernels``)."""
    _hidden_states: Callable[..., torch.Tensor]
    """The family's body of ``hidden_states`` and ``forward``, with their arguments: FSDP2
    wraps the public method in its root hooks (the fused loss calls it alone), and forward
    already runs inside them; calling the wrapped method from forward would enter them
    twice."""

    def use_kernels(self, kernels: Kernels) -> None:
        """Run the fused ops as ``kernels`` says from now on: an Engine's choices, resolved for
        its device (``temper.kernels.dispatch.resolve_kernels``). The model's own, so two
        models in one process may differ; never part of the state dict."""
        self.kernels = kernels

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        docs: DocumentMask | None = None,
        cache: KVCache | None = None,
        shard: SequenceShard | None = None,
        **inputs: torch.Tensor | None,
    ) -> torch.Tensor:
        """Final-norm output [b, s, dim], so a fused loss can apply ``output`` itself.

        ``docs`` (from the full batch's ``position_ids``) keeps packed documents apart;
        without it each row is one causal sequence. With a KV ``cache`` (decoding) the tokens
        follow those of earlier calls, whose keys it holds (the shared decoder's attention
        then runs on sdpa with the cache's mask, whatever ``attn_backend`` is). ``shard`` says
        that the tokens (and positions) are a sequence-parallel slice (``docs`` then describes
        the whole sequence), and so is the output. ``inputs``: a family's further inputs (a
        vision-language model's images, which ``Decoder.embed_inputs`` reads).
        """
        return self._hidden_states(input_ids, position_ids, docs, cache, shard, **inputs)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        docs: DocumentMask | None = None,
        cache: KVCache | None = None,
        shard: SequenceShard | None = None,
        **inputs: torch.Tensor | None,
    ) -> torch.Tensor:
        """Logits [b, s, vocab] for token ids [b, s]; positions default to 0..s-1; ``inputs``
        as ``hidden_states``.

        With a KV ``cache`` (decoding, see ``hidden_states``), only the last position's logits
        [b, 1, vocab]: nothing else is sampled from, and a long prompt's would be huge.
        """
        h = self._hidden_states(input_ids, position_ids, docs, cache, shard, **inputs)
        return self.output(h if cache is None else h[:, -1:])


class Decoder(LanguageModel):
    """The shared decoder (module docstring): ``forward`` gives logits, ``hidden_states`` the
    input to the head."""

    qk_norm: bool = False
    """Per-head RMSNorm of q and k before rotary (Qwen3)."""
    attn_backend: Backend = "auto"
    """Attention backend (``temper.kernels.attention``); the trainer sets it from model.attn."""
    sliding_window: int | None = None
    """The window of the layers that attend within one (gpt-oss), so flex masks are shared."""
    attention_sinks: bool = False
    """Layers add a learned sink logit per head (gpt-oss): on CUDA, ``auto`` picks flex."""
    norm_cls: Callable[[int, float], nn.Module] = RMSNorm
    """The block and final norms: ``norm_cls(dim, eps)``."""

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(
            Block(args, self.attention(i), self.feed_forward(i), self.norm_cls)
            for i in range(args.n_layers)
        )
        self.norm = self.norm_cls(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Derived from args, never checkpointed: init_weights recomputes it after to_empty.
        self.register_buffer("inv_freq", self.rope_inv_freq(), persistent=False)
        self.router_replay = RouterReplay()
        """Router replay's routes to impose and record flag, put in each forward's context."""
        self.last_routing: list[RoutingStats] = []
        """The routing statistics of the latest forward, one per MoE layer that ran."""
        self.last_indexer_kl: list[torch.Tensor] = []
        """The sparse-attention indexers' KL terms of the latest forward, one per block that
        computed one, in layer order."""

    def rope_inv_freq(self) -> torch.Tensor:
        """Rotary inverse frequencies over the whole head unless a family rotates fewer dims."""
        args = self.args
        return rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling)

    def rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for ``position_ids``, shared by every layer of one forward."""
        return rope_cos_sin(self.inv_freq, position_ids)

    def attention(self, layer_id: int) -> nn.Module:
        """The attention of layer ``layer_id``: rotary GQA unless a family overrides it."""
        args = self.args
        return Attention(
            args.dim,
            args.n_heads,
            args.n_kv_heads,
            args.head_dim,
            bias=args.attention_bias,
            qk_norm_eps=args.norm_eps if self.qk_norm else None,
        )

    def feed_forward(self, layer_id: int) -> nn.Module:
        """The MLP of layer ``layer_id``: a bias-free SwiGLU unless a family overrides it."""
        return FeedForward(self.args.dim, self.args.ffn_hidden_dim)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Materialize every parameter and buffer from the current torch RNG (after to_empty)."""
        args = self.args
        if args.tie_embeddings:
            # to_empty gives each module its own new Parameter, which breaks the tie.
            self.output.weight = self.tok_embeddings.weight
        self.inv_freq.copy_(self.rope_inv_freq())
        nn.init.normal_(self.tok_embeddings.weight, std=INIT_STD)
        out_std = depth_scaled_std(INIT_STD, args.n_layers)
        for layer in self.layers:
            layer.attention.init_weights(INIT_STD, out_std)
            layer.feed_forward.init_weights(INIT_STD, out_std)
            layer.attention_norm.reset_parameters()
            layer.ffn_norm.reset_parameters()
        self.norm.reset_parameters()
        if not args.tie_embeddings:
            trunc_normal_(self.output.weight, INIT_STD)

    def embed_inputs(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        shard: SequenceShard | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first hidden states [b, s, dim] and the positions rotary reads where they are
        not ``position_ids`` (None here): the token embeddings. A vision-language model
        overrides it to put image features in place of image tokens and to return multimodal
        positions [3, b, s], taking its images as keyword ``inputs``."""
        return self.tok_embeddings(input_ids), None

    def _hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        docs: DocumentMask | None,
        cache: KVCache | None,
        shard: SequenceShard | None,
        **inputs: torch.Tensor | None,
    ) -> torch.Tensor:
        """The shared body of ``hidden_states`` and ``forward``. Where ``embed_inputs`` gives
        multimodal rotary positions, ``position_ids`` still find the packed documents."""
        h, rope_position_ids = self.embed_inputs(input_ids, position_ids, shard, **inputs)
        if position_ids is None:
            start = 0 if cache is None else cache.length
            position_ids = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
            position_ids = position_ids[None]
        cos, sin = self.rope(position_ids if rope_position_ids is None else rope_position_ids)
        if cache is None:
            backend, docs = prepare_documents(
                self.attn_backend,
                docs,
                h,
                input_ids.shape[1] if shard is None else shard.seq_len,
                window=self.sliding_window,
                sinks=self.attention_sinks,
            )
            ctx = ForwardContext(
                cos,
                sin,
                docs,
                backend,
                shard,
                self.kernels,
                token_ids=input_ids,
                **self.router_replay.fields(self),
            )
        elif docs is not None or shard is not None:
            raise ValueError(
                "a KV cache decodes whole rows; packed documents and sequence-parallel slices "
                "are for training"
            )
        else:
            caches = tuple(cache.extend(h.shape[1]))
            ctx = ForwardContext(
                cos,
                sin,
                backend="sdpa",
                kernels=self.kernels,
                caches=caches,
                token_ids=input_ids,
                **self.router_replay.fields(self),
            )
        routing: list[RoutingStats] = []
        indexer_kl: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            h, outputs = layer(h, ctx.layer(i))
            keep_routing(routing, layer.feed_forward, outputs.routing)
            if outputs.selected is not None:
                ctx = dataclasses.replace(ctx, reused_selection=outputs.selected)
            # A selection [b, s, t] is passed on to the next blocks, never kept past the forward.
            if outputs.indexer_kl is not None:
                indexer_kl.append(outputs.indexer_kl)
        self.last_routing, self.last_indexer_kl = routing, indexer_kl
        self.router_replay.keep(routing)
        return self.norm(h, self.kernels)

    def active_params(self, trainable: bool | None = None) -> float:
        """Weights a token is multiplied by: all but the input embedding, a lookup (a tied
        table counts once, as the head). ``trainable`` True or False counts only the weights
        that do or do not train."""
        counted = [
            p for p in self.parameters() if trainable is None or p.requires_grad == trainable
        ]
        n = sum(p.numel() for p in counted)
        embedding = self.tok_embeddings.weight
        if not self.args.tie_embeddings and any(p is embedding for p in counted):
            n -= embedding.numel()
        return n

    def weight_flops_per_token(self) -> float:
        """Matmul FLOPs of the weights per trained token: 2 forward and 2 for the input's
        gradient per active weight, and 2 more for the weight's own gradient only where it
        trains (a frozen base under LoRA costs 4, its adapters 6)."""
        return 6.0 * self.active_params(trainable=True) + 4.0 * self.active_params(trainable=False)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token at ``seq_len``: the weights'
        (``weight_flops_per_token``: torchtitan's 6 per weight when all train), plus 12 *
        n_layers * n_heads * head_dim * seq_len for the QK^T and AV matmuls (full, not
        causal-halved, scores)."""
        args = self.args
        attention = 12.0 * args.n_layers * args.n_heads * args.head_dim * seq_len
        return self.weight_flops_per_token() + attention
