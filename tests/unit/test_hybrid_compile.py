"""``--compile.enable`` on the Gated DeltaNet hybrids: a Qwen3.5-MoE pair of blocks (one Gated
DeltaNet, one gated attention, both with routed experts) compiled with Inductor, as training
compiles them, gives the eager blocks' loss, gradients and routing.

Inductor, not ``aot_eager`` as in test_moe_compile: under ``aot_eager`` the Gated DeltaNet
backward fails a ``view`` (the traced graph's strides are not the eager kernels' for one of
its ops), while Inductor's generated code, what users run, trains. Slow: the two blocks'
forward and backward take Inductor about a minute to generate on CPU."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from temper.models import build_model, materialize
from temper.models.layers.moe import MoE
from temper.parallel.activation_checkpoint import apply_activation_checkpointing
from temper.parallel.compile import apply_compile

TWO_BLOCKS = {"n_layers": 2, "layer_types": ("linear_attention", "full_attention")}


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_compiled_hybrid_blocks_give_eager_losses_gradients_and_routing(
    checkpointing: str,
) -> None:
    torch.manual_seed(0)
    model = build_model("qwen3_5_moe", "debug", overrides=TWO_BLOCKS)
    eager = materialize(model, torch.device("cpu"))
    compiled = copy.deepcopy(eager)
    for m, is_compiled in ((eager, False), (compiled, True)):
        m.train()
        if checkpointing != "none":
            apply_activation_checkpointing(list(m.layers), checkpointing, compiled=is_compiled)
    torch.compiler.reset()
    counters.clear()
    apply_compile(list(compiled.layers))
    tokens = torch.randint(0, 2048, (2, 96))  # two chunks of the chunked rule and a partial one
    results = []
    for m in (eager, compiled):
        logits = m(tokens)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        (loss + m.aux_loss()).backward()
        moes = [x for x in m.modules() if isinstance(x, MoE)]
        results.append((loss.detach(), moes, dict(m.named_parameters())))
    assert counters["stats"]["unique_graphs"] >= 2 and not counters["graph_break"]
    (eager_loss, eager_moes, eager_params), (loss, moes, params) = results
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=0)
    for name, p in params.items():
        torch.testing.assert_close(p.grad, eager_params[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    for m, e in zip(moes, eager_moes, strict=True):
        assert torch.equal(m.routing.tokens_per_expert, e.routing.tokens_per_expert)
    torch.compiler.reset()
