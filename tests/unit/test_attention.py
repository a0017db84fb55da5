"""The attention dispatcher: document masks by hand, every fast path against the SDPA reference,
and clear errors for a backend the device lacks."""

from typing import get_args, get_type_hints

import pytest
import torch

from temper.config import Config, ConfigError
from temper.config.config import Model
from temper.kernels.attention import (
    BACKENDS,
    AttentionBackendError,
    DocumentMask,
    attention,
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
