"""Generation under FSDP2 on 2 gloo ranks against one process: same tokens and log-probabilities,
one all-gather per FSDP unit for a whole rollout whatever its length, and afterwards each unit
reshards after forward exactly as configured."""

from __future__ import annotations

import pytest
import torch
from harness import run_on_ranks
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from temper.generation import generate
from temper.models import load_hf

SIZES = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 80,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
# Each rank decodes its own prompts for its own number of steps: a collective between tokens
# would hang (and time out) instead of passing.
PROMPTS = [[[5, 6, 7, 8], [9, 10]], [[11, 12, 13], [14, 15, 16, 17, 18, 19], [20]]]
NEW = [4, 7]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An untied Llama (embedding and head are units of their own) and a tied Qwen3 (the
    root unit holds them)."""
    root = tmp_path_factory.mktemp("generation_fsdp")
    models = {
        "llama3": LlamaForCausalLM(LlamaConfig(**SIZES, tie_word_embeddings=False)),
        "qwen3": Qwen3ForCausalLM(Qwen3Config(**SIZES, tie_word_embeddings=True)),
    }
    for name, model in models.items():
        model.save_pretrained(root / name)
    return {name: str(root / name) for name in models}


def _generate_on_rank(folders: dict[str, str]) -> dict[str, dict[str, object]]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from temper.models import build_hf_model, materialize
    from temper.parallel.fsdp import apply_fsdp

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    gathers = _count_all_gathers()

    def sharded(model: torch.nn.Module) -> dict[str, bool]:
        return {name: isinstance(p, DTensor) for name, p in model.named_parameters()}

    results = {}
    for family, folder in folders.items():
        model = build_hf_model(folder)
        apply_fsdp(model, mesh, param_dtype=torch.float32, reshard_after_forward="default")
        materialize(model, "cpu", hf_path=folder)
        rollouts = []
        for new in (2, NEW[rank]):  # the first is the model's first forward (FSDP lazy init)
            gathers.clear()
            out = generate(model, PROMPTS[rank], new, return_log_probs=True)
            rollouts.append({"gathers": len(gathers), "sharded_after": sharded(model)})
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]]))
        results[family] = {
            "tokens": out.tokens,
            "log_probs": out.log_probs,
            "rollouts": rollouts,
            "sharded_after_forward": sharded(model),
        }
    return results


def _count_all_gathers() -> list[None]:
    """Every all-gather FSDP2 issues appends to the returned list (torch 2.13 calls
    all_gather_single; older versions all_gather_into_tensor)."""
    import torch.distributed as dist

    calls: list[None] = []
    for name in ("all_gather_single", "all_gather_into_tensor"):
        original = getattr(dist, name, None)
        if original is not None:

            def counted(*args: object, _original=original, **kwargs: object) -> object:
                calls.append(None)
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
    return calls


@pytest.mark.slow
def test_fsdp_generation_equals_one_process_with_weights_gathered_once(
    folders: dict[str, str],
) -> None:
    ranks = run_on_ranks(_generate_on_rank, 2, folders, timeout=180)
    for family, folder in folders.items():
        single = load_hf(folder)
        # Units: 2 blocks, then untied: embedding, norm + head (root holds nothing); tied: root.
        units = 4 if family == "llama3" else 3
        for rank, result in enumerate(ranks):
            got = result[family]
            ref = generate(single, PROMPTS[rank], NEW[rank], return_log_probs=True)
            assert torch.equal(got["tokens"], ref.tokens), (family, rank)
            torch.testing.assert_close(got["log_probs"], ref.log_probs, rtol=0, atol=1e-5)
            for rollout in got["rollouts"]:
                assert rollout["gathers"] == units, (family, rank, rollout["gathers"])
                assert all(rollout["sharded_after"].values()), (family, rank)
            # As configured ("default"): a unit reshards after forward unless backward needs
            # it next (the last block, the head and the root keep their weights).
            tied = family == "qwen3"
            expected = {
                name: name.startswith("layers.0.") or (name.startswith("tok_") and not tied)
                for name in got["sharded_after_forward"]
            }
            assert got["sharded_after_forward"] == expected, (family, rank)


def _compiled_generate_on_rank(folder: str) -> dict[str, object]:
    """``compile=True`` under FSDP2, traced by a counting backend (no code generation): FSDP2's
    hooks split the step into several graphs, and each must take the filled length as
    dynamic (the attention's bias and key ids are its inputs); a longer rollout then adds
    none."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from temper.generation import decoding
    from temper.models import build_hf_model, materialize
    from temper.parallel.fsdp import apply_fsdp

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    graphs: list[torch.fx.GraphModule] = []

    def backend(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(graph)
        return graph.forward

    decoding._COMPILED[:] = [torch.compile(decoding.decode_step, backend=backend, dynamic=False)]
    model = build_hf_model(folder)
    mesh = init_device_mesh("cpu", (2,))
    apply_fsdp(model, mesh, param_dtype=torch.float32, reshard_after_forward="default")
    materialize(model, "cpu", hf_path=folder)
    generate(model, PROMPTS[rank], 2)  # FSDP2's lazy initialization, eager
    generate(model, PROMPTS[rank], 3, compile=True)
    traced = len(graphs)
    out = generate(model, PROMPTS[rank], NEW[rank], return_log_probs=True, compile=True)
    return {"tokens": out.tokens, "log_probs": out.log_probs, "graphs": (traced, len(graphs))}


@pytest.mark.slow
def test_fsdp_compiled_generation_equals_one_process_without_retracing(
    folders: dict[str, str],
) -> None:
    ranks = run_on_ranks(_compiled_generate_on_rank, 2, folders["llama3"], timeout=180)
    single = load_hf(folders["llama3"])
    for rank, got in enumerate(ranks):
        ref = generate(single, PROMPTS[rank], NEW[rank], return_log_probs=True)
        assert torch.equal(got["tokens"], ref.tokens), rank
        torch.testing.assert_close(got["log_probs"], ref.log_probs, rtol=0, atol=1e-5)
        traced, after = got["graphs"]
        assert traced > 1 and after == traced, (rank, traced, after)
