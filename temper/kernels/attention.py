"""Causal attention over packed documents, behind one dispatcher with an SDPA reference.

A packed row holds several documents; each token attends only to earlier tokens of its own
document (block-causal). ``DocumentMask`` describes the documents once per batch, from
``position_ids`` that restart at every document, and every backend reads what it needs from
it: ``sdpa`` a dense boolean mask (the reference, and the CPU training path, which runs it in
chunks of query rows: ``row_chunked``), ``flex`` a FlexAttention ``BlockMask``, ``varlen``
the ``cu_seqlens`` of torch's flash varlen kernel.
The mask is built on the full (global) sequence, so sequence-parallel code can slice the
batch and still hand attention, which sees whole sequences, the same object.

Two gpt-oss features ride on every backend: a sliding ``window`` (a query sees its own and the
``window - 1`` keys before it) and attention ``sinks`` (a learned logit per head that joins each
softmax row and takes its share of the mass, then is dropped). The sdpa reference builds the
window into its explicit mask and appends the sink column to the scores; flex applies the
window as a mask and the sinks from its log-sum-exp, ``out * sigmoid(lse - sink)``; varlen
takes windows but not sinks.

Device facts: FlexAttention runs forward on CPU and CUDA but has no backward on CPU;
varlen is CUDA-only (flash attention: sm80+, bf16/fp16). ``auto`` is sdpa, except on CUDA for
packed documents (varlen where it can run, else flex) and for sinks or windows (flex).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import (
    AuxRequest,
    BlockMask,
    create_block_mask,
    flex_attention,
)

from temper.config import Config, ConfigError, register_rule
from temper.utils.compat import flex_attention_op, varlen_attention_op
from temper.utils.device import resolve_dtype
from temper.utils.recompute import recomputed_whole

Backend = Literal["auto", "sdpa", "flex", "varlen"]
BACKENDS: tuple[Backend, ...] = ("auto", "sdpa", "flex", "varlen")


@functools.cache
def _varlen_kernel() -> tuple[Callable[..., torch.Tensor], bool]:
    """torch's varlen_attn and whether it takes enable_gqa (2.12+; torch 2.11's does not,
    and there k/v heads are copied). Imported when varlen first runs: its module imports
    dynamo, about a second that the CLI's ``--help`` and config errors do without."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


class AttentionBackendError(RuntimeError):
    """The chosen attention backend cannot run here; the message names the alternatives."""


