"""``--compile.enable`` on MoE models: the blocks compile with ``fullgraph=True`` (the grouped
GEMM is one opaque custom op, the routing statistics a forward-only side effect) and train as
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
from temper.models.layers.moe import MoE, moe_layers
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


def _train_once(model: nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, list[MoE], Any]:
    logits = model(tokens)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    (loss + model.aux_loss()).backward()
    moes = list(moe_layers(model).values())
    return loss.detach(), moes, dict(model.named_parameters())


def _assert_trains_alike(eager: nn.Module, compiled: nn.Module, tokens: torch.Tensor) -> None:
    """One step of each: the compiled blocks in whole graphs, the same loss, gradients and
    routing."""
    eager_loss, eager_moes, eager_params = _train_once(eager, tokens)
    loss, moes, params = _train_once(compiled, tokens)
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=0)
    for name, p in params.items():
        torch.testing.assert_close(p.grad, eager_params[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    for m, e in zip(moes, eager_moes, strict=True):
        assert torch.equal(m.routing.tokens_per_expert, e.routing.tokens_per_expert)
        torch.testing.assert_close(m.routing.prob_sum, e.routing.prob_sum, rtol=1e-5, atol=1e-6)
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
