"""Kernel choices belong to a run, not to the process: each Engine resolves its own and hands
them to its model, each objective built from a config carries that config's, and two runs in
one process each compute the way their own config says."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_kernels import _packed_batch, _tiny_moe

from temper.config import Config, Job, Kernels, Metrics, Model, Training
from temper.engine import Engine
from temper.kernels import dispatch
from temper.objectives import build_objective
from temper.objectives import causal_lm as causal_lm_module
from temper.objectives.causal_lm import label_log_probs
from temper.utils.device import Runtime

CPU = Runtime(device=torch.device("cpu"), rank=0, local_rank=0, world_size=1)


def _run_config(kernels: Kernels, folder: Path | None = None) -> Config:
    config = Config(kernels=kernels, metrics=Metrics(tensorboard=False))
    if folder is not None:
        config.job = Job(dump_folder=str(folder))
        config.model = Model(name="qwen3", flavor="debug")
        config.training = Training(steps=1, seq_len=16, local_batch_size=2)
    return config


def _recording(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the references that ``compile`` wraps from now on (recorded, not compiled)."""
    compiled: list[str] = []

    def record(fn: Callable[..., Any]) -> Callable[..., Any]:
        compiled.append(fn.__name__)
        return fn

    monkeypatch.setattr(dispatch, "compiled", record)
    return compiled


def test_two_engines_models_keep_their_own_kernels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """One Engine asks for the references, a later one compiles its layers' ops and asks for
    Triton RMSNorm, which falls back on CPU with its notice at start-up; each model's forward
    runs its own choices, whichever Engine was built last, and both give the same logits."""
    compiled = _recording(monkeypatch)
    plain = Engine(_run_config(Kernels(rmsnorm="reference"), tmp_path / "a"), CPU)
    assert capsys.readouterr().err == ""
    ops = dict.fromkeys(("swiglu", "rope"), "compile")
    fused = Engine(_run_config(Kernels(rmsnorm="triton", **ops), tmp_path / "b"), CPU)
    assert capsys.readouterr().err.strip() == (
        "temper: kernels.rmsnorm=triton cannot run (Triton kernels run on CUDA, this is cpu); "
        "using reference"
    )
    assert fused.kernels.rmsnorm == "reference" and fused.kernels.swiglu == "compile"
    fused.model.load_state_dict(plain.model.state_dict())

    ids = torch.randint(0, 600, (2, 9), generator=torch.Generator().manual_seed(0))
    logits, seen = [], []
    with torch.no_grad():
        for engine in (fused, plain, fused):
            compiled.clear()
            logits.append(engine.model(ids))
            seen.append(set(compiled))
    assert seen == [{"swiglu_linear_reference", "apply_rope_reference"}, set(), seen[0]]
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-6)
    assert capsys.readouterr().err == ""


def test_two_runs_objectives_keep_their_own_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    compiled = _recording(monkeypatch)
    fused: list[tuple[int, str | None]] = []
    chunked = causal_lm_module.linear_cross_entropy

    def spy(*args: Any) -> Any:
        fused.append((args[4], args[5]))  # chunk_tokens, impl
        return chunked(*args)

    monkeypatch.setattr(causal_lm_module, "linear_cross_entropy", spy)
    chunked_run = _run_config(Kernels(cross_entropy_chunk=7, cross_entropy="compile"))
    full_run = _run_config(Kernels(fused_cross_entropy=False))
    no_reference = lambda: pytest.fail("no reference")  # noqa: E731
    first = build_objective(chunked_run, no_reference)
    second = build_objective(full_run, no_reference)

    model, batch = _tiny_moe(), _packed_batch()
    losses = [objective.loss(model, batch)[0] for objective in (first, second, first)]
    assert fused == [(7, "compile"), (7, "compile")]  # only the first run's, both times
    assert compiled == ["log_probs_from_logits", "loss_and_grad_reference"] * 2
    assert losses[0] == losses[2]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=0)

    # The per-token log-probs that DPO and GRPO build on take a run's choices the same way.
    ids, labels = batch["input_ids"], batch["labels"]
    compiled.clear()
    with torch.no_grad():
        own = label_log_probs(model, ids, labels, kernels=chunked_run.kernels)
        assert compiled == ["log_probs_from_logits"]
        unconfigured = label_log_probs(model, ids, labels)
    assert compiled == ["log_probs_from_logits"]  # no kernels given: full logits
    torch.testing.assert_close(own, unconfigured, rtol=1e-5, atol=1e-6)


def test_deepseek_v4_blocks_run_the_models_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek V4's blocks read the model's choices from their forward context as the shared
    decoder's do: its norms, rotary, shared and routed SwiGLU and MoE permutes compile (here
    recorded) once the model is told so, with the same logits as its references."""
    from temper.models.deepseek_v4.args import FLAVORS
    from temper.models.deepseek_v4.model import DeepseekV4Transformer

    compiled = _recording(monkeypatch)
    torch.manual_seed(0)
    model = DeepseekV4Transformer(FLAVORS["debug"])
    model.init_weights()
    ids = torch.randint(0, 2048, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(ids)
        assert compiled == []
        ops = ("rmsnorm", "rope", "swiglu", "moe_permute")
        model.use_kernels(Kernels(**dict.fromkeys(ops, "compile")))
        fused = model(ids)
    names = {"rms_norm_reference", "apply_rope_reference", "swiglu_reference"}
    assert set(compiled) == names | {"permute_reference", "unpermute_reference"}
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)


def test_vision_tower_runs_the_models_rotary(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Qwen3.5 VLM's vision tower rotates q and k with the model's rotary choice, as its
    decoder does (it ran the reference whatever the run asked), with the same logits."""
    from temper.models.layers import vision
    from temper.models.qwen3_5_vl.args import FLAVORS
    from temper.models.qwen3_5_vl.model import Qwen3_5VLTransformer

    compiled = _recording(monkeypatch)
    tower_impls: list[str | None] = []
    real = vision.apply_rope

    def spy(*args: Any, impl: str | None = None) -> torch.Tensor:
        tower_impls.append(impl)
        return real(*args, impl=impl)

    monkeypatch.setattr(vision, "apply_rope", spy)
    torch.manual_seed(0)
    args = FLAVORS["debug"]
    model = Qwen3_5VLTransformer(args)
    model.init_weights()
    grid = torch.tensor([[1, 2, 2]])  # 4 patches, one image token after the 2 x 2 merge
    pixels = torch.randn(4, args.vision.in_channels * 2 * args.vision.patch_size**2)
    ids = torch.tensor([[5, 6, args.image_token_id, 7, 8]])
    with torch.no_grad():
        plain = model(ids, pixel_values=pixels, image_grid_thw=grid)
        assert compiled == [] and set(tower_impls) == {"reference"}
        tower_impls.clear()
        model.use_kernels(Kernels(rope="compile"))
        fused = model(ids, pixel_values=pixels, image_grid_thw=grid)
    assert set(tower_impls) == {"compile"} and "apply_rope_reference" in compiled
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
