"""The Gated DeltaNet hybrids train under SP, FSDP2 and EP as one process does (gloo, CPU).

``test_sp_packed_padded_batch_equals_one_process`` (fast): packed documents of 6 and 9
tokens padded to 16 over 2 SP ranks, so both the head all-to-all around Gated DeltaNet and
the document layout inside it run; every real token's logits, the loss (with the MoE
load-balancing term) and every parameter's gradient equal one process's on the unpadded batch.

``test_layouts_train_like_one_process`` (slow): Qwen3.5-MoE's debug recipe at SP 2,
SP 2 x FSDP 2, EP 2 and SP 2 x EP 2, and Qwen3-Next's at SP 2: every step's loss and
gradient norm over 3 steps of 8 x 32 tokens within 1e-5 relative of one process training the
same global micro-batches (``training.py``); and at SP 2 x EP 2 with compiled, selectively
checkpointed blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import run_on_ranks
from training import SINGLE, Layout, Run, assert_same_metrics, parity_config
from training import train as train_layout

from temper.config import Config
from temper.recipes.qwen3_5 import qwen3_5_moe_debug, qwen3_next_debug

SP2 = Layout("sp2", world=2, local_batch=4, parallelism={"sp": 2})
SP2_FSDP2 = Layout("sp2_fsdp2", world=4, local_batch=2, parallelism={"sp": 2})
EP2 = Layout("ep2", world=2, local_batch=4, parallelism={"ep": 2})
SP2_EP2 = Layout("sp2_ep2", world=2, local_batch=4, parallelism={"sp": 2, "ep": 2})
# The NGPU=4 layout: two data ranks, each an SP pair, experts over EP 2 (expert FSDP 2).
SP2_EP2_4 = Layout("sp2_ep2_world4", world=4, local_batch=2, parallelism={"sp": 2, "ep": 2})
# EP 2 has two data ranks: its global micro-batch is all 8 rows, which the load-balancing loss
# (not a sum over tokens) sees at once; the reference takes them in one micro-batch too.
SINGLE8 = Layout("single8", world=1, local_batch=8)
SEQ_LEN = 32
CASES = [
    *((qwen3_5_moe_debug, layout) for layout in (SP2, SP2_FSDP2, EP2, SP2_EP2)),
    (qwen3_next_debug, SP2),
]


@pytest.fixture(scope="module")
def references() -> dict[str, Run]:
    """One single-process run per recipe and layout, trained on first use (`reference_run`)."""
    return {}


def layout_config(recipe: Callable[[], Config], folder: Path, layout: Layout) -> Config:
    config = parity_config(recipe, folder, layout)
    config.training.seq_len = SEQ_LEN
    return config


def reference_run(
    recipe: Callable[[], Config], folder: Path, layout: Layout, references: dict[str, Run]
) -> Run:
    key = f"{recipe.__name__}-{layout.name}"
    if key not in references:
        references[key] = train_layout(layout_config(recipe, folder, layout), layout)
    return references[key]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("recipe", "layout"), CASES, ids=[f"{r.__name__}-{layout.name}" for r, layout in CASES]
)
def test_layouts_train_like_one_process(
    recipe: Callable[[], Config],
    layout: Layout,
    tmp_path_factory: pytest.TempPathFactory,
    references: dict[str, Run],
) -> None:
    folder = tmp_path_factory.mktemp(recipe.__name__)
    reference = reference_run(recipe, folder, SINGLE8 if layout is EP2 else SINGLE, references)
    run = train_layout(layout_config(recipe, folder, layout), layout)
    assert_same_metrics(run.rows, reference.rows)


@pytest.mark.slow
def test_sp2_ep2_with_compiled_and_selectively_checkpointed_blocks_trains_like_one_process(
    tmp_path: Path, references: dict[str, Run]
) -> None:
    """Qwen3.5-MoE at SP 2 x EP 2 with ``--compile.enable`` and selective checkpointing (the
    blocks compiled in parts around the dispatch, the Ulysses all-to-alls inside them): one
    eager process's losses and gradient norms (1e-4, as for compiled blocks elsewhere).
    Before `recomputed_whole`, step 1's gradient norm was 1% off: the checkpoint kept the
    compiled part's all-to-all output, whose buffer the compiled code then reused."""
    reference = reference_run(qwen3_5_moe_debug, tmp_path, SINGLE, references)
    compiled = layout_config(qwen3_5_moe_debug, tmp_path, SP2_EP2)
    compiled.compile.enable = True
    compiled.activation_checkpoint.mode = "selective"
    run = train_layout(compiled, SP2_EP2)
    assert run.compiled_graphs > 0
    assert_same_metrics(run.rows, reference.rows, rel=1e-4)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_sp_packed_padded_batch_equals_one_process(family: str) -> None:
    got, want = run_on_ranks(_padded_batch_rank, 2, family)[0]
    torch.testing.assert_close(got["logits"], want["logits"], rtol=1e-5, atol=1e-5)
    assert got["loss"].item() == pytest.approx(want["loss"].item(), rel=1e-6)
    assert got["grads"].keys() == want["grads"].keys()
    for name, grad in got["grads"].items():
        # Summed losses give large gradients; rank-split sums differ from one sum by ~1e-7.
        scale = want["grads"][name].abs().max().item()
        torch.testing.assert_close(grad, want["grads"][name], rtol=1e-5, atol=1e-5 * scale)


