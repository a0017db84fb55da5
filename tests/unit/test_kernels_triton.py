"""The Triton forms equal the references, forward and gradients: on CUDA in fp32 and bf16, and
on CPU through Triton's interpreter when ``TRITON_INTERPRET=1`` (a check of the kernels'
arithmetic, not of their speed). Skipped where Triton is not installed, unless
``TRITON_INTERPRET=1`` asks for the interpreter run (.ci/run's), which then fails without it."""

from __future__ import annotations

import os

import pytest
import torch
from test_kernels import CASES, Case, check_against_reference

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.importorskip("triton")

if torch.cuda.is_available():
    DEVICE = torch.device("cuda")
    DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 2e-2, 2e-2)]
elif os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = torch.device("cpu")
    DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 2e-2, 2e-2)]
else:
    pytest.skip("Triton kernels need CUDA (or TRITON_INTERPRET=1)", allow_module_level=True)


@pytest.mark.parametrize(("dtype", "rtol", "atol"), DTYPES, ids=lambda v: str(v))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_triton_form_equals_reference(
    case: Case, dtype: torch.dtype, rtol: float, atol: float
) -> None:
    check_against_reference(case, "triton", DEVICE, dtype, rtol=rtol, atol=atol)


def test_sparse_mla_on_the_triton_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek sparse attention's layer with its core on the Triton kernel (the dispatcher
    made to pick it) equals the masked reference: a row packed as documents of 9 and 7 tokens,
    top-k 4 (fewer keys than that at each document's start), output and every gradient in
    fp32 within 1e-5."""
    from temper.kernels import dispatch
    from temper.kernels.attention import DocumentMask
    from temper.models.layers.context import ForwardContext
    from temper.models.layers.rope import rope_cos_sin, rope_inv_freq
    from temper.models.layers.sparse_attention import SparseMLA

    torch.manual_seed(0)
    layer = SparseMLA(
        32, 2, 12, 8, 6, 4, 5, index_n_heads=2, index_head_dim=8, index_topk=4,
        index_rope_interleaved=False, softmax_scale=0.3,
    ).to(DEVICE)  # fmt: skip
    x = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    positions = torch.tensor([list(range(9)) + list(range(7))], device=DEVICE)
    cos, sin = rope_cos_sin(rope_inv_freq(4, 10000.0).to(DEVICE), positions)
    ctx = ForwardContext(cos, sin, DocumentMask.from_position_ids(positions))
    picked: dict[str, str] = {}
    monkeypatch.setattr(dispatch, "implementation", lambda op, *_: picked.get(op, "reference"))
    results = []
    for impl in ("reference", "triton"):
        picked["sparse_attention"] = impl
        layer.zero_grad()
        out = layer(x, ctx)
        out.square().sum().backward()
        results.append([out, *(p.grad.clone() for p in layer.parameters() if p.grad is not None)])
    for got, expected in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
