"""The attention dispatcher: document masks by hand, every fast path against the SDPA reference,
and clear errors for a backend the device lacks."""

from typing import get_args, get_type_hints

import pytest
import torch

from temper.config import Config, ConfigError
from temper.config.config import Model
from temper.kernels.attention import (
    BACKENDS,
    CPU_QUERY_ROWS,
    AttentionBackendError,
    DocumentMask,
    attention,
    causal_band,
    document_start,
    row_chunked,
)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Row 0: documents of 3, 2 and 3 tokens; row 1 starts mid-document (position 5), then a
# document of 3 tokens and 2 tokens of right padding whose positions continue it.
POSITIONS = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [5, 6, 7, 0, 1, 2, 3, 4]])


def _qkv(
    s: int = 8,
    d: int = 16,
    d_v: int = 8,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    requires_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q with 4 heads, k and v with 2 (GQA); v's head size ``d_v`` may differ (MLA)."""
    g = torch.Generator().manual_seed(0)
    return tuple(
        torch.randn(2, s, n, e, generator=g).to(device, dtype).requires_grad_(requires_grad)
        for n, e in ((4, d), (2, d), (2, d_v))
    )


def test_documents_from_position_ids_by_hand() -> None:
    docs = DocumentMask.from_position_ids(POSITIONS)
    assert docs.doc_ids.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 0, 1, 1, 1, 1, 1]]
    assert docs.cu_seqlens.tolist() == [0, 3, 5, 8, 11, 16]
    assert docs.cu_seqlens.dtype == torch.int32
    assert docs.max_seqlen == 5
    rows = DocumentMask.whole_rows(2, 8, torch.device("cpu"))
    assert rows.doc_ids.tolist() == [[0] * 8] * 2
    assert (rows.cu_seqlens.tolist(), rows.max_seqlen) == ([0, 8, 16], 8)


def test_block_causal_mask_by_hand() -> None:
    docs = DocumentMask.from_position_ids(torch.tensor([[0, 1, 2, 0, 1]]))
    x = 0
    expected = [
        [1, x, x, x, x],
        [1, 1, x, x, x],
        [1, 1, 1, x, x],
        [x, x, x, 1, x],
        [x, x, x, 1, 1],
    ]
    assert docs.dense().int().tolist() == [[expected]]


def test_sdpa_documents_equal_each_document_alone() -> None:
    """The reference itself: a packed row's output per document is that document run alone."""
    q, k, v = _qkv()
    docs = DocumentMask.from_position_ids(POSITIONS)
    packed = attention(q, k, v, docs, backend="sdpa")
    bounds = docs.cu_seqlens.tolist()
    flat = [t.flatten(0, 1) for t in (q, k, v, packed)]
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        alone = attention(*(t[None, start:end] for t in flat[:3]), backend="sdpa")
        torch.testing.assert_close(flat[3][start:end], alone[0], rtol=1e-6, atol=1e-6)


def test_sdpa_without_documents_is_causal() -> None:
    q, k, v = _qkv()
    whole = DocumentMask.whole_rows(2, 8, torch.device("cpu"))
    torch.testing.assert_close(attention(q, k, v), attention(q, k, v, whole, backend="sdpa"))


def _whole_matrix(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    docs: DocumentMask | None,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """The definition: softmax over every key at once, under the explicit mask (with a sink
    column when there are sinks), on the math path (one matrix of scores)."""
    s = q.shape[1]
    mask = causal_band(s, s, window, q.device) if docs is None else docs.dense(window)
    groups = q.shape[2] // k.shape[2]
    keys, values = (t.repeat_interleave(groups, dim=2).transpose(1, 2) for t in (k, v))
    scores = (q.transpose(1, 2) @ keys.transpose(2, 3)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, -torch.inf)
    if sinks is not None:
        sink = sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = scores.softmax(dim=-1)
    return (probs @ values).transpose(1, 2)


@pytest.mark.parametrize("rows", [3, 8])
@pytest.mark.parametrize(
    ("documents", "window", "sinks"),
    [(False, None, False), (True, None, False), (False, 3, False), (True, 4, True)],
)
def test_row_chunks_equal_the_whole_matrix(
    rows: int, documents: bool, window: int | None, sinks: bool
) -> None:
    """Queries a chunk of rows at a time, over the keys up to the chunk's last row (from the
    window's start): the same output and gradients as one softmax over every key. rows=8
    with a 10-token sequence leaves a short last chunk."""
    q, k, v = _qkv(s=10, requires_grad=True)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2], [4, 5, 6, 7, 8, 0, 1, 2, 3, 4]])
    docs = DocumentMask.from_position_ids(positions) if documents else None
    sink = torch.tensor([0.5, -1.0, 0.0, 2.0]) if sinks else None
    if documents:  # chunks start at the earliest document start of their first column
        assert [document_start(docs, row) for row in (3, 6, 8)] == [0, 4, 5]
    got = row_chunked(q, k, v, docs, None, window, sink, rows=rows)
    expected = _whole_matrix(q, k, v, docs, window, sink)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    upstream = torch.randn_like(got)
    grads = torch.autograd.grad(got, (q, k, v), upstream)
    for g, e in zip(grads, torch.autograd.grad(expected, (q, k, v), upstream), strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_compiled_row_chunks_equal_eager() -> None:
    """Under compile the chunks keep every key before them (no host sync for the documents'
    starts): the same output as eager, which skips the keys of earlier documents."""
    q, k, v = _qkv(s=10)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2], [4, 5, 6, 7, 8, 0, 1, 2, 3, 4]])
    docs = DocumentMask.from_position_ids(positions)
    compiled = torch.compile(row_chunked, fullgraph=True)
    torch.testing.assert_close(
        compiled(q, k, v, docs, None, None, None, rows=3),
        row_chunked(q, k, v, docs, None, None, None, rows=3),
    )


