"""Muon in one process against torch's own optimizers, its parameter split, its config rules,
and optimizer offload with its state."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from temper.config import Config, ConfigError, Job, Metrics, Training
from temper.config import Optimizer as OptimizerConfig
from temper.models import build_model, materialize
from temper.models.layers.rope import apply_rope
from temper.models.llama3 import FLAVORS, Transformer
from temper.optim import OptimizerOffload, build_optimizer
from temper.optim.muon import Muon, orthogonalize
from temper.optim.optimizer import newton_schulz_dtype
from temper.optim.sharded_matrices import assign_owners, rows_of
from temper.trainer.trainer import Trainer

SHAPES = [(16, 32), (48, 16), (24, 24)]  # wide, tall (iterated transposed), square


def _steps(params: list[nn.Parameter], optimizers: list[torch.optim.Optimizer], n: int) -> None:
    """``n`` steps on the same random gradients for each copy of ``params``."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(n):
        grads = [torch.randn(p.shape, generator=generator) for p in params[0]]
        for copy, optimizer in zip(params, optimizers, strict=True):
            for p, g in zip(copy, grads, strict=True):
                p.grad = g.clone()
            optimizer.step()


def _copies(shapes: list[tuple[int, ...]], n: int) -> list[list[nn.Parameter]]:
    torch.manual_seed(0)
    first = [torch.randn(s) for s in shapes]
    return [[nn.Parameter(t.clone()) for t in first] for _ in range(n)]


@pytest.mark.parametrize("rule", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_equals_torch_muon_bitwise(rule: str, nesterov: bool) -> None:
    ours, theirs = _copies(SHAPES, 2)
    optimizers = [
        Muon([{"params": ours}], lr=0.02, weight_decay=0.1, nesterov=nesterov, scale_rule=rule),
        torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=rule),
    ]
    _steps([ours, theirs], optimizers, n=5)
    for a, b, start in zip(ours, theirs, _copies(SHAPES, 1)[0], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert not torch.equal(a, start)  # it moved


def test_adamw_groups_equal_torch_adamw() -> None:
    shapes = [(8, 4), (4,)]
    ours, theirs = _copies(shapes, 2)
    optimizers = [
        Muon([{"params": ours, "algorithm": "adamw"}], lr=1e-2, weight_decay=0.1, eps=1e-8),
        torch.optim.AdamW(theirs, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False),
    ]
    _steps([ours, theirs], optimizers, n=5)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_experts_are_orthogonalized_one_by_one(dtype: torch.dtype) -> None:
    experts = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(0))
    one_by_one = torch.stack([orthogonalize(e, 5, dtype) for e in experts])
    torch.testing.assert_close(orthogonalize(experts, 5, dtype), one_by_one, rtol=0, atol=0)


