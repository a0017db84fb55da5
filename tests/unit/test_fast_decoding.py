"""The static-cache decode step against the eager one: the same tokens and log-probs for every
family (a Gated DeltaNet hybrid too), a compiled step traced once for every token and for
prompts of different widths, and the static cache's mask by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_generation import (
    HF_PROMPTS,
    PROMPTS,
    TINY,
    tiny_hf_llama,
    tiny_model,
    transformers_greedy,
)

from temper.generation import decoding, generate
from temper.kernels.attention import attention
from temper.models import build_model, materialize
from temper.models.layers.kv_cache import StaticKVCache, cached_attention, logit_bias

NEW = 6


def _sample(model: torch.nn.Module, compile: bool, prompts=PROMPTS) -> decoding.Generation:
    return generate(
        model,
        prompts,
        NEW,
        1.0,
        generator=torch.Generator().manual_seed(0),
        return_log_probs=True,
        compile=compile,
    )


def _model(family: str) -> torch.nn.Module:
    if family in TINY:
        return tiny_model(family)
    # A Gated DeltaNet hybrid: conv window and recurrent state beside the KV cache.
    torch.manual_seed(0)
    return materialize(build_model(family, "debug"), torch.device("cpu"))


@pytest.fixture
def eager_static_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """compile=True on the static cache, with the step left uncompiled (fast to test)."""
    monkeypatch.setattr(decoding, "_COMPILED", [decoding.decode_step])


@pytest.mark.usefixtures("eager_static_step")
@pytest.mark.parametrize("family", [*TINY, "qwen3_5_moe"])
def test_static_cache_decodes_what_the_growing_cache_does(family: str) -> None:
    model = _model(family)
    eager, static = _sample(model, False), _sample(model, True)
    assert torch.equal(static.tokens, eager.tokens)
    torch.testing.assert_close(static.log_probs, eager.log_probs, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("n", "h", "h_kv", "d_v", "window", "sinks"),
    [
        (1, 4, 2, 8, None, False),
        (3, 4, 1, 6, None, False),
        (1, 4, 2, 8, 3, True),
        (3, 2, 2, 8, 2, True),
    ],
)
def test_cached_attention_equals_sdpa_over_a_head_major_cache(
    n: int, h: int, h_kv: int, d_v: int, window: int | None, sinks: bool
) -> None:
    """The written-out attention of the static cache against ``attention`` (sdpa, or the sink
    column's definition) on the same keys in [b, s, h_kv, d]: GQA, MLA's d_v != d, a sliding
    window, sinks, one query and several, padded key columns hidden."""
    torch.manual_seed(0)
    b, s, d = 2, 7, 8
    q = torch.randn(b, n, h, d)
    k, v = torch.randn(b, s, h_kv, d), torch.randn(b, s, h_kv, d_v)
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[0, :2] = False  # left padding of row 0
    keys, queries = torch.arange(s), torch.arange(s - n, s)[:, None]
    mask = ((valid[:, None, :] | (keys == queries)) & (keys <= queries)).unsqueeze(1)
    sink = torch.randn(h) if sinks else None
    scale = 0.3
    want = attention(q, k, v, mask=mask, window=window, scale=scale, sinks=sink)
    if window is not None:
        mask = mask & (queries - keys < window)
    bias = logit_bias(mask.squeeze(1))
    got = cached_attention(q, k.transpose(1, 2), v.transpose(1, 2), bias, scale=scale, sinks=sink)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_static_mask_by_hand() -> None:
    """The static cache's bias covers the columns filled so far, as the growing cache's does,
    and their count is a tensor's length, not a Python number. Columns as ``generate`` lays
    them out: a left-padded prompt of 3, then 2 decoded columns (valid in every row), and a
    rounded-up spare one."""
    valid = torch.tensor([[False, True, True, True, True], [True, True, True, True, True]])
    cache = StaticKVCache(valid, n_layers=1, max_len=6)
    cache.open(3)
    cache.extend(3)
    # Prefill: causal over the 3 prompt columns; the padding query sees itself only.
    assert set(cache.bias.unique().tolist()) == {0.0, float("-inf")}
    assert (cache.bias[0, 0] == 0).int().tolist() == [[1, 0, 0], [0, 1, 0], [0, 1, 1]]
    for seen in ([[0, 1, 1, 1], [1, 1, 1, 1]], [[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]):
        # A decode step writes the next column and sees every valid column up to it.
        cache.open(1)
        cache.extend(1)
        end = len(seen[0])
        assert cache.keys.tolist() == list(range(end)) and cache.columns.tolist() == [end - 1]
        assert (cache.bias[:, 0, 0] == 0).int().tolist() == seen
    # The spare column is padding: a query there would see itself too (never a step of
    # generate's, but the rule that keeps softmax rows non-empty).
    cache.open(1)
    assert (cache.bias[:, 0, 0] == 0).int().tolist() == [[0, 1, 1, 1, 1, 1], [1] * 6]
    with pytest.raises(ValueError, match="holds 6 tokens"):
        cache.open(1)
    with pytest.raises(ValueError, match="pass position_ids"):
        _ = cache.length


@pytest.mark.parametrize(
    "family",
    [
        "llama3",
        "qwen3_moe",  # MoE: the grouped GEMM is one opaque op, whatever each token's groups
        pytest.param("qwen3_5", marks=pytest.mark.slow),
    ],
)
def test_the_compiled_step_is_one_graph_for_every_token_and_width(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Traced with a counting backend (no code generation): one graph, no graph break, no
    recompilation between tokens or for a batch of other prompt widths that round to the
    same cache length. Qwen3.5 (Gated DeltaNet layers beside attention) recompiled once at
    the second token when its convolution window kept the prefill's strides."""
    graphs = []

    def backend(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(graph)
        return graph.forward

    torch.compiler.reset()
    step = torch.compile(decoding.decode_step, backend=backend, dynamic=False, fullgraph=True)
    monkeypatch.setattr(decoding, "_COMPILED", [step])
    model = _model(family)
    eager, compiled = _sample(model, False), _sample(model, True)
    assert torch.equal(compiled.tokens, eager.tokens)
    torch.testing.assert_close(compiled.log_probs, eager.log_probs, rtol=0, atol=1e-5)
    _sample(model, True, [[1, 2], [3, 4, 5, 6], [7]])
    assert len(graphs) == 1
    torch.compiler.reset()


@pytest.mark.slow
def test_the_inductor_compiled_step_gives_transformers_greedy_tokens(tmp_path: Path) -> None:
    """The compiled step with Inductor's code (the tests above trace without generating
    code): left-padded prompts of 3 to 7 tokens, 12 new ones, so the filled length, a dynamic
    size in the graph, runs from 8 to 18 columns of a 64-column buffer; the greedy ids of
    transformers' generate (the two-reduction argmax included)."""
    hf, native = tiny_hf_llama(tmp_path)
    torch.compiler.reset()
    decoding._COMPILED.clear()
    try:
        ours = generate(native, HF_PROMPTS, 12, compile=True)
        assert ours.tokens.tolist() == transformers_greedy(hf, HF_PROMPTS, 12)
    finally:
        torch.compiler.reset()
        decoding._COMPILED.clear()
