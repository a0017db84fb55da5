"""``--compile.enable`` on MoE models: the blocks compile with ``fullgraph=True`` (the grouped
GEMM is one opaque custom op, the routing statistics a forward-only side effect) and train as
eager blocks do, under selective (as in the parity test's compile case) and full activation
checkpointing.

Traced with ``aot_eager`` (Dynamo and AOTAutograd, forward and backward, without Inductor's
code generation, which would cost a minute per model on CPU). Qwen3.5-MoE is in
test_hybrid_compile, with Inductor: under ``aot_eager`` its Gated DeltaNet layers' backward
fails a ``view``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from temper.models import build_model, materialize
from temper.models.layers.moe import MoE
from temper.parallel.activation_checkpoint import apply_activation_checkpointing
from temper.parallel.compile import apply_compile


@pytest.mark.parametrize("mode", ["selective", "full"])
@pytest.mark.parametrize("family", ["qwen3_moe"])
def test_compiled_moe_blocks_give_eager_losses_gradients_and_routing(
    family: str, mode: str
) -> None:
    torch.manual_seed(0)
    eager = materialize(build_model(family, "debug"), torch.device("cpu"))
    compiled = copy.deepcopy(eager)
    for model, is_compiled in ((eager, False), (compiled, True)):
        model.train()
        apply_activation_checkpointing(list(model.layers), mode, compiled=is_compiled)
    torch.compiler.reset()
    counters.clear()
    apply_compile(list(compiled.layers), backend="aot_eager")
    tokens = torch.randint(0, 64, (2, 32))
    results = []
    for model in (eager, compiled):
        logits = model(tokens)
        targets = tokens[:, 1:].flatten()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), targets)
        loss = loss + model.aux_loss()
        loss.backward()
        moes = [m for m in model.modules() if isinstance(m, MoE)]
        results.append((loss.detach(), moes, dict(model.named_parameters())))
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]
    (eager_loss, eager_moes, eager_params), (loss, moes, params) = results
    torch.testing.assert_close(loss, eager_loss, rtol=1e-4, atol=0)
    for name, p in params.items():
        torch.testing.assert_close(p.grad, eager_params[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    for m, e in zip(moes, eager_moes, strict=True):
        assert torch.equal(m.routing.tokens_per_expert, e.routing.tokens_per_expert)
        torch.testing.assert_close(m.routing.prob_sum, e.routing.prob_sum, rtol=1e-5, atol=1e-6)
    torch.compiler.reset()