def test_newton_schulz_flattens_the_spectrum() -> None:
    """Five quintic steps leave every singular value in the iteration's known band around
    one (about 0.68..1.13) from a 10x spread; the singular vectors are kept."""
    u, _ = torch.linalg.qr(torch.randn(32, 32, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(64, 32, dtype=torch.float64))
    spread = torch.logspace(0, -1, 32, dtype=torch.float64)  # a 10x spread
    matrix = (u * spread) @ v.T
    out = orthogonalize(matrix.float(), 5, torch.float32).double()
    values = torch.linalg.svdvals(out)
    assert values.min() > 0.6 and values.max() < 1.2
    torch.testing.assert_close(
        u.T @ out @ v, torch.diag(torch.diagonal(u.T @ out @ v)), atol=1e-4, rtol=0
    )


def test_muon_steps_block_matrices_and_experts_adamw_the_rest() -> None:
    model = materialize(build_model("qwen3_moe", "debug"), "cpu")
    config = OptimizerConfig(name="muon", lr=1e-3, muon_lr=2e-2, muon_weight_decay=0.05)
    optimizer = build_optimizer(model, config)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {g["algorithm"]: g for g in optimizer.param_groups if g["algorithm"] == "muon"}
    muon = {names[id(p)] for p in groups["muon"]["params"]}
    assert groups["muon"]["lr"] == 2e-2 and groups["muon"]["weight_decay"] == 0.05
    assert "layers.1.feed_forward.experts.w1" in muon and "layers.0.attention.wq.weight" in muon
    assert muon == {
        n
        for n, p in model.named_parameters()
        if n.startswith("layers.") and p.ndim >= 2 and ".router." not in n
    }
    adamw = [g for g in optimizer.param_groups if g["algorithm"] == "adamw"]
    assert optimizer.param_groups[0] is adamw[0] and adamw[0]["lr"] == 1e-3
    assert {names[id(p)] for g in adamw for p in g["params"]} == set(names.values()) - muon


def test_newton_schulz_runs_in_bfloat16_only_where_the_hardware_multiplies_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``auto``: bfloat16 on CUDA and on a CPU with AVX512-BF16 or AMX, float32 on a CPU that
    emulates bfloat16 products; an explicit choice is kept; the trainer's Muon gets it."""
    cpu = torch.device("cpu")
    assert newton_schulz_dtype("auto", torch.device("cuda")) == "bfloat16"
    assert newton_schulz_dtype("float32", torch.device("cuda")) == "float32"
    assert newton_schulz_dtype("bfloat16", cpu) == "bfloat16"
    for bf16, amx, expected in [(False, False, "float32"), (True, False, "bfloat16"),
                                (False, True, "bfloat16")]:  # fmt: skip
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda bf16=bf16: bf16)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        assert newton_schulz_dtype("auto", cpu) == expected
        model = materialize(build_model("llama3", "debug"), "cpu")
        optimizer = build_optimizer(model, OptimizerConfig(name="muon"))
        assert [g["ns_dtype"] for g in optimizer.param_groups if g["algorithm"] == "muon"] == [
            expected
        ]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("muon_lr", 0.0, "optimizer.muon_lr must be > 0"),
        ("muon_weight_decay", -1.0, "optimizer.muon_weight_decay must be >= 0"),
        ("muon_momentum", 1.0, r"optimizer.muon_momentum must be in \[0, 1\)"),
        ("muon_ns_steps", 0, r"optimizer.muon_ns_steps must be in \[1, 20\]"),
        ("muon_update_rms", 0.0, "optimizer.muon_update_rms must be > 0"),
        ("muon_qk_clip", -1.0, "optimizer.muon_qk_clip must be >= 0"),
    ],
)
def test_muon_fields_are_validated(field: str, value: float, message: str) -> None:
    config = Config()
    config.optimizer.name = "muon"
    setattr(config.optimizer, field, value)
    with pytest.raises(ConfigError, match=message):
        config.validate(world_size=1)


def test_shard_rows_follow_torch_chunk_and_owners_balance() -> None:
    for n_rows, n_shards in [(80, 4), (7, 4), (2, 4), (9, 2)]:
        sizes = [rows_of(n_rows, n_shards, i)[1] for i in range(n_shards)]
        chunks = [len(c) for c in torch.arange(n_rows).chunk(n_shards)]
        assert sizes == chunks + [0] * (n_shards - len(chunks))
    shapes = [torch.Size(s) for s in [(64, 64), (8, 8), (8, 8), (32, 32), (8, 8)]]
    assert assign_owners(shapes, 2, "round_robin") == [0, 1, 0, 1, 0]
    # Largest first to the least loaded: the 64x64 alone on rank 0, the rest on rank 1.
    assert assign_owners(shapes, 2, "size") == [0, 1, 1, 1, 1]


