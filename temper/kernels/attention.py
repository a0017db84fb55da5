"""Causal attention over packed documents, behind one dispatcher with an SDPA reference.

A packed row holds several documents; each token attends only to earlier tokens of its own
document (block-causal). ``DocumentMask`` describes the documents once per batch, from
``position_ids`` that restart at every document, and every backend reads what it needs from
it: ``sdpa`` a dense boolean mask (the reference, and the CPU training path), ``flex`` a
FlexAttention ``BlockMask``, ``varlen`` the ``cu_seqlens`` of torch's flash varlen kernel.
The mask is built on the full (global) sequence, so sequence-parallel code can slice the
batch and still hand attention, which sees whole sequences, the same object.

Device facts: FlexAttention runs forward on CPU and CUDA but has no backward on CPU;
varlen is CUDA-only (flash attention: sm80+, bf16/fp16). ``auto`` is sdpa, except for
packed documents on CUDA: varlen where it can run, else flex.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.nn.attention.varlen import varlen_attn

from temper.config import Config, ConfigError, register_rule
from temper.utils.compat import flex_attention_op, varlen_attention_op
from temper.utils.device import resolve_dtype

Backend = Literal["auto", "sdpa", "flex", "varlen"]
BACKENDS: tuple[Backend, ...] = ("auto", "sdpa", "flex", "varlen")

# torch 2.11's varlen_attn has no enable_gqa (2.12+ has): there k/v heads are copied.
_VARLEN_TAKES_GQA = "enable_gqa" in inspect.signature(varlen_attn).parameters


class AttentionBackendError(RuntimeError):
    """The chosen attention backend cannot run here; the message names the alternatives."""


@dataclass(frozen=True)
class DocumentMask:
    """Where the documents of a packed batch [b, s] lie: the input of block-causal attention.

    ``doc_ids`` [b, s] numbers the documents of each row from 0; ``cu_seqlens`` [n + 1]
    (int32) are the document starts in the flattened ``b * s`` tokens plus the total, and
    ``max_seqlen`` the longest document, as varlen kernels take them. ``block_mask`` is
    FlexAttention's form, built once per forward (``with_block_mask``) and shared by layers.
    """

    doc_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    block_mask: BlockMask | None = None

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

    def with_block_mask(self) -> DocumentMask:
        """This mask plus its FlexAttention ``BlockMask`` (built on the ids' device)."""
        doc_ids = self.doc_ids
        batch, seq_len = doc_ids.shape

        def same_document_causal(
            b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
        ) -> torch.Tensor:
            return (doc_ids[b, q] == doc_ids[b, kv]) & (kv <= q)

        block_mask = create_block_mask(
            same_document_causal, batch, None, seq_len, seq_len, device=doc_ids.device
        )
        return dataclasses.replace(self, block_mask=block_mask)

    def dense(self) -> torch.Tensor:
        """The boolean mask [b, 1, s, s]: True where query i may attend key j."""
        ids = self.doc_ids
        seq_len = ids.shape[1]
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=ids.device).tril()
        return ((ids[:, :, None] == ids[:, None, :]) & causal)[:, None]


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


def resolve_backend(backend: Backend, x: torch.Tensor, *, packed: bool) -> Backend:
    """The concrete backend for inputs like ``x`` (its device, autocast-aware dtype and
    whether autograd records it); raises AttentionBackendError when it cannot run."""
    if backend not in BACKENDS:
        raise AttentionBackendError(f"unknown attention backend {backend!r}; choose {BACKENDS}")
    device = x.device
    autocast = torch.is_autocast_enabled(device.type)
    dtype = torch.get_autocast_dtype(device.type) if autocast else x.dtype
    backward = torch.is_grad_enabled() and x.requires_grad
    if backend == "auto":
        if not packed or device.type != "cuda":
            return "sdpa"
        can_varlen = backend_unavailable("varlen", device, dtype, backward=backward) is None
        return "varlen" if can_varlen else "flex"
    reason = backend_unavailable(backend, device, dtype, backward=backward)
    if reason is not None:
        raise AttentionBackendError(f"attention backend {backend!r}: {reason}")
    return backend


