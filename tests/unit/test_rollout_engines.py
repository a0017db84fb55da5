"""The rollout engines' parts that need no vLLM: the refusals named before any training step,
the streamed weight files, vLLM's answers laid out as ``generate``'s."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from temper.config import Config, ConfigError
from temper.generation.engines.vllm import as_generation, served_weights
from temper.generation.engines.vllm_client import Completion
from temper.generation.engines.vllm_server import (
    VLLMStartupError,
    check_environment,
    find_python,
)
from temper.generation.engines.weights import write_weights
from temper.recipes.posttrain import grpo_debug


def _fake_python(folder: Path, answer: str) -> str:
    """An 'interpreter' that answers the environment probe with ``answer``."""
    path = folder / "python"
    path.write_text(f"#!/bin/sh\necho '{answer}'\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_a_missing_interpreter_names_the_setup_script(tmp_path: Path) -> None:
    with pytest.raises(VLLMStartupError, match="rollout.vllm_python.*setup_vllm.sh"):
        find_python(str(tmp_path / "nope" / "python"))


def test_an_unknown_vllm_release_is_refused(tmp_path: Path) -> None:
    python = _fake_python(tmp_path, '["0.8.5", ["LlamaForCausalLM"]]')
    with pytest.raises(VLLMStartupError, match=r"vLLM 0\.8\.5; Temper supports 0\.32\.x"):
        check_environment(python, ["LlamaForCausalLM"])


def test_an_architecture_vllm_does_not_list_is_refused(tmp_path: Path) -> None:
    python = _fake_python(tmp_path, '["0.32.0", ["LlamaForCausalLM"]]')
    assert check_environment(python, ["LlamaForCausalLM"]) == "0.32.0"
    with pytest.raises(VLLMStartupError, match="cannot load Qwen3_5ForCausalLM"):
        check_environment(python, ["Qwen3_5ForCausalLM"])


def _grpo(**rollout: object) -> Config:
    config = grpo_debug()
    for name, value in rollout.items():
        setattr(config.rollout, name, value)
    return config


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(mode="async"), "rollout.mode async .* --rollout.engine vllm"),
        (dict(engine="vllm", mode="async"), "objective.tis_cap"),
        (dict(engine="vllm", staleness=2), "rollout.staleness must be 0 or 1"),
        (dict(url="http://127.0.0.1:1"), "need --rollout.engine vllm"),
    ],
)
def test_rollout_settings_are_checked(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _grpo(**change).validate(1)


def test_native_only_features_are_refused_with_vllm() -> None:
    config = _grpo(engine="vllm")
    config.objective.compile_rollouts = True
    with pytest.raises(ConfigError, match="compile_rollouts needs --rollout.engine native"):
        config.validate(1)


def test_rollout_settings_without_rollouts_are_refused() -> None:
    config = Config()
    config.rollout.engine = "vllm"
    with pytest.raises(ConfigError, match="samples none"):
        config.validate(1)


def test_weights_stream_into_bucketed_files(tmp_path: Path) -> None:
    tensors = [(f"w{i}", torch.full((256,), float(i))) for i in range(10)]  # 1 KiB each
    tied = [("model.embed_tokens.weight", torch.ones(4, 2)), ("x", torch.zeros(3))]
    stream = served_weights(lambda: iter(tensors + tied), tied=True)
    (tmp_path / "stale.safetensors").write_bytes(b"")  # an earlier push's file goes
    write_weights(tmp_path, stream(), bucket_bytes=3000)
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) == 4  # three tensors a file
    read = {}
    for file in files:
        read |= load_file(str(file))
    assert set(read) == {name for name, _ in tensors + tied} | {"lm_head.weight"}
    assert torch.equal(read["lm_head.weight"], read["model.embed_tokens.weight"])
    assert all(torch.equal(read[name], value) for name, value in tensors)


def test_answers_are_laid_out_as_generate_lays_them() -> None:
    answers = [
        Completion([5, 6], [-0.5, -0.25], "stop"),
        Completion([7, 8, 9], [-1.0] * 3, "length"),
    ]
    out = as_generation(answers, max_new_tokens=3)
    assert out.tokens.tolist() == [[5, 6, 0], [7, 8, 9]]
    assert out.lengths.tolist() == [2, 3]
    assert out.log_probs.tolist() == [[-0.5, -0.25, 0.0], [-1.0, -1.0, -1.0]]
    assert out.finish_reasons == ["stop", "length"]
