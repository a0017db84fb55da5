"""DeepSeek sparse attention's core: the gather of the selected keys (the Triton kernel's oracle,
test_kernels_triton.py) equals the masked dense reference the layer runs on CPU; the selection
becomes the key lists the kernel reads; ``SparseMLA`` reaches the core through the dispatcher."""

from __future__ import annotations

import pytest
import torch
from test_kernels import _sparse_inputs

from temper.kernels import dispatch
from temper.kernels.sparse_attention import (
    gather_attention,
    selected_indices,
    sparse_attention_reference,
)
from temper.models.layers.context import ForwardContext
from temper.models.layers.rope import rope_cos_sin, rope_inv_freq
from temper.models.layers.sparse_attention import SparseMLA


def test_gather_equals_the_masked_reference() -> None:
    """Packed documents and rows with fewer visible keys than top-k (empty slots): outputs and
    the gradients of q, k and v within 1e-5 (fp32)."""
    q, k, v, selected = _sparse_inputs(torch.device("cpu"), torch.float32)
    cotangent = torch.randn(2, 11, 3, 8, generator=torch.Generator().manual_seed(4))
    results = []
    for run in (
        lambda: sparse_attention_reference(q, k, v, selected, 0.3),
        lambda: gather_attention(q, k, v, selected_indices(selected), 0.3),
    ):
        out = run()
        results.append([out, *torch.autograd.grad(out, (q, k, v), cotangent)])
    for got, expected in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_selection_becomes_key_lists() -> None:
    """Each query's marked positions, as many slots as the fullest row, -1 in the rest."""
    selected = torch.tensor(
        [[[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 0, 1], [1, 0, 1, 1]]], dtype=torch.bool
    )
    indices = selected_indices(selected)
    assert indices.dtype == torch.int32
    rows = [sorted(int(i) for i in row if i >= 0) for row in indices[0]]
    assert rows == [[0], [0, 1], [1, 3], [0, 2, 3]]
    assert indices.shape == (1, 4, 3) and (indices[0, 0] == -1).sum() == 2


def test_sparse_mla_runs_the_dispatched_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer's attention is ``kernels.sparse_attention``'s choice: a form pinned by the
    dispatcher gets the layer's q, k, v, selection and softmax scale."""
    seen: list[float] = []

    def spy(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selected: torch.Tensor, scale: float
    ) -> torch.Tensor:
        seen.append(scale)
        return sparse_attention_reference(q, k, v, selected, scale)

    torch.manual_seed(0)
    layer = SparseMLA(
        32, 2, 16, 8, 8, 4, 8, index_n_heads=2, index_head_dim=8, index_topk=3,
        index_rope_interleaved=False, softmax_scale=0.25,
    )  # fmt: skip
    x = torch.randn(1, 6, 32)
    cos, sin = rope_cos_sin(rope_inv_freq(4, 10000.0), torch.arange(6)[None])
    ctx = ForwardContext(cos=cos, sin=sin)
    plain = layer(x, ctx)
    pinned = {"sparse_attention": "compile"}
    monkeypatch.setattr(dispatch, "implementation", lambda op, *_: pinned.get(op, "reference"))
    monkeypatch.setattr(dispatch, "compiled", lambda fn: spy)
    torch.testing.assert_close(layer(x, ctx), plain, rtol=0, atol=0)
    assert seen == [0.25]
