"""Activation memory of one micro-batch, measured rather than modelled: the run's own forward
on the meta device (shapes only, no data, no memory), with every tensor autograd saves for
backward counted per block, and the outputs that selective checkpointing keeps beside them.

Each family's code is its own formula this way: MLA, Gated DeltaNet, MoE dispatch and the
fused loss save what they save. The counts are the unsharded model's on one rank's tokens
(``local_batch_size x seq_len / sp``), which is what a rank holds under FSDP (parameters are
sharded, activations are not) and Ulysses SP (a rank's slice of the sequence; attention's
all-to-all trades heads for tokens). Under EP the experts run behind a stand-in for the
all-to-all dispatcher that receives ``imbalance`` times the rows the rank sends: routing
does not split tokens evenly, and the plan is the busiest rank's.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

from temper.config import Config
from temper.kernels import attention as attention_kernels
from temper.kernels.dispatch import Kernels, resolve_kernels
from temper.models.layers.context import ForwardContext, SequenceMixer, local_core
from temper.models.layers.experts import Experts
from temper.models.layers.moe import moe_layers
from temper.objectives import Objective
from temper.parallel.activation_checkpoint import SAVED_OPS
from temper.parallel.ulysses import sequence_mixers
from temper.utils.compat import TorchDispatchMode


@dataclass
class BlockActivations:
    """Bytes one block holds between its forward and its backward."""

    saved: int = 0
    """What autograd saves in it (no checkpointing), less parameters."""
    kept: int = 0
    """Outputs of the ops selective checkpointing keeps (matmuls, attention, all-to-alls)."""
    input: int = 0
    """Its input hidden states: all that full checkpointing keeps."""
    largest: int = 0
    """Its largest saved tensor: its backward makes gradients that size (SwiGLU's gate and
    up, say)."""
    after_largest: int = 0
    """Saved by the block's parts (direct children) after the one that saved ``largest``:
    their backward ran and freed it before that part's (the MoE's before CPU MLA's softmax)."""
    parts: list[int] = field(default_factory=lambda: [0], repr=False)
    """Bytes saved per part, in the order they ran (the block's own code before any child
    first); ``part`` is the one running."""
    part: int = 0
    largest_part: int = 0
    forward_peak: int = 0
    """The most bytes alive at once of what its forward allocated, saved or not (Gated
    DeltaNet's chunk matrices, say): also its recomputation's peak."""

    def add(self, n: int) -> None:
        self.parts[self.part] += n
        if n > self.largest:
            self.largest, self.largest_part = n, self.part
        self.after_largest = sum(self.parts[self.largest_part + 1 :])

    def start_part(self) -> None:
        """A direct child's forward begins: a new part, in execution order."""
        self.part = len(self.parts)
        self.parts.append(0)


@dataclass
class Activations:
    """One micro-batch's activation bytes on one rank, per block and outside the blocks
    (embedding, final norm, loss and its chunked head)."""

    blocks: list[BlockActivations] = field(default_factory=list)
    outside: int = 0
    attention_io: int = 0
    """Bytes of q, k, v, the other per-head inputs and the output per micro-batch over all
    token mixers (attention, Gated DeltaNet): what Ulysses' all-to-alls move."""
    attention_kv: int = 0
    """The attention layers' k and v bytes: what ring attention passes around the CP ranks
    (Gated DeltaNet passes its state instead)."""
    leading: int = 0
    """Of ``outside``, what is saved before the blocks end (the embedding's)."""
    loss_peak: int = 0
    """The most bytes alive at once of what runs after the blocks allocated (final norm, the
    head's chunked logits and their temporaries, the gradients the fused loss fills in
    forward for backward), on top of what the blocks hold then: the forward's peak."""

    def held(self, mode: str) -> int:
        """Bytes held at the start of backward under activation checkpointing ``mode``: with
        full, one block's recomputed activations join the kept inputs; with selective, the
        part of them it did not keep."""
        if not self.blocks:
            return self.outside
        if mode == "none":
            return self.outside + sum(b.saved for b in self.blocks)
        if mode == "full":
            return self.outside + sum(b.input for b in self.blocks) + self.recomputed(mode)
        return self.outside + sum(b.input + b.kept for b in self.blocks) + self.recomputed(mode)

    def recomputed(self, mode: str) -> int:
        """Of ``held``, the largest block's recomputation (selective recomputes only what it
        did not keep)."""
        if not self.blocks or mode == "none":
            return 0
        if mode == "full":
            return max(b.saved for b in self.blocks)
        return max(max(b.saved - b.kept, 0) for b in self.blocks)


