"""``--compile.enable`` on MoE models: the blocks compile with ``fullgraph=True`` (the grouped
GEMM is one opaque custom op, the routing statistics an output beside the hidden state) and
train as
eager blocks do, under selective (as in the parity test's compile case) and full activation
checkpointing; so do blocks compiled in parts around an eager dispatch (expert parallelism's).

Qwen3-MoE is traced with ``aot_eager`` (Dynamo and AOTAutograd, forward and backward, without
Inductor's code generation, which would cost a minute per model on CPU). The Gated DeltaNet
hybrid (Qwen3.5-MoE) is compiled with Inductor, what training runs: under ``aot_eager`` its
Gated DeltaNet backward fails a ``view`` (the traced graph's strides are not the eager
kernels' for one of its ops), while Inductor's generated code trains."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

from temper.models import build_model, materialize
from temper.models.layers.experts import run_local
from temper.models.layers.moe import RoutingStats, moe_layers
from temper.parallel.activation_checkpoint import CheckpointMode, apply_activation_checkpointing
from temper.parallel.compile import apply_compile


def _eager_and_compiled(
    model: nn.Module, mode: CheckpointMode, backend: str, around_dispatch: bool = False
) -> tuple[nn.Module, nn.Module]:
    """``around_dispatch``: the compiled copy's MoE layers dispatch through an eager-only
    function, as expert parallelism's all-to-all does, and its blocks compile in parts."""
    eager = materialize(model, torch.device("cpu"))
    compiled = copy.deepcopy(eager)
    for m in (eager, compiled):
        m.train()
        apply_activation_checkpointing(list(m.layers), mode)
    if around_dispatch:
        for moe in moe_layers(compiled).values():
            moe.use_dispatcher(torch.compiler.disable(run_local))
    torch.compiler.reset()
    counters.clear()
    apply_compile(list(compiled.layers), backend=backend, around_dispatch=around_dispatch)
    return eager, compiled


def _train_once(
    model: nn.Module, tokens: torch.Tensor
) -> tuple[torch.Tensor, list[RoutingStats], Any]:
    logits = model(tokens)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    (loss + model.aux_loss()).backward()
    return loss.detach(), model.routing(), dict(model.named_parameters())


