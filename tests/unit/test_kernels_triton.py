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


@pytest.fixture(autouse=True)
def _triton_runs_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dispatcher falls back from triton on CPU; under the interpreter it must not, or
    these tests would compare the reference with itself."""
    from temper.kernels import dispatch

    monkeypatch.setattr(dispatch, "unavailable", lambda impl, device: None)
    dispatch._resolve_once.cache_clear()


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
        out, _ = layer(x, ctx)  # (output, IndexerOutputs)
        out.square().sum().backward()
        results.append([out, *(p.grad.clone() for p in layer.parameters() if p.grad is not None)])
    for got, expected in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _sink_inputs(kv_heads: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q of 4 heads over keys and values of ``kv_heads`` heads (1: V4's shared head), the
    selection of test_kernels' sparse case (packed documents, empty slots) and one sink logit
    per head."""
    from test_kernels import _randn, _sparse_inputs

    *_, selected = _sparse_inputs(DEVICE, dtype)
    q = _randn(2, 11, 4, 12, device=DEVICE, dtype=dtype, seed=5)
    k = _randn(2, 11, kv_heads, 12, device=DEVICE, dtype=dtype, seed=6)
    v = _randn(2, 11, kv_heads, 8, device=DEVICE, dtype=dtype, seed=7)
    sinks = _randn(4, device=DEVICE, dtype=torch.float32, seed=8)
    return q, k, v, selected, sinks


@pytest.mark.parametrize(("dtype", "rtol", "atol"), DTYPES, ids=lambda v: str(v))
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_sparse_attention_with_sinks_and_shared_heads(
    kv_heads: int, dtype: torch.dtype, rtol: float, atol: float
) -> None:
    """The Triton kernel with sink logits and fewer key heads than query heads equals the
    gather with sinks and the dense masked reference: output and the gradients of q, k, v and
    the sinks."""
    from temper.kernels.sparse_attention import (
        gather_attention,
        selected_indices,
        sparse_attention,
        sparse_attention_reference,
    )

    runs = {
        "triton": lambda q, k, v, sel, sinks: sparse_attention(q, k, v, sel, 0.3, "triton", sinks),
        "gather": lambda q, k, v, sel, sinks: gather_attention(
            q, k, v, selected_indices(sel), 0.3, sinks
        ),
        "dense": lambda q, k, v, sel, sinks: sparse_attention_reference(q, k, v, sel, 0.3, sinks),
    }
    results = {}
    for name, run in runs.items():
        q, k, v, selected, sinks = _sink_inputs(kv_heads, dtype)
        out = run(q, k, v, selected, sinks)
        cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(out)
        results[name] = [out, *torch.autograd.grad(out, (q, k, v, sinks), cotangent)]
    for oracle in ("gather", "dense"):
        for got, expected in zip(results["triton"], results[oracle], strict=True):
            torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)


def test_deepseek_v4_attention_on_the_triton_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek V4 (its debug flavor cut to a sliding, a CSA and an HCA layer, small widths)
    with its compressed attention on the Triton kernel equals the masked sdpa reference on a
    row packed as documents of 30 and 18 tokens: logits and every gradient in fp32 within
    1e-5."""
    import copy

    from temper.kernels import dispatch
    from temper.models import build_model, materialize

    torch.manual_seed(0)
    shrunk = {
        "n_layers": 3,
        "layer_types": ("sliding_attention", "compressed_sparse_attention",
                        "heavily_compressed_attention"),
        "mlp_layer_types": ("hash_moe", "moe", "moe"),
        "dim": 64, "vocab_size": 128, "sliding_window": 8, "hca_ratio": 8, "index_topk": 4,
    }  # fmt: skip
    model = materialize(build_model("deepseek_v4", "debug", overrides=shrunk), DEVICE)
    tokens = torch.randint(0, 128, (1, 48), generator=torch.Generator().manual_seed(1))
    positions = torch.tensor([list(range(30)) + list(range(18))])
    picked: dict[str, str] = {}
    monkeypatch.setattr(dispatch, "implementation", lambda op, *_: picked.get(op, "reference"))
    results = []
    for impl in ("reference", "triton"):
        picked["compressed_attention"] = impl
        run = copy.deepcopy(model)
        logits = run(tokens.to(DEVICE), position_ids=positions.to(DEVICE))
        logits.float().square().mean().backward()
        grads = [p.grad for p in run.parameters() if p.grad is not None]
        results.append([logits, *grads])
    assert len(results[0]) == len(results[1]) > 1
    for got, expected in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