def _padded_batch_rank(family: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
    import torch.distributed as dist

    from temper.models import build_model, materialize
    from temper.objectives import CausalLM
    from temper.objectives.causal_lm import documents
    from temper.parallel.ulysses import SequenceParallel, UlyssesCore
    from temper.utils.device import init_runtime

    init_runtime()
    torch.manual_seed(0)
    reference = materialize(build_model(family, "debug"), "cpu")
    with torch.no_grad():  # decay rates that keep the state carrying tokens along
        for name, p in reference.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.05, 1.0).log())
    model = build_model(family, "debug")
    sp = SequenceParallel(dist.group.WORLD)
    sp.apply(model)
    assert isinstance(model.layers[0].attention.sequence_core, UlyssesCore)
    model = materialize(model, "cpu")
    model.load_state_dict(reference.state_dict())

    ids = torch.randint(1, 1000, (2, 15), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1, dims=1)
    positions = torch.cat([torch.arange(6), torch.arange(9)]).expand(2, 15)
    batch = {"input_ids": ids, "labels": labels, "position_ids": positions}
    shard = sp.shard(batch)

    def run(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        loss, _, _ = CausalLM().loss(model, batch)
        loss.backward()
        grads = {}
        for name, p in model.named_parameters():
            grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            if model is not reference:
                dist.all_reduce(grad)
            grads[name] = grad
        return {"loss": loss.detach(), "grads": grads}

    with torch.no_grad():
        logits = model(shard["input_ids"], shard["position_ids"], documents(shard))
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, logits.contiguous())
    got = run(model, shard)
    dist.all_reduce(got["loss"])
    got["logits"] = torch.cat(parts, dim=1)[:, :15]
    with torch.no_grad():
        want_logits = reference(ids, positions, documents(batch))
    want = run(reference, batch)
    want["logits"] = want_logits
    dist.barrier()  # the ranks' pending collectives finish before any rank exits
    return (got, want) if dist.get_rank() == 0 else None


@pytest.mark.slow
@pytest.mark.parametrize("layout", [SP2_EP2, SP2_EP2_4], ids=lambda layout: layout.name)
def test_hf_folder_trains_at_sp2_ep2_like_one_process(layout: Layout, tmp_path: Path) -> None:
    """`--model.hf_path` on a folder transformers wrote (`Qwen3_5MoeForCausalLM`, random, the
    built-in tokenizer's vocabulary): SP 2 x EP 2, on 2 ranks and on 4 (`NGPU=4`), trains the
    single process's losses and gradient norms over 3 steps, both starting from the
    folder's weights."""
    from transformers import AutoModelForCausalLM, Qwen3_5MoeTextConfig

    hf_config = Qwen3_5MoeTextConfig(
        vocab_size=2048,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(hf_config).save_pretrained(tmp_path / "hf")
    tokenizer = str(resources.files("temper.assets") / "tokenizer.json")

    def config(layout: Layout) -> Config:
        c = layout_config(qwen3_5_moe_debug, tmp_path, layout)
        c.model.hf_path = str(tmp_path / "hf")
        c.data.tokenizer_path = tokenizer
        return c

    reference = train_layout(config(SINGLE), SINGLE)
    run = train_layout(config(layout), layout)
    assert_same_metrics(run.rows, reference.rows)