def test_offload_and_restore_keep_muons_next_step(tmp_path) -> None:
    def trainer(name: str) -> Trainer:
        config = Config(
            job=Job(dump_folder=str(tmp_path / name)),
            training=Training(steps=2, seq_len=32, local_batch_size=2),
            optimizer=OptimizerConfig(name="muon", muon_ns_steps=1),  # cheap; same state
            metrics=Metrics(tensorboard=False),
        )
        return Trainer(config)

    plain, offloaded = trainer("plain"), trainer("offloaded")
    assert isinstance(plain.engine.optimizer, Muon)
    batch = next(iter(plain.loader))
    plain.train_step([batch])
    offloaded.train_step([batch])
    state = offloaded.engine.optimizer.state
    originals = {p: s["momentum_buffer"] for p, s in state.items() if "momentum_buffer" in s}
    offloaded.offload_optimizer()
    # Fresh CPU copies took the momentum buffers' place (a GPU run frees the originals).
    assert originals and all(state[p]["momentum_buffer"] is not b for p, b in originals.items())
    offloaded.restore_optimizer()
    want, got = plain.train_step([batch]), offloaded.train_step([batch])
    assert got["loss"] == want["loss"]
    for a, b in zip(
        plain.engine.model.parameters(), offloaded.engine.model.parameters(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).float().logsumexp(-1).mean()


def _tiny_llama() -> nn.Module:
    """A 2-block Llama of width 64 (8 heads of 8, GQA 2:1): Newton-Schulz stays cheap."""
    args = dataclasses.replace(
        FLAVORS["debug"], dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden_dim=128
    )
    with torch.device("meta"):
        model = Transformer(args)
    return materialize(model, "cpu")


def test_qk_clip_scales_the_query_rows_of_heads_over_the_threshold() -> None:
    """Against per-head maxima computed by hand (every causal pair, in a loop) from the
    attention inputs of the same forward: heads above the threshold have their wq rows
    scaled by threshold / max after the step, all else equals a step without QK-clip."""
    torch.manual_seed(0)
    models = [_tiny_llama() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    config = OptimizerConfig(name="muon", lr=1e-2)
    plain = build_optimizer(models[0], config)
    clipped = build_optimizer(models[1], dataclasses.replace(config, muon_qk_clip=1.0))
    maxima: list[torch.Tensor] = []

    def by_hand(attention: nn.Module, args: tuple) -> None:
        x, ctx = args
        cos, sin = ctx.cos, ctx.sin
        b, s, _ = x.shape
        q = apply_rope(attention.wq(x).view(b, s, -1, attention.head_dim), cos, sin)
        k = apply_rope(attention.wk(x).view(b, s, -1, attention.head_dim), cos, sin)
        group = q.size(2) // k.size(2)
        heads = torch.full((q.size(2),), -torch.inf)
        for h in range(q.size(2)):
            for i in range(s):
                logits = (q[:, i, h, None] * k[:, : i + 1, h // group]).sum(-1)
                heads[h] = max(heads[h], logits.max() / attention.head_dim**0.5)
        maxima.append(heads)

    hooks = [layer.attention.register_forward_pre_hook(by_hand) for layer in models[1].layers]
    ids = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(0))
    for model in models:
        _loss(model, ids).backward()
    for hook in hooks:
        hook.remove()
    # The threshold splits the heads: some over it, some under.
    clipped.qk_clip.threshold = threshold = torch.cat(maxima).median().item()
    plain.step()
    clipped.step()
    assert 0 < clipped.qk_clip.clipped < len(torch.cat(maxima))
    for layer, kept, heads in zip(models[1].layers, models[0].layers, maxima, strict=True):
        factor = (threshold / heads).clamp(max=1.0).repeat_interleave(layer.attention.head_dim)
        want = kept.attention.wq.weight * factor[:, None]
        torch.testing.assert_close(layer.attention.wq.weight, want, rtol=1e-5, atol=1e-7)
    clipped_names = {f"layers.{i}.attention.wq.weight" for i in range(len(models[0].layers))}
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        if name not in clipped_names:
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_qk_clip_statistics_pause_while_the_optimizer_is_offloaded() -> None:
    model = _tiny_llama()
    optimizer = build_optimizer(model, OptimizerConfig(name="muon", muon_qk_clip=100.0))
    offload = OptimizerOffload(optimizer)
    ids = torch.randint(0, 2048, (1, 8))
    stats = [layer.attention.logit_max for layer in model.layers]
    with torch.no_grad():
        offload.offload()
        model(ids)  # a rollout's forward
        assert all(s.value is None for s in stats)
        offload.restore()
        model(ids)
    assert all(s.value is not None and s.value.shape == (8,) for s in stats)


def test_qk_clip_refuses_models_and_layouts_it_cannot_serve() -> None:
    model = build_model("qwen3", "debug")  # q_norm / k_norm
    with pytest.raises(ConfigError, match="normalizes q and k per head"):
        build_optimizer(model, OptimizerConfig(name="muon", muon_qk_clip=100.0))
    with pytest.raises(ConfigError, match="multi-head latent attention"):
        build_optimizer(
            build_model("deepseek_v3", "debug"), OptimizerConfig(name="muon", muon_qk_clip=1.0)
        )
    config = Config()
    config.optimizer.name, config.optimizer.muon_qk_clip = "muon", 100.0
    config.validate(world_size=1)  # the debug Llama: plain GQA
    config.model.name = "qwen3"  # refused by validate, from the meta model
    with pytest.raises(ConfigError, match="normalizes q and k per head"):
        config.validate(world_size=1)
    config.model.name = "llama3"
    config.compile.enable = True
    with pytest.raises(ConfigError, match="optimizer.muon_qk_clip with compile.enable"):
        config.validate(world_size=1)