class _Storages:
    """Storages counted once each while alive (several saved views of one tensor cost one
    storage; a later storage at a freed one's address counts again)."""

    def __init__(self, exclude: set[int]) -> None:
        self.seen = set(exclude)

    def bytes_of(self, t: object) -> int:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return 0
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.seen:
            return 0
        self.seen.add(key)
        weakref.finalize(storage, self.seen.discard, key)
        return storage.nbytes()


class LiveBytes:
    """The peak of the bytes alive of the storages it is shown, each counted once until it
    is freed (on meta too: a storage goes with its last tensor); storages in ``skip`` are
    never counted."""

    def __init__(self, skip: set[int] | None = None) -> None:
        self.live = self.peak = 0
        self._skip = skip or set()
        self._seen: set[int] = set()

    def track(self, t: object) -> None:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return
        storage = t.untyped_storage()
        key, size = storage._cdata, storage.nbytes()
        if key in self._seen or key in self._skip:
            return
        self._seen.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self._seen.discard(key)


class _KeptOutputs(TorchDispatchMode):
    """Adds the outputs of selective checkpointing's saved ops, and attention's q, k, v and
    output, to the block running; after the blocks, follows what the loss allocates."""

    def __init__(self, measure: _Measure) -> None:
        super().__init__()
        self.measure = measure

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        outputs = list(out) if isinstance(out, (tuple, list)) else [out]
        if func in SAVED_OPS and self.measure.current is not None:
            self.measure.add_kept(sum(self.measure.kept_storages.bytes_of(t) for t in outputs))
        live = self.measure.after_blocks or self.measure.block_live
        if live is not None:
            for t in outputs:
                live.track(t)
        if self.measure.current is not None and self.measure.block_live is not None:
            self.measure.current.forward_peak = self.measure.block_live.peak
        return out


class _FlashAttentionShapes(torch.autograd.Function):
    """What a flash-style kernel (CUDA flash/varlen, CPU's fused sdpa) saves: q, k, v, the
    output, the fp32 log-sum-exp per query and head, and an explicit mask as the additive
    bias in q's dtype that sdpa turns a boolean one into; never the [s, s] scores that sdpa's
    decomposition on meta would build."""

    @staticmethod
    def forward(  # noqa: ANN001
        ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        b, h, s, _ = q.shape  # the output in the kernels' [b, s, h, d] memory layout
        out = q.new_empty(b, s, h, v.shape[-1]).transpose(1, 2)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        bias = () if mask is None else (mask.to(q.dtype),)
        ctx.save_for_backward(q, k, v, out, lse, *bias)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
        q, k, v = ctx.saved_tensors[:3]
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


_SDPA = F.scaled_dot_product_attention


def fused_attention_runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, device: str) -> bool:
    """Whether sdpa on ``device`` takes a kernel that never writes the [s, s] scores out. CUDA
    always has one (flash, memory-efficient or cuDNN); CPU's flash kernel needs one head dim
    for q, k and v (torch's ``check_head_dim_size_cpp``), so MLA's shorter values send it to
    the math path, which saves the softmax."""
    return device != "cpu" or q.shape[-1] == k.shape[-1] == v.shape[-1]


