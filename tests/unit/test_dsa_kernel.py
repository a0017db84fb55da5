"""DeepSeek sparse attention's core: the gather of the selected keys (the Triton kernel's oracle,
test_kernels_triton.py) equals the masked dense reference the layer runs on CPU; the selection
becomes the key lists the kernel reads; ``SparseMLA`` reaches the core through the dispatcher;
the FLOPs MFU counts are the sparse work."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_kernels import _sparse_inputs

from temper.kernels import dispatch
from temper.kernels.sparse_attention import (
    gather_attention,
    selected_indices,
    sparse_attention_reference,
)
from temper.models import get_model_spec
from temper.models.deepseek_v32 import DeepseekV32Transformer
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


def test_gather_with_sinks_and_a_shared_head_equals_the_masked_reference() -> None:
    """DeepSeek V4's form: 4 query heads over one key-value head, a sink logit per head.
    Outputs and the gradients of q, k, v and the sinks within 1e-5 (fp32); the sinks change
    the output (so the comparison sees them)."""
    q, k, v, selected = _sparse_inputs(torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 11, 4, 12, generator=gen).requires_grad_()
    k, v = (t[:, :, :1].detach().requires_grad_() for t in (k, v))
    sinks = torch.randn(4, generator=gen).requires_grad_()
    cotangent = torch.randn(2, 11, 4, 8, generator=gen)
    results = []
    for run in (
        lambda: sparse_attention_reference(q, k, v, selected, 0.3, sinks),
        lambda: gather_attention(q, k, v, selected_indices(selected), 0.3, sinks),
    ):
        out = run()
        results.append([out, *torch.autograd.grad(out, (q, k, v, sinks), cotangent)])
    for got, expected in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    without = gather_attention(q, k, v, selected_indices(selected), 0.3)
    assert (without - results[1][0]).abs().max() > 1e-2


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
    """The layer's attention is its context's ``kernels.sparse_attention`` choice: with
    ``compile`` asked for, the compiled form (a spy here) gets the layer's q, k, v, selection
    and softmax scale; other ops keep their references."""
    seen: list[float] = []

    def spy(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        selected: torch.Tensor,
        scale: float,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        seen.append(scale)
        return sparse_attention_reference(q, k, v, selected, scale, sinks)

    torch.manual_seed(0)
    layer = SparseMLA(
        32, 2, 16, 8, 8, 4, 8, index_n_heads=2, index_head_dim=8, index_topk=3,
        index_rope_interleaved=False, softmax_scale=0.25,
    )  # fmt: skip
    x = torch.randn(1, 6, 32)
    cos, sin = rope_cos_sin(rope_inv_freq(4, 10000.0), torch.arange(6)[None])
    plain, _ = layer(x, ForwardContext(cos=cos, sin=sin))
    monkeypatch.setattr(dispatch, "compiled", lambda fn: spy)
    asked = dataclasses.replace(dispatch.REFERENCE, sparse_attention="compile")
    torch.testing.assert_close(layer(x, ForwardContext(cos, sin, kernels=asked))[0], plain)
    assert seen == [0.25]


@pytest.mark.parametrize(
    ("mode", "attention"),
    [
        # Per layer at 256 tokens, top-k 64; debug: 8 heads, qk 48 / v 32 dims, indexer 4 x 32.
        # MLA 6 * 8 * 80 * 64 + indexer scores 2 * 4 * 32 * 256.
        ("off", 245760 + 65536),
        # + the indexer's backward (scores x 3) + the KL target 2 * 8 * 48 * 64.
        ("sparse", 245760 + 196608 + 49152),
        # MLA forward only over all 256 keys, 2 * 8 * 80 * 256, + indexer x 3 + target 2*8*48*256.
        ("dense_warmup", 327680 + 196608 + 196608),
    ],
)
def test_flops_count_the_sparse_work_by_hand(mode: str, attention: int) -> None:
    """The MFU count of deepseek_v32's debug flavor (4 layers), by hand: the attention terms
    and the weights' (the indexers' 25,664 weights a layer, 2 FLOPs each when they do not
    train; every frozen weight 2 in the warm-up)."""
    args = get_model_spec("deepseek_v32").flavors["debug"]
    with torch.device("meta"):
        model = DeepseekV32Transformer(
            dataclasses.replace(args, index_topk=64, indexer_training=mode)
        )
    active, indexers = model.active_params(), 4 * 25664
    weights = {
        "off": 6 * active - 4 * indexers,
        "sparse": 6 * active,
        "dense_warmup": 6 * indexers + 2 * (active - indexers),
    }[mode]
    assert model.flops_per_token(256) == weights + 4 * attention


def test_dry_run_counts_the_sparse_work() -> None:
    """The dry run's FLOPs per token for the debug recipe (indexer training ``sparse``, 256
    tokens, top-k 64) are the model's sparse count, below dense DeepSeek V3's."""
    from temper.config import load_config
    from temper.models.deepseek_v3.model import DeepseekV3Transformer
    from temper.plan import plan_run

    config = load_config("temper.recipes.deepseek_v32", "deepseek_v32_debug")
    plan = plan_run(config, 1, "cpu")
    args = get_model_spec("deepseek_v32").flavors["debug"]
    with torch.device("meta"):
        model = DeepseekV32Transformer(dataclasses.replace(args, indexer_training="sparse"))
    assert plan.flops_per_token == model.flops_per_token(256)
    assert plan.flops_per_token < DeepseekV3Transformer.flops_per_token(model, 256)


def test_dry_run_under_sequence_parallelism() -> None:
    """SP 2 on 256 tokens: the shape-only forward gives the selection's mask the whole
    sequence's size once the exchange has gathered it (the planner failed on the rank's
    slice's before), and Ulysses moves each layer's q, k, v and output once forward and once
    backward, half to the other rank, at a rank's 128 tokens."""
    from temper.config import load_config
    from temper.plan import plan_run

    argv = ["--parallelism.sp", "2"]
    config = load_config("temper.recipes.deepseek_v32", "deepseek_v32_debug", argv, validate=False)
    plan = plan_run(config, 2, "cpu")
    rows, length = plan.tokens
    assert plan.errors == [] and length == config.training.seq_len // 2
    args = get_model_spec("deepseek_v32").flavors["debug"]
    qk = args.qk_nope_head_dim + args.qk_rope_head_dim
    per_layer = rows * length * args.n_heads * (2 * qk + 2 * args.v_head_dim) * 4
    expected = plan.grad_accum * 2 * args.n_layers * per_layer / 2
    assert plan.communication.all_to_all_sp == pytest.approx(expected)