@dataclass(frozen=True)
class DocumentMask:
    """Where the documents of a packed batch [b, s] lie: the input of block-causal attention.

    ``doc_ids`` [b, s] numbers the documents of each row from 0; ``cu_seqlens`` [n + 1]
    (int32) are the document starts in the flattened ``b * s`` tokens plus the total, and
    ``max_seqlen`` the longest document, as varlen kernels take them. ``block_mask`` is
    FlexAttention's form, built once per forward (``with_block_mask``) and shared by layers;
    ``window_block_mask`` the same with the sliding ``window`` of the model's windowed layers.
    """

    doc_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    block_mask: BlockMask | None = None
    window: int | None = None
    window_block_mask: BlockMask | None = None

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor) -> DocumentMask:
        """A document starts at each row start and wherever a position is not its
        predecessor's + 1 (a restart at 0, or any jump). Right padding forms or joins the last
        document, and causal order keeps real tokens from seeing it. Syncs once with the
        device (for ``max_seqlen``): call it once per batch, before sequence-parallel slicing."""
        if position_ids.dim() != 2:
            raise ValueError(f"position_ids must be [batch, seq], got {list(position_ids.shape)}")
        starts = torch.ones_like(position_ids, dtype=torch.bool)
        starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
        return cls.from_starts(starts)

    @classmethod
    def from_starts(cls, starts: torch.Tensor) -> DocumentMask:
        """The mask whose documents begin where ``starts`` [b, s] (bool; True at every row's
        first column) is True."""
        doc_ids = starts.cumsum(dim=1, dtype=torch.int32) - 1
        first = starts.flatten().nonzero().flatten()
        total = first.new_tensor([starts.numel()])
        cu_seqlens = torch.cat([first, total]).to(torch.int32)
        return cls(doc_ids, cu_seqlens, int(cu_seqlens.diff().max()))

    @classmethod
    def whole_rows(cls, batch: int, seq_len: int, device: torch.device) -> DocumentMask:
        """One document per row (plain causal attention), for backends that need a mask."""
        doc_ids = torch.zeros(batch, seq_len, dtype=torch.int32, device=device)
        ends = torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32, device=device)
        return cls(doc_ids, ends, seq_len)

    def with_block_mask(self, window: int | None = None) -> DocumentMask:
        """This mask plus its FlexAttention ``BlockMask`` (built on the ids' device), and with
        ``window`` also the sliding-window one."""
        block_mask = self._block_mask(None)
        if window is None:
            return dataclasses.replace(self, block_mask=block_mask)
        return dataclasses.replace(
            self, block_mask=block_mask, window=window, window_block_mask=self._block_mask(window)
        )

    def block_mask_for(self, window: int | None) -> BlockMask:
        """The ``BlockMask`` for ``window`` (None: no window): the prebuilt one, else built."""
        prebuilt = self.block_mask if window is None else self.window_block_mask
        if prebuilt is not None and (window is None or window == self.window):
            return prebuilt
        return self._block_mask(window)

    def _block_mask(self, window: int | None) -> BlockMask:
        doc_ids = self.doc_ids
        batch, seq_len = doc_ids.shape

        def same_document_causal(
            b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
        ) -> torch.Tensor:
            visible = (doc_ids[b, q] == doc_ids[b, kv]) & (kv <= q)
            return visible if window is None else visible & (q - kv < window)

        return create_block_mask(
            same_document_causal, batch, None, seq_len, seq_len, device=doc_ids.device
        )

    def dense(self, window: int | None = None) -> torch.Tensor:
        """The boolean mask [b, 1, s, s]: True where query i may attend key j (with ``window``:
        also ``i - j < window``)."""
        ids = self.doc_ids
        seq_len = ids.shape[1]
        band = causal_band(seq_len, seq_len, window, ids.device)
        return ((ids[:, :, None] == ids[:, None, :]) & band)[:, None]


def causal_band(s_q: int, s_k: int, window: int | None, device: torch.device | str) -> torch.Tensor:
    """[s_q, s_k] bool: the queries are the last ``s_q`` of ``s_k`` positions (a KV cache's new
    tokens, or all of them) and see the keys at or before them, within ``window`` if set."""
    queries = torch.arange(s_k - s_q, s_k, device=device)[:, None]
    keys = torch.arange(s_k, device=device)
    band = keys <= queries
    return band if window is None else band & (queries - keys < window)


def backend_unavailable(
    backend: Backend, device: torch.device, dtype: torch.dtype, *, backward: bool
) -> str | None:
    """Why ``backend`` cannot run on ``device`` in ``dtype`` (with a backward pass if asked),
    or None when it can. Shared by the dispatcher and the config's early check."""
    if backend == "flex":
        if device.type not in ("cpu", "cuda"):
            return f"FlexAttention runs on CPU and CUDA, not {device.type}; use sdpa"
        if device.type == "cpu" and backward:
            return (
                "FlexAttention has no backward on CPU (forward only); train on CPU with "
                "sdpa (or auto), which applies the same document mask"
            )
    if backend == "varlen":
        if device.type != "cuda":
            return (
                f"varlen attention (flash) runs only on CUDA GPUs and this run is on "
                f"{device.type}; use sdpa (CPU training) or flex"
            )
        gpu = torch.cuda.get_device_properties(device)
        if gpu.major < 8:
            return (
                f"varlen attention needs flash attention (compute capability 8.0+), this "
                f"GPU has {gpu.major}.{gpu.minor}; use flex or sdpa"
            )
        if dtype not in (torch.bfloat16, torch.float16):
            return (
                f"varlen attention needs bfloat16 or float16 inputs, got {dtype}; train "
                f"in bfloat16 or use flex or sdpa"
            )
    return None


