"""What one forward of a decoder shares between its layers, and the one hook through which a
parallel layout changes how a token mixer looks across the sequence.

``ForwardContext`` is built once per forward (``Decoder._hidden_states``) and read by the
layers that need a piece of it: rotary tables, packed documents, the attention backend, the
sequence-parallel slice, the kernel choices, the KV cache. Every block sublayer is called
``forward(x, ctx)``.

A token mixer (attention, MLA, Gated DeltaNet) is token-local except for one step, which needs
whole sequences: ``mix_heads``. The mixer never calls it directly but through its
``sequence_core``, a ``SequenceCore`` that runs ``local_core`` by default. Sequence
parallelism (Ulysses: all-to-alls that trade the sequence slice for a slice of heads) and
context parallelism (ring attention) replace ``sequence_core`` on every ``SequenceMixer`` of
a model, whatever the mixer's kind.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch.distributed import ProcessGroup

from temper.data.batch import SequenceShard
from temper.kernels.attention import Backend, DocumentMask
from temper.kernels.dispatch import REFERENCE, Kernels
from temper.models.layers.kv_cache import LayerCache


@dataclass(frozen=True)
class ForwardContext:
    """One forward's shared inputs; ``layer(i)`` is layer i's view (its own cache)."""

    cos: torch.Tensor
    """Rotary cos [b, s, rotary dims] (fp32) of this forward's tokens; ``sin`` alike."""
    sin: torch.Tensor
    docs: DocumentMask | None = None
    """Packed documents of the whole sequence (None: each row one causal sequence)."""
    backend: Backend = "auto"
    """The attention backend, resolved once per forward."""
    shard: SequenceShard | None = None
    """Set when the tokens are one rank's slice of each sequence (sequence parallelism)."""
    kernels: Kernels = dataclasses.field(default_factory=lambda: REFERENCE)
    """The model's kernel choices (``Decoder.use_kernels``), which layers pass to the fused ops
    they call: ``rms_norm(x, w, eps, ctx.kernels.rmsnorm)``."""
    caches: tuple[LayerCache, ...] = ()
    """Every layer's KV cache while decoding (empty in training)."""
    cache: LayerCache | None = None
    """This layer's KV cache (``layer(i)`` sets it)."""
    head_part: int = 0
    """Which of ``head_parts`` contiguous parts of a mixer's heads ``mix_heads`` runs on: a
    sequence core that splits heads over ranks sets both (per-head weights follow)."""
    head_parts: int = 1
    context_group: ProcessGroup | None = None
    """Set by context parallelism's sequence core: the tokens are this rank's load-balanced
    part of each sequence, and attention runs as ring attention over this group."""
    selected: torch.Tensor | None = None
    """[b, s_q, t] True at the keys each query attends to: sparse attention's top-k choice
    (DeepSeek V3.2), set by that layer for its ``mix_heads`` (every query of the whole
    sequence under sequence parallelism; the new tokens against the cache when decoding)."""
    reused_selection: torch.Tensor | None = None
    """[b, s_q, t] the keys chosen by the latest earlier layer with a sparse-attention indexer,
    for a layer without one (GLM-5's shared layers): the decoder sets it from that block's
    outputs (``BlockAux.selected``)."""
    routes: tuple[torch.Tensor | None, ...] = ()
    """Router replay: each block's experts to impose, [b, s, top_k] (None for a block without
    routed experts); empty: the routers choose."""
    route: torch.Tensor | None = None
    """This layer's experts to impose (``layer(i)`` sets it from ``routes``)."""
    record_routes: bool = False
    """MoE layers return the experts they routed to with their statistics (router replay's
    record, ``RoutingStats.experts``)."""
    token_ids: torch.Tensor | None = None
    """[b, s] this forward's token ids (a sequence-parallel slice's under SP): what a hash
    router (DeepSeek V4's ``HashRouter``) chooses experts by."""

    @property
    def valid_len(self) -> int | None:
        """Tokens of each row that are real (a slice's right padding is not); None: all."""
        return None if self.shard is None else self.shard.valid_len

    def layer(self, index: int) -> ForwardContext:
        """Layer ``index``'s view: the same context with that layer's cache, if decoding, and
        its routes to replay, if any."""
        if not self.caches and not self.routes:
            return self
        return dataclasses.replace(
            self,
            cache=self.caches[index] if self.caches else None,
            route=self.routes[index] if self.routes else None,
        )

    def heads(self, per_head: torch.Tensor) -> torch.Tensor:
        """The rows of a per-head weight [n_heads, ...] that belong to this ``head_part``."""
        return per_head.chunk(self.head_parts)[self.head_part]


@runtime_checkable
class SequenceMixer(Protocol):
    """A token mixer whose only step across tokens is ``mix_heads``, run through the
    swappable ``sequence_core``."""

    sequence_core: SequenceCore

    def mix_heads(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: ForwardContext,
        *heads: torch.Tensor,
    ) -> torch.Tensor:
        """The cross-token step on whole sequences of the heads ``ctx.head_part`` names:
        q, k, v [b, s, h, d] (k and v may have fewer heads) and further per-token, per-head
        inputs ``heads`` [b, s, h, ...] -> [b, s, h, d_out]."""
        ...


class SequenceCore(Protocol):
    """Runs a mixer's ``mix_heads`` on sequence-local q, k, v [b, s_local, h, d] (and the
    per-head ``heads``) and returns its output for the same tokens. ``local_core`` calls it
    as it is; sequence parallelism (Ulysses) and context parallelism (ring attention) wrap it
    with their communication."""

    def __call__(
        self,
        mixer: SequenceMixer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: ForwardContext,
        *heads: torch.Tensor,
    ) -> torch.Tensor: ...


def local_core(
    mixer: SequenceMixer,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx: ForwardContext,
    *heads: torch.Tensor,
) -> torch.Tensor:
    """The sequence core of one process holding whole sequences: ``mix_heads`` itself."""
    return mixer.mix_heads(q, k, v, ctx, *heads)
