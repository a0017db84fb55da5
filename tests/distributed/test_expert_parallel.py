"""Expert parallelism trains the model one process trains (gloo, CPU).

Qwen3-MoE and DeepSeek V3 debug recipes, fp32, random init: EP 2, EP 2 with expert FSDP 2 and
EP 2 with expert replicas (HSDP) each give every step's loss, gradient norm, load-balancing loss
and load imbalance of one process training the same 8 sequences as one batch (the routing
statistics are the global batch's, so the reference takes it in one micro-batch); so does EP 2
with selectively checkpointed blocks, and with compiled blocks under each checkpointing mode
(1e-4).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from pathlib import Path

import pytest
import torch
from harness import run_on_ranks
from training import Layout, Run, assert_same_metrics, parity_config
from training import train as train_layout

from temper.config import Config
from temper.models import materialize, save_hf
from temper.models.deepseek_v3 import FLAVORS, DeepseekV3Transformer
from temper.recipes.deepseek_v3 import deepseek_v3_debug
from temper.recipes.deepseek_v4 import deepseek_v4_debug
from temper.recipes.qwen3 import qwen3_moe_debug
from temper.recipes.qwen3_5 import qwen3_5_moe_debug

SINGLE8 = Layout("single8", world=1, local_batch=8)
EP2 = Layout("ep2", world=2, local_batch=4, parallelism={"ep": 2})
EP2_EFSDP2 = Layout("ep2_efsdp2", world=4, local_batch=2, parallelism={"ep": 2})
EP2_EDP2 = Layout("ep2_edp2", world=4, local_batch=2, parallelism={"ep": 2, "dp_replicate": 2})
SEQ_LEN = 32
MOE_BLOCKS = ("layers.1", "layers.2", "layers.3")  # layer 0 is dense in both debug flavors


def moe_config(recipe: Callable[[], Config], folder: Path, layout: Layout) -> Config:
    config = parity_config(recipe, folder / recipe.__name__, layout)
    config.training.seq_len = SEQ_LEN
    return config


@pytest.fixture(scope="module")
def references() -> dict[str, Run]:
    """One single-process run per recipe, trained on first use (`reference_run`)."""
    return {}


def reference_run(recipe: Callable[[], Config], folder: Path, references: dict[str, Run]) -> Run:
    if recipe.__name__ not in references:
        references[recipe.__name__] = train_layout(moe_config(recipe, folder, SINGLE8), SINGLE8)
    return references[recipe.__name__]


def assert_same_routing(rows: list[dict], reference: list[dict], aux_rel: float) -> None:
    """Each step's load-balancing loss within ``aux_rel``, its load imbalance within 1e-6."""
    for row, ref in zip(rows, reference, strict=True):
        assert row["aux_loss"] == pytest.approx(ref["aux_loss"], rel=aux_rel)
        assert row["moe_load_imbalance"] == pytest.approx(ref["moe_load_imbalance"], rel=1e-6)


def _case(recipe: Callable[[], Config], layout: Layout, fast: bool = False) -> object:
    marks = () if fast else (pytest.mark.slow,)
    return pytest.param(recipe, layout, id=f"{recipe.__name__}-{layout.name}", marks=marks)


# The DeepSeek EP 2 x expert FSDP 2 case covers every piece and runs in CI's fast set; the
# others are slow (4-rank runs on 2 CPU cores). Expert replicas (edp) run for one family only:
# nothing in them depends on the model.
@pytest.mark.parametrize(
    ("recipe", "layout"),
    [
        _case(qwen3_moe_debug, EP2),
        _case(qwen3_moe_debug, EP2_EFSDP2),
        _case(deepseek_v3_debug, EP2),
        _case(deepseek_v3_debug, EP2_EFSDP2, fast=True),
        _case(deepseek_v3_debug, EP2_EDP2),
        # DeepSeek V4: hash-routed (layer 0) and top-k experts under EP and expert FSDP.
        _case(deepseek_v4_debug, EP2_EFSDP2),
    ],
)
def test_expert_parallel_trains_like_one_process(
    recipe: Callable[[], Config],
    layout: Layout,
    tmp_path_factory: pytest.TempPathFactory,
    references: dict[str, Run],
) -> None:
    folder = tmp_path_factory.getbasetemp() / "expert"
    reference = reference_run(recipe, folder, references)
    run = train_layout(moe_config(recipe, folder, layout), layout)
    experts = {f"{block}.feed_forward.experts" for block in MOE_BLOCKS}
    assert experts <= set(run.fsdp_units)
    assert_same_metrics(run.rows, reference.rows)
    assert_same_routing(run.rows, reference.rows, aux_rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("recipe", "checkpointing", "compiled"),
    [
        (qwen3_moe_debug, "selective", False),
        (qwen3_moe_debug, "none", True),
        (qwen3_moe_debug, "full", True),
        (qwen3_5_moe_debug, "none", True),
        (qwen3_5_moe_debug, "selective", True),
    ],
    ids=[
        "qwen3_moe-selective",
        "qwen3_moe-none-compiled",
        "qwen3_moe-full-compiled",
        "qwen3_5_moe-none-compiled",
        "qwen3_5_moe-selective-compiled",
    ],
)
def test_checkpointed_and_compiled_blocks_under_expert_parallelism_train_like_one_process(
    recipe: Callable[[], Config],
    checkpointing: str,
    compiled: bool,
    tmp_path_factory: pytest.TempPathFactory,
    references: dict[str, Run],
) -> None:
    """Checkpointed blocks, and blocks compiled in parts around the eager all-to-all
    dispatch, without and with checkpointing: the same losses, gradient norms and routing
    statistics as one eager process (1e-4, as for compiled dense blocks). Selective
    checkpointing replays the experts' FSDP unit, whose hooks annotate the recomputation
    differently from the forward (`sac_ignores_profiler_annotations`)."""
    folder = tmp_path_factory.getbasetemp() / "expert"
    reference = reference_run(recipe, folder, references)
    config = moe_config(recipe, folder / f"{checkpointing}_{compiled}", EP2)
    config.compile.enable = compiled
    config.activation_checkpoint.mode = checkpointing
    run = train_layout(config, EP2)
    assert (run.compiled_graphs > 0) == compiled and reference.compiled_graphs == 0
    assert_same_metrics(run.rows, reference.rows, rel=1e-4)
    assert_same_routing(run.rows, reference.rows, aux_rel=1e-4)