def test_cpu_sdpa_at_training_length_equals_the_whole_matrix() -> None:
    """The dispatcher's CPU path at a length it cuts into row chunks, causal and packed."""
    s = 2 * CPU_QUERY_ROWS + 7
    q, k, v = _qkv(s=s, d=8, d_v=8, requires_grad=True)
    positions = torch.cat([torch.arange(300), torch.arange(s - 300)])
    for docs in (None, DocumentMask.from_position_ids(torch.stack([positions] * 2))):
        got = attention(q, k, v, docs, backend="sdpa")
        torch.testing.assert_close(got, _whole_matrix(q, k, v, docs, None, None))


def test_flex_forward_equals_sdpa_on_cpu() -> None:
    q, k, v = _qkv()
    docs = DocumentMask.from_position_ids(POSITIONS)
    for mask in (docs, docs.with_block_mask(), None):
        expected = attention(q, k, v, mask, backend="sdpa", scale=0.3)
        with torch.no_grad():
            got = attention(q, k, v, mask, backend="flex", scale=0.3)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_auto_is_sdpa_on_cpu_even_when_training() -> None:
    q, k, v = _qkv(requires_grad=True)
    docs = DocumentMask.from_position_ids(POSITIONS)
    got = attention(q, k, v, docs)
    got.sum().backward()
    torch.testing.assert_close(got, attention(q, k, v, docs, backend="sdpa"))


def test_unavailable_backends_fail_clearly() -> None:
    q, k, v = _qkv(requires_grad=True)
    docs = DocumentMask.from_position_ids(POSITIONS)
    with pytest.raises(AttentionBackendError, match="no backward on CPU.*sdpa"):
        attention(q, k, v, docs, backend="flex")
    if not torch.cuda.is_available():
        with pytest.raises(AttentionBackendError, match="only on CUDA.*cpu.*sdpa.*flex"):
            attention(q, k, v, docs, backend="varlen")
    with pytest.raises(AttentionBackendError, match="unknown attention backend 'flash'"):
        attention(q, k, v, backend="flash")
    with pytest.raises(ValueError, match=r"\[2, 8\].*\[2, 4\]"):
        attention(q[:, :4], k[:, :4], v[:, :4], docs, backend="sdpa")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU-only machine")
@pytest.mark.parametrize(
    ("attn", "message"),
    [("flex", "no backward on CPU"), ("varlen", "only on CUDA GPUs and this run is on cpu")],
)
def test_config_rejects_a_backend_this_machine_cannot_train_with(attn: str, message: str) -> None:
    config = Config()
    config.model.attn = attn
    with pytest.raises(ConfigError, match=f"model.attn '{attn}': .*{message}"):
        config.validate(world_size=1)


def test_config_choices_are_the_dispatcher_backends() -> None:
    assert get_args(get_type_hints(Model)["attn"]) == BACKENDS


@cuda
@pytest.mark.parametrize(("backend", "d_v"), [("flex", 64), ("varlen", 64), ("varlen", 32)])
def test_cuda_backends_equal_sdpa_forward_and_backward(backend: str, d_v: int) -> None:
    """bf16 kernels against the bf16 reference; grads too, since CUDA trains with them.
    varlen pads a smaller v head (MLA) for flash."""
    q, k, v = _qkv(s=256, d=64, d_v=d_v, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    positions = torch.cat([torch.arange(100), torch.arange(60), torch.arange(96)])
    docs = DocumentMask.from_position_ids(torch.stack([positions, positions.roll(30)]).cuda())
    for mask in (docs, None):
        expected = attention(q, k, v, mask, backend="sdpa")
        expected_grads = torch.autograd.grad(expected.float().square().sum(), (q, k, v))
        got = attention(q, k, v, mask, backend=backend)
        grads = torch.autograd.grad(got.float().square().sum(), (q, k, v))
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
        for g, e in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(g, e, rtol=5e-2, atol=5e-2)