def prepare_documents(
    backend: Backend, docs: DocumentMask | None, x: torch.Tensor, seq_len: int
) -> tuple[Backend, DocumentMask | None]:
    """Resolve the backend once per forward for hidden states ``x`` [b, ...] and build what
    all layers share: flex's BlockMask (whole rows when there are no documents) at
    ``seq_len``, the length attention sees: the whole sequence under sequence parallelism,
    where ``x`` holds a slice."""
    backend = resolve_backend(backend, x, packed=docs is not None)
    if backend != "flex":
        return backend, docs
    if docs is None:
        docs = DocumentMask.whole_rows(x.shape[0], seq_len, x.device)
    return backend, docs.with_block_mask()


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    docs: DocumentMask | None = None,
    *,
    backend: Backend = "auto",
    scale: float | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal (block-causal with ``docs``) attention: q, k [b, s, h(_kv), d] and
    v [b, s, h_kv, d_v] with h a multiple of h_kv (GQA) -> [b, s, h, d_v]. ``scale`` replaces
    the softmax scale ``d ** -0.5`` (MLA's YaRN correction); ``d_v`` may differ from ``d`` (MLA).

    ``mask`` [b, 1, s_q, s_k] (True: attend) replaces causal order where queries do not line
    up with keys: new tokens against a KV cache (``temper.models.layers.kv_cache``). It runs
    on sdpa, the one backend that takes an arbitrary mask.

    Heads stay on dim 2 so sequence-parallel all-to-alls can wrap this function unchanged.
    """
    if mask is not None:
        if docs is not None or backend not in ("auto", "sdpa"):
            raise AttentionBackendError(
                f"an explicit attention mask runs on sdpa without documents, got backend "
                f"{backend!r} and docs={docs is not None}"
            )
        return _sdpa_with_mask(q, k, v, mask, scale)
    if docs is not None and tuple(docs.doc_ids.shape) != tuple(q.shape[:2]):
        raise ValueError(
            f"document mask is for [batch, seq] = {list(docs.doc_ids.shape)}, attention got "
            f"{list(q.shape[:2])}; build it on the full sequence the attention sees"
        )
    backend = resolve_backend(backend, q, packed=docs is not None)
    return _BACKENDS[backend](q, k, v, docs, scale)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    docs: DocumentMask | None,
    scale: float | None,
) -> torch.Tensor:
    """The reference: is_causal without documents, else the explicit block-causal mask."""
    return _sdpa_with_mask(q, k, v, None if docs is None else docs.dense(), scale)


def _sdpa_with_mask(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    """sdpa on [b, s, h, d] tensors; a boolean ``mask`` [b, 1, s_q, s_k], or causal if None."""
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
) -> torch.Tensor:
    if docs is None:
        docs = DocumentMask.whole_rows(q.shape[0], q.shape[1], q.device)
    if docs.block_mask is None:
        docs = docs.with_block_mask()
    # Inside a compiled block the block's compile fuses flex. Compiled flex on CPU (torch
    # 2.13) returns wrong values for some small shapes (seq 8, head_dim 8), so CPU, where
    # flex is a forward-only check, runs the exact eager version.
    eager = q.device.type != "cuda" or torch.compiler.is_compiling()
    flex = flex_attention if eager else _compiled_flex()
    out = flex(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        block_mask=docs.block_mask,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def _varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    docs: DocumentMask | None,
    scale: float | None,
) -> torch.Tensor:
    """Flash varlen over the flattened batch: every document is its own causal sequence."""
    b, s, h, d = q.shape
    d_v = v.shape[3]
    if docs is None:
        docs = DocumentMask.whole_rows(b, s, q.device)
    gqa = {}
    if k.shape[2] != h:
        if _VARLEN_TAKES_GQA:
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
        window_size=(-1, 0),
        **gqa,
    )
    return out.view(b, s, h, -1)[..., :d_v]


_BACKENDS = {"sdpa": _sdpa, "flex": _flex, "varlen": _varlen}

ATTENTION_OPS = tuple(
    op
    for op in (
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_cudnn_attention.default,
        flex_attention_op,
        varlen_attention_op,
    )
    if op is not None
)
"""The ops in which the backends compute attention (sdpa's fused kernels; its math fallback
is matmuls), for selective activation checkpointing to keep their outputs."""


@register_rule
def check_attention_backend(config: Config, world_size: int) -> None:
    """A backend that this machine's training device lacks fails at config time, before any
    work."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype(config.training.dtype, device)
    reason = backend_unavailable(config.model.attn, device, dtype, backward=True)
    if reason is not None:
        raise ConfigError(f"model.attn {config.model.attn!r}: {reason}")