def _assert_trains_alike(eager: nn.Module, compiled: nn.Module, tokens: torch.Tensor) -> None:
    """One step of each: the compiled blocks in whole graphs, the same loss, gradients and
    routing."""
    eager_loss, eager_routing, eager_params = _train_once(eager, tokens)
    loss, routing, params = _train_once(compiled, tokens)
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=0)
    for name, p in params.items():
        torch.testing.assert_close(p.grad, eager_params[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    for m, e in zip(routing, eager_routing, strict=True):
        assert torch.equal(m.tokens_per_expert, e.tokens_per_expert)
        torch.testing.assert_close(m.prob_sum, e.prob_sum, rtol=1e-5, atol=1e-6)
    torch.compiler.reset()


def _assert_same_grads(params: dict[str, Any], eager_params: dict[str, Any], rtol: float) -> None:
    """The same parameters have gradients in both models, within ``rtol``; then compiled
    graphs are dropped for the next test."""
    for name, p in params.items():
        want = eager_params[name].grad
        assert (p.grad is None) == (want is None), name
        if want is not None:
            torch.testing.assert_close(p.grad, want, rtol=rtol, atol=1e-6, msg=name)
    torch.compiler.reset()


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_compiled_moe_blocks_give_eager_losses_gradients_and_routing(mode: CheckpointMode) -> None:
    torch.manual_seed(0)
    eager, compiled = _eager_and_compiled(build_model("qwen3_moe", "debug"), mode, "aot_eager")
    _assert_trains_alike(eager, compiled, torch.randint(0, 64, (2, 32)))


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_moe_blocks_compiled_around_an_eager_dispatch_give_eager_results(
    mode: CheckpointMode,
) -> None:
    """Expert parallelism's compile: each block's parts in whole graphs (no graph break),
    its own code, the MoE layer's and the dispatch eager, inside an eager checkpoint."""
    torch.manual_seed(0)
    model = build_model("qwen3_moe", "debug")
    eager, compiled = _eager_and_compiled(model, mode, "aot_eager", around_dispatch=True)
    _assert_trains_alike(eager, compiled, torch.randint(0, 64, (2, 32)))


@pytest.mark.slow  # Inductor generates the two blocks' forward and backward: about a minute
@pytest.mark.parametrize("mode", ["none", "full"])
def test_compiled_hybrid_blocks_give_eager_losses_gradients_and_routing(
    mode: CheckpointMode,
) -> None:
    """A Gated DeltaNet block and a gated-attention one, both with routed experts; 96 tokens:
    the chunked rule's whole chunk and a partial one."""
    torch.manual_seed(0)
    two_blocks = {"n_layers": 2, "layer_types": ("linear_attention", "full_attention")}
    model = build_model("qwen3_5_moe", "debug", overrides=two_blocks)
    eager, compiled = _eager_and_compiled(model, mode, "inductor")
    _assert_trains_alike(eager, compiled, torch.randint(0, 2048, (2, 96)))


def test_checkpointed_compiled_step_routes_as_the_plain_eager_step() -> None:
    """The statistics are outputs, so a DeepSeek V3 step under full activation checkpointing
    with compiled blocks (traced with no Dynamo setting for forward side effects: V3's blocks
    record nothing in forward) gives the plain eager step's balancing loss, statistics,
    gradients and aux-loss-free load, counted once per forward (an eager recomputation used
    to count it again)."""
    torch.manual_seed(0)
    two_layers = {"n_layers": 2}  # a dense block and an MoE one: both graphs, less to run
    plain = materialize(build_model("deepseek_v3", "debug", overrides=two_layers), "cpu")
    checked = copy.deepcopy(plain)
    apply_activation_checkpointing(list(checked.layers), "full")
    torch.compiler.reset()
    counters.clear()
    apply_compile(list(checked.layers), backend="aot_eager")
    tokens = torch.randint(0, plain.args.vocab_size, (2, 16))
    steps = []
    for model in (plain, checked):
        model.train()
        logits = model(tokens)
        aux = model.aux_loss()
        (logits.float().square().mean() + aux).backward()
        loads = [m.router.load for m in moe_layers(model).values()]
        steps.append((aux.detach(), model.routing(), loads))
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]
    (want_aux, want, _), (aux, got, loads) = steps
    torch.testing.assert_close(aux, want_aux, rtol=1e-6, atol=0)
    for g, w, load in zip(got, want, loads, strict=True):
        assert torch.equal(g.tokens_per_expert, w.tokens_per_expert)
        torch.testing.assert_close(g.prob_sum, w.prob_sum, rtol=1e-5, atol=1e-6)
        assert torch.equal(load, w.tokens_per_expert)
    want_params = dict(plain.named_parameters())
    for name, p in checked.named_parameters():
        torch.testing.assert_close(p.grad, want_params[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    torch.compiler.reset()


@pytest.mark.slow
def test_compiled_sparse_attention_blocks_train_as_eager() -> None:
    """DeepSeek V3.2's blocks (MLA with the lightning indexer's top-k selection, group-limited
    MoE) compile whole under full checkpointing and train as eager ones, on a row longer than
    ``index_topk`` (16 here) so the selection matters."""
    torch.manual_seed(0)
    model = build_model("deepseek_v32", "debug", overrides={"index_topk": 16})
    eager, compiled = _eager_and_compiled(model, "full", "aot_eager")
    _assert_trains_alike(eager, compiled, torch.randint(0, 64, (2, 48)))


@pytest.mark.slow
def test_compiled_indexer_training_and_shared_selection_train_as_eager() -> None:
    """GLM-5's blocks with their indexers training (``sparse``) and layers that reuse the
    choice before them (``shared``), compiled whole under full checkpointing: the KL term and
    the selection are block outputs, so torch 2.11, which refuses a side effect in a
    checkpointed region, traces them too. The same loss, KL and gradients (the indexers'
    included) as eager."""
    torch.manual_seed(0)
    overrides = {
        "index_topk": 16,
        "indexer_training": "sparse",
        "indexer_types": ("full", "shared", "full", "shared"),
    }
    eager, compiled = _eager_and_compiled(
        build_model("glm_moe_dsa", "debug", overrides=overrides), "full", "aot_eager"
    )
    tokens = torch.randint(0, 64, (2, 48))
    results = []
    for model in (eager, compiled):
        logits = model(tokens)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        kl = model.indexer_loss()
        (loss + model.aux_loss() + kl).backward()
        results.append((loss.detach(), kl.detach(), dict(model.named_parameters())))
    (eager_loss, eager_kl, eager_params), (loss, kl, params) = results
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(kl, eager_kl, rtol=1e-5, atol=0)
    assert eager_params["layers.0.attention.indexer.wk.weight"].grad is not None
    _assert_same_grads(params, eager_params, rtol=1e-4)


def test_compiled_deepseek_v4_blocks_train_as_eager() -> None:
    """DeepSeek V4's blocks (hyper-connections, compressed attention with its compressors and
    the CSA indexer's top-k, a hash-routed MoE and a top-k one) compile whole under full
    checkpointing: a CSA and an HCA block of the debug flavor on 48 tokens (12 CSA entries,
    8 picked; 3 HCA entries), the same loss and gradients as eager within 1e-5."""
    torch.manual_seed(0)
    two_blocks = {
        "n_layers": 2,
        "layer_types": ("compressed_sparse_attention", "heavily_compressed_attention"),
        "mlp_layer_types": ("hash_moe", "moe"),
    }
    model = build_model("deepseek_v4", "debug", overrides=two_blocks)
    eager, compiled = _eager_and_compiled(model, "full", "aot_eager")
    tokens = torch.randint(0, model.args.vocab_size, (1, 48))
    eager_loss, _, eager_params = _train_once(eager, tokens)
    loss, _, params = _train_once(compiled, tokens)
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=0)
    _assert_same_grads(params, eager_params, rtol=1e-5)