def resolve_backend(
    backend: Backend, x: torch.Tensor, *, packed: bool, sinks: bool = False, window: bool = False
) -> Backend:
    """The concrete backend for inputs like ``x`` (its device, autocast-aware dtype and
    whether autograd records it), packed documents, attention sinks and sliding windows;
    raises AttentionBackendError when it cannot run."""
    if backend not in BACKENDS:
        raise AttentionBackendError(f"unknown attention backend {backend!r}; choose {BACKENDS}")
    device = x.device
    # Meta (the planner's shape-only forward) has no autocast.
    autocast = device.type != "meta" and torch.is_autocast_enabled(device.type)
    dtype = torch.get_autocast_dtype(device.type) if autocast else x.dtype
    backward = torch.is_grad_enabled() and x.requires_grad
    if backend == "auto":
        if device.type != "cuda" or not (packed or sinks or window):
            return "sdpa"
        can_varlen = backend_unavailable("varlen", device, dtype, backward=backward) is None
        return "varlen" if can_varlen and not sinks else "flex"
    if backend == "varlen" and sinks:
        raise AttentionBackendError(
            "attention backend 'varlen': flash varlen has no attention sinks; use flex (GPU) "
            "or sdpa"
        )
    reason = backend_unavailable(backend, device, dtype, backward=backward)
    if reason is not None:
        raise AttentionBackendError(f"attention backend {backend!r}: {reason}")
    return backend