class _Exchange(torch.autograd.Function):
    """An all-to-all's shapes: ``x`` in, a tensor of ``shape`` out (and back in backward);
    like ``all_to_all_single_autograd`` it saves nothing."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:  # noqa: ANN001
        ctx.shape = x.shape
        return x.new_empty(shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        return grad.new_empty(ctx.shape), None


def _heads_for_sequence(t: torch.Tensor, sp: int) -> tuple[int, ...]:
    """Ulysses' all-to-all: [b, h, s / sp, d] -> [b, h / sp, s, d] (at least one head:
    fewer key-value heads than ranks are repeated)."""
    b, h, s, d = t.shape
    return (b, max(h // sp, 1), s * sp, d)


class _Measure:
    def __init__(self, model: nn.Module, device: str, imbalance: float, sp: int) -> None:
        self.device = device
        self.imbalance = imbalance
        self.sp = sp
        params = {p.untyped_storage()._cdata for p in model.parameters()}
        params |= {b.untyped_storage()._cdata for b in model.buffers()}
        self.saved_storages = _Storages(params)
        self.kept_storages = _Storages(params)
        self.params = params
        self.activations = Activations()
        self.current: BlockActivations | None = None
        self.after_blocks: LiveBytes | None = None
        """Set when the last block's forward ends."""
        self.block_live: LiveBytes | None = None
        """What the running block's forward allocated."""

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object
    ) -> torch.Tensor:
        """Stands in for ``F.scaled_dot_product_attention`` ([b, h, s, d] operands): a fused
        kernel's shapes where the device has one, else sdpa's math decomposition; under
        sequence parallelism on Ulysses' shapes (a rank's heads over the whole sequence, so
        the math path's [s, s] scores are whole), the exchanges' outputs kept, and an
        explicit mask (sparse attention's selection, built here for a rank's slice) at the
        whole sequence's size. Counts k and v for ring attention here, where only attention
        runs (one call per layer under CP, which takes no row chunks)."""
        self.activations.attention_kv += k.nbytes + v.nbytes
        shape = (*q.shape[:-1], v.shape[-1])
        if self.sp > 1:
            q, k, v = (self.exchange(t, _heads_for_sequence(t, self.sp)) for t in (q, k, v))
            mask = kwargs.get("attn_mask")
            if isinstance(mask, torch.Tensor):
                kwargs["attn_mask"] = mask.new_empty(*mask.shape[:-2], q.shape[-2], k.shape[-2])
        if fused_attention_runs(q, k, v, self.device):
            out = _FlashAttentionShapes.apply(q, k, v, kwargs.get("attn_mask"))
        else:
            out = _SDPA(q, k, v, **kwargs)  # type: ignore[arg-type]
        self.add_kept(self.kept_storages.bytes_of(out))
        return self.exchange(out, shape) if self.sp > 1 else out

    def core(
        self,
        mixer: SequenceMixer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: ForwardContext,
        *heads: torch.Tensor,
    ) -> torch.Tensor:
        """Every token mixer's sequence core: ``local_core``, counting what Ulysses'
        all-to-alls would move (q, k, v, the per-head inputs and the output) once per layer,
        however many sdpa calls its attention makes."""
        out = local_core(mixer, q, k, v, ctx, *heads)
        self.activations.attention_io += sum(t.nbytes for t in (q, k, v, *heads, out))
        return out

    def dispatch(self, experts: Experts, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Stands in for EP's ``AllToAllDispatcher`` on a rank that receives ``imbalance``
        times the rows it sends: the received rows, their copy sorted by expert and the
        expert activations scale with it; the exchanges' outputs count as kept, as the real
        all-to-alls' are under selective checkpointing."""
        received = self.exchange(rows, (round(self.imbalance * rows.shape[0]), rows.shape[1]))
        order = torch.arange(received.shape[0], device=rows.device)
        out = experts(received[order], counts.cumsum(0, dtype=torch.int32))
        out = out.new_empty(out.shape).index_copy(0, order, out)
        return self.exchange(out, tuple(rows.shape))

    def exchange(self, x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        out = _Exchange.apply(x, shape)
        self.add_kept(self.kept_storages.bytes_of(out))
        return out

    def add_kept(self, n: int) -> None:
        if self.current is not None:
            self.current.kept += n

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        n = self.saved_storages.bytes_of(t)
        if self.current is None:
            self.activations.outside += n
        else:
            self.current.saved += n
            self.current.add(n)
        return t

    @contextmanager
    def blocks(self, blocks: list[nn.Module]) -> Iterator[None]:
        def enter(module: nn.Module, args: tuple) -> None:
            block = BlockActivations(input=sum(a.nbytes for a in args[:1]))
            self.activations.blocks.append(block)
            self.current = block
            self.block_live = LiveBytes(self.params)  # a weight's views are no allocation

        def leave(module: nn.Module, args: tuple, output: object) -> None:
            self.current = self.block_live = None
            if module is blocks[-1]:
                self.activations.leading = self.activations.outside
                self.after_blocks = LiveBytes(self.params)

        def start_part(module: nn.Module, args: tuple) -> None:
            if self.current is not None:
                self.current.start_part()

        handles = [b.register_forward_pre_hook(enter) for b in blocks]
        handles += [b.register_forward_hook(leave) for b in blocks]
        handles += [c.register_forward_pre_hook(start_part) for b in blocks for c in b.children()]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def planned_kernels(kernels: Kernels, device: str) -> Kernels:
    """``kernels`` with the fused loss's chunk of the planned ``device``, not that of meta,
    where the dry run measures: what the measured objective takes."""
    return replace(kernels, cross_entropy_chunk=kernels.chunk_tokens(torch.device(device)))


def _row_chunked(device: str, whole_sequences: bool) -> frozenset[str]:
    """The device types whose sdpa runs in row chunks while planning for ``device``: meta
    joins them when the planned device is one and the forward on meta sees whole sequences,
    as the run's attention does (under SP it sees a rank's slice, exchanged inside sdpa's
    stand-in; under CP the run's ring attention takes no chunks)."""
    chunked = attention_kernels.ROW_CHUNKED_DEVICES
    return chunked | {"meta"} if device in chunked and whole_sequences else chunked


def measure_activations(
    config: Config,
    model: nn.Module,
    objective: Objective,
    tokens: tuple[int, int],
    device: str = "cuda",
    ep_imbalance: float | None = None,
    sp: int = 1,
    cp: int = 1,
) -> Activations:
    """Run ``objective.loss`` once on ``model`` (on meta, unsharded, not checkpointed) over a
    micro-batch of ``tokens`` = (rows, sequence length) of one document each and count what
    it saves. Attention counts as a flash-style kernel's (``_FlashAttentionShapes``) where
    ``device`` runs one (``fused_attention_runs``), else as sdpa's math path, in the row
    chunks ``device``'s sdpa runs in (``ROW_CHUNKED_DEVICES``). With
    ``ep_imbalance`` the experts sit behind an expert-parallel dispatch whose rank receives
    that many times the rows it sends (``_Measure.dispatch``); with ``sp`` attention runs on
    Ulysses' shapes (``_Measure.attention``); ``cp``, the tokens being one CP rank's, only
    keeps sdpa's row chunks out."""
    model.use_kernels(resolve_kernels(config.kernels, torch.device("meta")))
    model.attn_backend = "sdpa"
    rows, length = tokens
    ids = torch.zeros(rows, length, dtype=torch.long, device="meta")
    batch = {"input_ids": ids, "labels": ids}
    measure = _Measure(model, device, ep_imbalance or 1.0, sp)
    if ep_imbalance is not None:
        for moe in moe_layers(model).values():
            moe.use_dispatcher(measure.dispatch)
    hooks = torch.autograd.graph.saved_tensors_hooks(measure.pack, lambda t: t)
    attention = mock.patch.object(F, "scaled_dot_product_attention", measure.attention)
    chunked = _row_chunked(device, whole_sequences=sp == cp == 1)
    chunks = mock.patch.object(attention_kernels, "ROW_CHUNKED_DEVICES", chunked)
    mixers = sequence_mixers(model)
    cores = [mixer.sequence_core for mixer in mixers]
    for mixer in mixers:
        mixer.sequence_core = measure.core
    model.train()
    try:
        with measure.blocks(list(model.layers)), hooks, attention, chunks, _KeptOutputs(measure):
            objective.loss(model, batch)
    finally:
        for mixer, core in zip(mixers, cores, strict=True):
            mixer.sequence_core = core
    if measure.after_blocks is not None:
        measure.activations.loss_peak = measure.after_blocks.peak
    return measure.activations