def test_each_rank_holds_only_its_experts_once_and_loads_them_from_hf(tmp_path: Path) -> None:
    with torch.device("meta"):
        model = DeepseekV3Transformer(FLAVORS["debug"])
    torch.manual_seed(1)
    model = materialize(model, "cpu")
    save_hf(model, tmp_path / "hf")
    full = dict(model.named_parameters())
    config = moe_config(deepseek_v3_debug, tmp_path, EP2_EFSDP2)
    config.model.hf_path = str(tmp_path / "hf")
    config.data.tokenizer_path = str(resources.files("temper.assets") / "tokenizer.json")
    for rank, (shards, managed, n_params) in enumerate(
        run_on_ranks(_expert_shards, EP2_EFSDP2.world, config)
    ):
        ep, efsdp = rank % 2, rank // 2  # expert mesh (edp, efsdp, ep), row-major
        for name, local in shards.items():
            experts = full[name].chunk(2)[ep]  # experts 4 * ep .. 4 * ep + 3 of 8
            assert torch.equal(local, experts.chunk(2)[efsdp]), (rank, name)
        assert len(managed) == len(set(managed)) == n_params, rank


def _expert_shards(config: Config) -> tuple[dict[str, torch.Tensor], list[str], int]:
    """This rank's local expert weights, the names of the parameters each FSDP group manages
    (a name twice: managed twice) and the model's parameter count."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from temper.models.layers.experts import GroupedExperts
    from temper.trainer import Trainer

    model = Trainer(config).engine.model
    shards = {
        f"{name}.{p_name}": p.to_local() if isinstance(p, DTensor) else p.detach()
        for name, m in model.named_modules()
        if isinstance(m, GroupedExperts)
        for p_name, p in m.named_parameters()
    }
    names = {id(p): name for name, p in model.named_parameters()}
    # One state per FSDP group, though a group of several modules (norm + head) has several.
    states = {
        id(s): s
        for m in model.modules()
        if isinstance(m, FSDPModule)
        for s in [m._get_fsdp_state()]
    }
    managed = [
        names[id(fsdp_param.sharded_param)]
        for state in states.values()
        if state._fsdp_param_group is not None
        for fsdp_param in state._fsdp_param_group.fsdp_params
    ]
    return shards, managed, len(names)


def test_load_balancing_loss_is_the_global_batch_loss() -> None:
    loss, grad, full_loss, full_grad = zip(*run_on_ranks(_aux_loss_rank, 2), strict=True)
    assert loss[0] == loss[1] == pytest.approx(full_loss[0], rel=1e-6)
    # Each rank's gate gradient is its part; the FSDP sum of the parts is one process's.
    torch.testing.assert_close(grad[0] + grad[1], full_grad[0], rtol=1e-5, atol=1e-7)


def _aux_loss_rank() -> tuple[float, torch.Tensor, float, torch.Tensor]:
    """The loss on this rank's half of a batch under torch.distributed, and (computed alone
    on the whole batch, before any process group) the reference."""
    import torch.distributed as dist

    from temper.models.layers.moe import MoE, load_balancing_loss

    torch.manual_seed(0)
    moe = MoE(16, 8, n_experts=8, top_k=2, norm_topk_prob=True)
    moe.init_weights(0.5, 0.5)
    tokens = torch.randn(2, 6, 16)

    def aux(x: torch.Tensor, share: float) -> tuple[float, torch.Tensor]:
        moe.zero_grad()
        _, stats = moe(x)
        loss = load_balancing_loss([stats])
        (loss * share).backward()
        return loss.item(), moe.router.gate.weight.grad.clone()

    full_loss, full_grad = aux(tokens, 1.0)
    dist.init_process_group("gloo")
    # Each rank weighs its copy of the global loss by its share of the tokens, as the
    # trainer's loss does (coef x aux per valid token, over the global token count).
    loss, grad = aux(tokens[dist.get_rank()].unsqueeze(0), 1 / dist.get_world_size())
    return loss, grad, full_loss, full_grad