def prepare_documents(
    backend: Backend,
    docs: DocumentMask | None,
    x: torch.Tensor,
    seq_len: int,
    *,
    window: int | None = None,
    sinks: bool = False,
) -> tuple[Backend, DocumentMask | None]:
    """Resolve the backend once per forward for hidden states ``x`` [b, ...] and build what
    all layers share: flex's BlockMasks (whole rows when there are no documents; also the
    sliding one when some layers attend within ``window``) at ``seq_len``, the length
    attention sees: the whole sequence under sequence parallelism, where ``x`` holds a
    slice."""
    packed = docs is not None
    backend = resolve_backend(backend, x, packed=packed, sinks=sinks, window=window is not None)
    if backend != "flex":
        return backend, docs
    if docs is None:
        docs = DocumentMask.whole_rows(x.shape[0], seq_len, x.device)
    return backend, docs.with_block_mask(window)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    docs: DocumentMask | None = None,
    *,
    backend: Backend = "auto",
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal (block-causal with ``docs``) attention: q, k [b, s, h(_kv), d] and
    v [b, s, h_kv, d_v] with h a multiple of h_kv (GQA) -> [b, s, h, d_v]. ``scale`` replaces
    the softmax scale ``d ** -0.5`` (MLA's YaRN correction); ``d_v`` may differ from ``d`` (MLA).

    ``mask`` [b, 1, s_q, s_k] (True: attend) replaces causal order where queries do not line
    up with keys: new tokens against a KV cache (``temper.models.layers.kv_cache``), the
    queries being the last s_q columns. It runs on sdpa, the one backend that takes an
    arbitrary mask.

    ``window``: each query sees only keys fewer than ``window`` positions (columns) back.
    ``sinks`` [h]: one extra logit per head in every softmax row, whose probability is dropped.

    Heads stay on dim 2 so sequence-parallel all-to-alls can wrap this function unchanged.
    """
    if mask is not None:
        if docs is not None or backend not in ("auto", "sdpa"):
            raise AttentionBackendError(
                f"an explicit attention mask runs on sdpa without documents, got backend "
                f"{backend!r} and docs={docs is not None}"
            )
        if window is not None:
            mask = mask & causal_band(q.shape[1], k.shape[1], window, q.device)
        return _reference(q, k, v, mask, scale, sinks)
    if docs is not None and tuple(docs.doc_ids.shape) != tuple(q.shape[:2]):
        raise ValueError(
            f"document mask is for [batch, seq] = {list(docs.doc_ids.shape)}, attention got "
            f"{list(q.shape[:2])}; build it on the full sequence the attention sees"
        )
    backend = resolve_backend(
        backend, q, packed=docs is not None, sinks=sinks is not None, window=window is not None
    )
    return _BACKENDS[backend](q, k, v, docs, scale, window, sinks)


# ATen's CPU flash kernel skips masked-out work only in whole blocks of 512 keys, and none
# under an explicit mask: for 1024 causal tokens it computes 78% of the score matrix, for
# packed documents all of it. Rows of queries cut into chunks of this many, each over the keys
# up to its last row, compute 62.5% (measured: docs/benchmarks.md, "causal work skipped").
CPU_QUERY_ROWS = 256
# Beyond this many tokens the kernel's own causal skipping does as well as the chunks.
CPU_CAUSAL_CHUNKED_UP_TO = 1024
# The device types whose sdpa runs in row chunks; the memory planner adds "meta" when it plans
# a CPU run, so its forward on meta saves what the CPU run's chunks save.
ROW_CHUNKED_DEVICES = frozenset({"cpu"})


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    docs: DocumentMask | None,
    scale: float | None,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """The reference: is_causal without documents, windows or sinks, else an explicit mask;
    on CPU in row chunks where that computes less (``row_chunked``)."""
    seq_len = q.shape[1]
    masked = docs is not None or window is not None or sinks is not None
    if (
        q.device.type in ROW_CHUNKED_DEVICES
        and seq_len > CPU_QUERY_ROWS
        and (masked or seq_len <= CPU_CAUSAL_CHUNKED_UP_TO)
    ):
        return row_chunked(q, k, v, docs, scale, window, sinks, rows=CPU_QUERY_ROWS)
    if docs is not None:
        mask = docs.dense(window)
    elif window is not None or sinks is not None:
        mask = causal_band(q.shape[1], k.shape[1], window, q.device)[None, None]
    else:
        mask = None
    return _reference(q, k, v, mask, scale, sinks)


def row_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    docs: DocumentMask | None,
    scale: float | None,
    window: int | None,
    sinks: torch.Tensor | None,
    *,
    rows: int,
) -> torch.Tensor:
    """``_sdpa``'s result, computed ``rows`` queries at a time over only the keys they can
    see: those up to the chunk's last row, from the first that the window (if any) and the
    documents leave to its first row. Each chunk is the reference on its explicit mask."""
    seq_len = q.shape[1]
    chunks = []
    for start in range(0, seq_len, rows):
        end = min(start + rows, seq_len)
        first = 0 if window is None else max(0, start - window + 1)
        if docs is not None and not torch.compiler.is_compiling():  # a host sync: eager only
            first = max(first, document_start(docs, start))
        mask = causal_band(end - start, end - first, window, q.device)
        if docs is not None:
            ids = docs.doc_ids
            mask = ((ids[:, start:end, None] == ids[:, None, first:end]) & mask)[:, None]
        keys = slice(first, end)
        chunks.append(_reference(q[:, start:end], k[:, keys], v[:, keys], mask, scale, sinks))
    return torch.cat(chunks, dim=1)


def document_start(docs: DocumentMask, row: int) -> int:
    """The earliest column, over the batch, of the document that holds column ``row``: no
    later query sees a key before it, since documents are contiguous."""
    ids = docs.doc_ids
    return int((ids[:, :row] < ids[:, row, None]).sum(dim=1).min())


def _reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """sdpa on [b, s, h, d] tensors, a boolean ``mask`` [b, 1, s_q, s_k] (or one that
    broadcasts to it) or causal if None; with ``sinks``, the softmax written out so the sink
    column can join each row."""
    if sinks is not None:
        return _with_sink_column(q, k, v, mask, scale, sinks)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def _with_sink_column(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """softmax([q k^T * scale, sink]) without the sink's column, times v: the definition."""
    b, s_q, h, d = q.shape
    groups = h // k.shape[2]
    keys, values = (t.transpose(1, 2).repeat_interleave(groups, dim=1) for t in (k, v))
    scores = q.transpose(1, 2) @ keys.transpose(2, 3) * (d**-0.5 if scale is None else scale)
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, h, 1, 1).expand(b, h, s_q, 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return (probs.to(values.dtype) @ values).transpose(1, 2)


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    """FlexAttention is only fused when compiled; eager flex materializes all scores."""
    return torch.compile(flex_attention)


def _flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    docs: DocumentMask | None,
    scale: float | None,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Flex with the (windowed) block mask; sinks rescale each row by the share of the mass
    the scores keep: ``sigmoid(lse - sink)``, from flex's log-sum-exp."""
    if docs is None:
        docs = DocumentMask.whole_rows(q.shape[0], q.shape[1], q.device)
    # Inside a compiled block the block's compile fuses flex. Compiled flex on CPU (torch
    # 2.13) returns wrong values for some small shapes (seq 8, head_dim 8), so CPU, where
    # flex is a forward-only check, runs the exact eager version; on CUDA, inductor's flex
    # needs heads of 16 or more (torch 2.11), so smaller (test-sized) heads run eager too.
    # The compiled kernel is opaque to selective checkpointing: it is recomputed whole.
    eager = q.device.type != "cuda" or torch.compiler.is_compiling() or q.shape[-1] < 16
    flex, context = (
        (flex_attention, contextlib.nullcontext())
        if eager
        else (_compiled_flex(), recomputed_whole())
    )
    with context:
        out = flex(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            block_mask=docs.block_mask_for(window),
            scale=scale,
            enable_gqa=q.shape[2] != k.shape[2],
            return_aux=None if sinks is None else AuxRequest(lse=True),
        )
    if sinks is not None:
        out, aux = out
        kept = torch.sigmoid(aux.lse - sinks.float().view(1, -1, 1)).unsqueeze(-1)
        out = (out * kept).to(q.dtype)
    return out.transpose(1, 2)


def _varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    docs: DocumentMask | None,
    scale: float | None,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Flash varlen over the flattened batch: every document is its own causal sequence
    (``resolve_backend`` refuses sinks here)."""
    b, s, h, d = q.shape
    d_v = v.shape[3]
    if docs is None:
        docs = DocumentMask.whole_rows(b, s, q.device)
    varlen_attn, takes_gqa = _varlen_kernel()
    gqa = {}
    if k.shape[2] != h:
        if takes_gqa:
            gqa = {"enable_gqa": True}
        else:
            k, v = (t.repeat_interleave(h // k.shape[2], dim=2) for t in (k, v))
    # Flash wants one head size for q, k and v: zero columns of v add zero output columns.
    v = F.pad(v, (0, d - d_v)) if d_v < d else v
    out = varlen_attn(
        q.reshape(b * s, h, d),
        k.reshape(b * s, k.shape[2], d),
        v.reshape(b * s, v.shape[2], v.shape[3]),
        docs.cu_seqlens,
        docs.cu_seqlens,
        docs.max_seqlen,
        docs.max_seqlen,
        scale=scale,
        window_size=(-1 if window is None else window - 1, 0),
        **gqa,
    )
    return out.view(b, s, h, -1)[..., :d_v]


_BACKENDS = {"sdpa": _sdpa, "flex": _flex, "varlen": _varlen}


@functools.cache
def _attention_ops() -> tuple[object, ...]:
    return tuple(
        op
        for op in (
            torch.ops.aten._scaled_dot_product_flash_attention.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops.aten._scaled_dot_product_efficient_attention.default,
            torch.ops.aten._scaled_dot_product_cudnn_attention.default,
            flex_attention_op,
            varlen_attention_op(),
        )
        if op is not None
    )


def __getattr__(name: str) -> object:
    """``ATTENTION_OPS``: the ops in which the backends compute attention (sdpa's fused
    kernels; its math fallback is matmuls), for selective activation checkpointing to keep
    their outputs. Made on first use, since looking up varlen's op imports dynamo."""
    if name == "ATTENTION_OPS":
        return _attention_ops()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@register_rule
def check_attention_backend(config: Config, world_size: int) -> None:
    """A backend that this machine's training device lacks fails at config time, before any
    work."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype(config.training.dtype, device)
    reason = backend_unavailable(config.model.attn, device, dtype, backward=True)
    if reason is not None:
        raise ConfigError(f"model.attn {config.model.attn!r}: {reason}")
