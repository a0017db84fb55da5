"""Gated DeltaNet, the linear-attention token mixer of Qwen3-Next and Qwen3.5.

Per token: project q, k (``n_k_heads``) and v, z (``n_v_heads``) and two per-value-head
scalars b, a; run q, k, v through a causal depthwise convolution (kernel 4) and SiLU;
L2-normalize q and k; beta = sigmoid(b) and the log decay g = -exp(A_log) * softplus(a +
dt_bias); mix with the gated delta rule (``temper.kernels.gated_delta``), each key head shared
by a group of ``n_v_heads / n_k_heads`` value heads; then RMSNorm gated by silu(z) per value
head and the output projection.

The convolution and the recurrence are the only steps that look across tokens, and both run
in ``gated_delta_mix`` on whole sequences of some heads (``mix_heads``, called through the
layer's ``sequence_core``, which sequence parallelism wraps as it wraps attention's). Packed
documents are laid out one per row there (``DocumentRows``), so neither the convolution
window nor the state crosses a document start. Under context parallelism each rank runs its
two chunks of the sequence in turn, the state and the convolution window passing from the
rank holding the previous chunk (``temper.kernels.state_chain``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from temper.kernels.attention import DocumentMask
from temper.kernels.causal_conv import causal_conv
from temper.kernels.dispatch import Impl
from temper.kernels.gated_delta import gated_delta_rule, recurrent_gated_delta_rule
from temper.kernels.ring_attention import load_balanced_indices
from temper.kernels.state_chain import Carry, state_chain
from temper.models.layers.context import ForwardContext, SequenceCore, local_core
from temper.models.layers.fused_linear import fused_linears
from temper.models.layers.init import init_linear
from temper.models.layers.kv_cache import LayerCache
from temper.models.layers.norm import GatedRMSNorm

Projections = tuple[torch.Tensor, ...]


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet with Qwen3.5's projections: ``wqkv`` (q, k, v, the convolution's channel
    order), ``wz``, ``wb``, ``wa``. ``GroupedGatedDeltaNet`` holds Qwen3-Next's fused layout.
    It reads no rotary tables from the context: the recurrence orders the tokens."""

    def __init__(
        self,
        dim: int,
        n_k_heads: int,
        n_v_heads: int,
        k_head_dim: int,
        v_head_dim: int,
        conv_kernel: int,
        norm_eps: float,
    ) -> None:
        super().__init__()
        if n_v_heads % n_k_heads:
            raise ValueError(f"n_v_heads {n_v_heads} is not a multiple of n_k_heads {n_k_heads}")
        self.n_k_heads, self.n_v_heads = n_k_heads, n_v_heads
        self.k_head_dim, self.v_head_dim = k_head_dim, v_head_dim
        self.key_dim, self.value_dim = n_k_heads * k_head_dim, n_v_heads * v_head_dim
        self.build_projections(dim)
        channels = 2 * self.key_dim + self.value_dim
        self.conv_weight = nn.Parameter(torch.empty(channels, 1, conv_kernel))
        self.A_log = nn.Parameter(torch.empty(n_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(n_v_heads))
        self.norm = GatedRMSNorm(v_head_dim, norm_eps)
        self.wo = nn.Linear(self.value_dim, dim, bias=False)
        self.sequence_core: SequenceCore = local_core

    def build_projections(self, dim: int) -> None:
        self.wqkv = nn.Linear(dim, 2 * self.key_dim + self.value_dim, bias=False)
        self.wz = nn.Linear(dim, self.value_dim, bias=False)
        self.wb = nn.Linear(dim, self.n_v_heads, bias=False)
        self.wa = nn.Linear(dim, self.n_v_heads, bias=False)

    def project(self, x: torch.Tensor) -> Projections:
        """x [b, s, dim] -> q, k [b, s, n_k, d_k]; v, z [b, s, n_v, d_v]; b, a [b, s, n_v]."""
        b, s, _ = x.shape
        qkv, z, beta, a = fused_linears(x, (self.wqkv, self.wz, self.wb, self.wa))
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = (t.reshape(b, s, self.n_k_heads, self.k_head_dim) for t in (q, k))
        v, z = (t.reshape(b, s, self.n_v_heads, self.v_head_dim) for t in (v, z))
        return q, k, v, z, beta, a

    def init_weights(self, std: float, out_std: float) -> None:
        """``out_std`` is for ``wo``, which writes into the residual stream.

        Mamba 2's (and FLA's) decay init: A = exp(A_log) uniform in [1, 16] and the step
        dt = softplus(dt_bias) log-uniform in [1e-3, 0.1], so a token's log decay -A * dt
        starts between -0.001 and -1.6: the state carries context from the first step, and
        A_log's gradient stands well above fp32 rounding (transformers' dt_bias = 1 gives
        per-token decays down to e^-21, under which both vanish)."""
        for module in self.children():
            if isinstance(module, nn.Linear):
                init_linear(module, out_std if module is self.wo else std)
        bound = 1 / math.sqrt(self.conv_weight.shape[-1])
        nn.init.uniform_(self.conv_weight, -bound, bound)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
        dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(0.1)).exp()
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        self.norm.reset_parameters()

    def head_params(self, part: int, parts: int) -> tuple[torch.Tensor, ...]:
        """Convolution weights [channels, kernel], A_log and dt_bias of heads' part ``part`` of
        ``parts`` (contiguous key heads and the value heads they serve)."""
        w_q, w_k, w_v = self.conv_weight[:, 0].split([self.key_dim, self.key_dim, self.value_dim])
        conv = torch.cat([w.chunk(parts)[part] for w in (w_q, w_k, w_v)])
        return conv, self.A_log.chunk(parts)[part], self.dt_bias.chunk(parts)[part]

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """A KV cache (decoding): continue from its convolution window and state; left-padding
        columns enter as zeros, which leave both as a fresh start would."""
        if ctx.cache is not None:
            x = x * ctx.cache.valid_columns(x.shape[1])[..., None].to(x.dtype)
        q, k, v, z, b, a = self.project(x)
        out = self.sequence_core(self, q, k, v, ctx, b, a)
        return self.wo(self.norm(out, z, ctx.kernels).flatten(2))

    def mix_heads(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: ForwardContext,
        b: torch.Tensor,
        a: torch.Tensor,
    ) -> torch.Tensor:
        """``gated_delta_mix`` on the heads' part ``ctx.head_part``; b, a [b, s, n_v']. Under
        context parallelism (``ctx.context_group``) ``context_parallel_mix``."""
        if ctx.context_group is not None:
            return context_parallel_mix(
                self,
                q,
                k,
                v,
                b,
                a,
                ctx.docs,
                ctx.context_group,
                ctx.head_part,
                ctx.head_parts,
                ctx.kernels.gated_delta,
            )
        return gated_delta_mix(
            self,
            q,
            k,
            v,
            b,
            a,
            ctx.docs,
            ctx.cache,
            part=ctx.head_part,
            parts=ctx.head_parts,
            impl=ctx.kernels.gated_delta,
        )


class GroupedGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's layout: ``wqkvz`` gives, per key head, its q, k and the v and z of the value
    heads it serves; ``wba`` gives per key head those value heads' b then a."""

    def build_projections(self, dim: int) -> None:
        self.wqkvz = nn.Linear(dim, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.wba = nn.Linear(dim, 2 * self.n_v_heads, bias=False)

    def project(self, x: torch.Tensor) -> Projections:
        b, s, _ = x.shape
        group = self.n_v_heads // self.n_k_heads
        d_k, d_v = self.k_head_dim, self.v_head_dim
        qkvz = self.wqkvz(x).view(b, s, self.n_k_heads, -1)
        q, k, v, z = qkvz.split([d_k, d_k, group * d_v, group * d_v], dim=-1)
        v, z = (t.reshape(b, s, self.n_v_heads, d_v) for t in (v, z))
        beta, a = self.wba(x).view(b, s, self.n_k_heads, 2 * group).split([group, group], dim=-1)
        return q, k, v, z, beta.reshape(b, s, -1), a.reshape(b, s, -1)


def gated_delta_mix(
    layer: GatedDeltaNet,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    docs: DocumentMask | None = None,
    cache: LayerCache | None = None,
    part: int = 0,
    parts: int = 1,
    impl: Impl | None = None,
) -> torch.Tensor:
    """Convolution and gated delta rule on whole sequences of heads' part ``part`` of
    ``parts`` (all heads by default): q, k [b, s, n_k', d_k], v [b, s, n_v', d_v], b, a
    [b, s, n_v'] -> [b, s, n_v', d_v]; ``impl``: the rule's kernel (None: the reference).

    Under autograd it saves only its inputs and runs again in backward: what it would keep
    (the convolution's output, the normalized and head-repeated q and k, the chunked rule's
    decays, triangular systems, solutions and per-chunk states) is about nine times the
    size of q, k and v, and recomputing it costs one forward of this function, a small part
    of the layer's step. Deterministic ops only, so the recomputation is exact."""
    if cache is None and torch.is_grad_enabled():
        inputs = (layer, q, k, v, b, a, docs, None, part, parts, impl)
        return checkpoint(_mix, *inputs, use_reentrant=False)
    return _mix(layer, q, k, v, b, a, docs, cache, part, parts, impl)


def _mix(
    layer: GatedDeltaNet,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    docs: DocumentMask | None,
    cache: LayerCache | None,
    part: int,
    parts: int,
    impl: Impl | None,
) -> torch.Tensor:
    conv, A_log, dt_bias = layer.head_params(part, parts)
    shapes = q.shape[2:] + v.shape[2:]
    x, g, beta = _token_inputs(A_log, dt_bias, q, k, v, b, a)
    rows = None if docs is None else DocumentRows(docs)
    if rows is not None:
        x, g, beta = rows.gather(x), rows.gather(g), rows.gather(beta)
    window = None if cache is None else cache.conv_window
    if cache is not None:
        cache.conv_window = next_window(x, window, conv.shape[1])
    q, k, v = _convolve(x, conv, window, shapes)
    if cache is None:
        out, _ = gated_delta_rule(q, k, v, g, beta, impl=impl)
        return out if rows is None else rows.scatter(out)
    if q.shape[1] == 1:
        out, cache.state = recurrent_gated_delta_rule(q, k, v, g, beta, cache.state)
    else:
        out, cache.state = gated_delta_rule(q, k, v, g, beta, cache.state, impl)
    return out


def _token_inputs(
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The convolution's input [b, s, channels] (q, k, v in its channel order), the log decay
    g and beta [b, s, n_v]."""
    x = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return x, g, b.sigmoid()


def _convolve(
    x: torch.Tensor, conv: torch.Tensor, window: torch.Tensor | None, shapes: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The convolution, then q, k normalized (q scaled) and repeated to the value heads, and v:
    the gated delta rule's inputs. ``shapes``: n_k, d_k, n_v, d_v."""
    n_k, d_k, n_v, d_v = shapes
    x = causal_conv(x, conv, window)
    q, k, v = x.split([n_k * d_k, n_k * d_k, n_v * d_v], dim=-1)
    q, k = (t.unflatten(-1, (n_k, d_k)).float() for t in (q, k))
    q = l2_normalize(q) * d_k**-0.5
    k = l2_normalize(k)
    q, k = (t.repeat_interleave(n_v // n_k, dim=2) for t in (q, k))
    return q, k, v.unflatten(-1, (n_v, d_v))


def context_parallel_mix(
    layer: GatedDeltaNet,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    docs: DocumentMask | None,
    group: dist.ProcessGroup,
    part: int = 0,
    parts: int = 1,
    impl: Impl | None = None,
) -> torch.Tensor:
    """``gated_delta_mix`` of this rank's tokens of sequences held by the CP ``group`` in the
    load-balanced layout (``docs``: the whole sequence's documents, or None), on heads' part
    ``part`` of ``parts`` with the rule's kernel ``impl`` as ``gated_delta_mix``. Each of the
    rank's two chunks runs as a one-process call would on its own documents, except that the
    document it continues starts from the state and the last ``kernel - 1`` convolution inputs
    that the previous chunk passed on (``state_chain``); at a document start both are zeros."""
    conv, A_log, dt_bias = layer.head_params(part, parts)
    shapes = q.shape[2:] + v.shape[2:]
    batch, s, n_v, d_v = v.shape
    kernel = conv.shape[1]
    size = dist.get_world_size(group)
    columns = load_balanced_indices(s * size, dist.get_rank(group), size, q.device)
    chunks = [ChunkDocuments(half, docs, batch, kernel) for half in columns.chunk(2)]

    def step(
        half: int, shared: Sequence[torch.Tensor], local: Sequence[torch.Tensor], carry: Carry
    ) -> tuple[torch.Tensor, Carry]:
        conv, A_log, dt_bias = shared
        x, g, beta = _token_inputs(A_log, dt_bias, *local)
        state, window = carry
        chunk = chunks[half]
        rows = chunk.rows
        windows = chunk.first_rows(window * chunk.window_kept[..., None].to(x.dtype))
        states = chunk.first_rows(state * chunk.continues[:, None, None, None].to(state.dtype))
        q, k, v = _convolve(rows.gather(x), conv, windows, shapes)
        g, beta = rows.gather(g), rows.gather(beta)
        out, states = gated_delta_rule(q, k, v, g, beta, states, impl)
        return rows.scatter(out), (states[chunk.last], next_window(x, window, kernel))

    zero = (
        # the rule's state: fp32, or fp64 for fp64 inputs
        q.new_zeros(batch, n_v, shapes[1], d_v, dtype=torch.promote_types(q.dtype, torch.float32)),
        q.new_zeros(batch, kernel - 1, conv.shape[0]),
    )
    return state_chain(step, (conv, A_log, dt_bias), (q, k, v, b, a), zero, group)


class ChunkDocuments:
    """The documents of one CP chunk (global ``columns`` [n] of the whole sequence's ``docs``;
    None: one document per row): laid out one per row (``rows``), which of those rows begin
    each batch row (``first``) and end it (``last``), whether each batch row's first document
    began in an earlier chunk (``continues`` [b]), and which of the ``kernel - 1`` columns
    before the chunk belong to that document (``window_kept`` [b, kernel - 1])."""

    def __init__(
        self, columns: torch.Tensor, docs: DocumentMask | None, batch: int, kernel: int
    ) -> None:
        n, start = columns.numel(), int(columns[0])
        ids = (
            columns.new_zeros(batch, start + n)
            if docs is None
            else docs.doc_ids.to(columns.device, torch.long)
        )
        mine = ids[:, columns]
        starts = torch.ones_like(mine, dtype=torch.bool)
        starts[:, 1:] = mine[:, 1:] != mine[:, :-1]
        local = DocumentMask.from_starts(starts)
        self.rows = DocumentRows(local)
        row_starts = torch.arange(batch, device=columns.device) * n
        self.first = torch.searchsorted(local.cu_seqlens[:-1].long().contiguous(), row_starts)
        self.last = (
            torch.cat([self.first[1:], self.first.new_tensor([len(local.cu_seqlens) - 1])]) - 1
        )
        before = torch.arange(start - kernel + 1, start, device=columns.device)
        same = ids[:, before.clamp(min=0)] == ids[:, start, None]
        self.window_kept = same & (before >= 0)
        self.continues = (ids[:, start] == ids[:, max(start - 1, 0)]) & (start > 0)
        self.n_rows = len(local.cu_seqlens) - 1

    def first_rows(self, per_batch_row: torch.Tensor) -> torch.Tensor:
        """[b, ...] placed at each batch row's first document row of [n_rows, ...], zeros
        elsewhere."""
        whole = per_batch_row.new_zeros(self.n_rows, *per_batch_row.shape[1:])
        return whole.index_copy(0, self.first, per_batch_row)


def next_window(x: torch.Tensor, window: torch.Tensor | None, kernel: int) -> torch.Tensor:
    """The convolution window after inputs x [b, s, c]: the last kernel - 1 inputs so far."""
    if window is None:
        window = x.new_zeros(x.shape[0], kernel - 1, x.shape[2])
    return torch.cat([window.to(x.dtype), x], dim=1)[:, -(kernel - 1) :]


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim (FLA's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class DocumentRows:
    """Packed documents [b, s] laid out one per row [n_docs, longest], right-padded with zeros,
    so that per-row sequence operations restart at every document; ``scatter`` puts the
    results back. Right padding is harmless to causal operations (it comes after)."""

    def __init__(self, docs: DocumentMask) -> None:
        starts = docs.cu_seqlens.long()
        longest = docs.max_seqlen
        offsets = torch.arange(longest, device=starts.device)
        keep = offsets < starts.diff()[:, None]
        # Padding reads the zero row appended after the last token.
        self.index = torch.where(keep, starts[:-1, None] + offsets, starts[-1])
        # Where each token lands in the flattened rows: index arithmetic rather than a
        # boolean mask, so the shapes stay static under torch.compile.
        tokens = torch.arange(docs.doc_ids.numel(), device=starts.device)
        doc = torch.searchsorted(starts[:-1].contiguous(), tokens, right=True) - 1
        self.position = doc * longest + tokens - starts[doc]
        self.shape = tuple(docs.doc_ids.shape)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[b, s, ...] -> [n_docs, longest, ...]."""
        flat = x.flatten(0, 1)
        return torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])[self.index]

    def scatter(self, y: torch.Tensor) -> torch.Tensor:
        """[n_docs, longest, ...] -> [b, s, ...]: documents are in token order."""
        return y.flatten(0, 1)[self.position].view(*self.shape, *y.shape[2:])


def linear_attention_flops_per_token(layer: GatedDeltaNet) -> float:
    """Training FLOPs per token of one layer's recurrence beyond its weights: the state read by
    k, its rank-one update and the read by q, 2 * d_k * d_v each per value head, three times
    over for forward and backward (the recurrent count; the chunked form trades some of it
    for [chunk, chunk] matmuls)."""
    return 3.0 * 3 * 2 * layer.n_v_heads * layer.k_head_dim * layer.v_head_dim
