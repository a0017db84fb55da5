"""The rollout engines' parts that need no vLLM: the refusals named before any training step,
the streamed weight files, vLLM's answers laid out as ``generate``'s, validation answering
with the run's rollout engine."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from temper.config import Config, ConfigError
from temper.generation.decoding import Generation, generate
from temper.generation.engines import RolloutEngine, SamplingParams
from temper.generation.engines.vllm import as_generation, served_weights
from temper.generation.engines.vllm_client import Completion
from temper.generation.engines.vllm_server import (
    ManagedServer,
    ServerSettings,
    VLLMStartupError,
    check_environment,
    find_python,
)
from temper.generation.engines.weights import write_weights
from temper.recipes.posttrain import grpo_debug
from temper.trainer import Trainer


def _fake_python(folder: Path, answer: str) -> str:
    """An 'interpreter' that answers the environment probe with ``answer``."""
    path = folder / "python"
    path.write_text(f"#!/bin/sh\necho '{answer}'\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_a_missing_interpreter_names_the_setup_script(tmp_path: Path) -> None:
    with pytest.raises(VLLMStartupError, match="rollout.vllm_python.*setup_vllm.sh"):
        find_python(str(tmp_path / "nope" / "python"))


@pytest.mark.parametrize("cpu", [True, False], ids=["cpu", "cuda"])
def test_the_server_environment_turns_on_what_temper_calls(tmp_path: Path, cpu: bool) -> None:
    """The development endpoints always; on CPU the model runner in the engine's process
    (one Python process fewer to start), unless the user's environment says otherwise."""
    settings = ServerSettings(
        python="python", model=str(tmp_path), dtype="float32", max_model_len=64,
        kv_cache_bytes=2**28, log=tmp_path / "vllm.log", startup_timeout_s=1, port=1, cpu=cpu,
    )  # fmt: skip
    server = ManagedServer(settings)
    env = server.environment({"PATH": "/bin", "VLLM_SERVER_DEV_MODE": "0"})
    assert env["PATH"] == "/bin" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == ("0" if cpu else None)
    mine = server.environment({"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    assert mine["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


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


class RecordingEngine:
    """A rollout engine that hands each call to ``inner`` and keeps what it was asked."""

    def __init__(self, inner: RolloutEngine) -> None:
        self.inner = inner
        self.calls: list[tuple[list[list[int]], SamplingParams, Generation]] = []

    def generate(self, prompts, params, generator=None) -> Generation:  # noqa: ANN001
        out = self.inner.generate(prompts, params, generator)
        self.calls.append(([list(p) for p in prompts], params, out))
        return out

    def update_weights(self, weights) -> None:  # noqa: ANN001
        self.inner.update_weights(weights)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.slow  # a short GRPO run (about 20 s)
def test_validation_answers_with_the_runs_rollout_engine(tmp_path: Path) -> None:
    """An RL run's held-out answers come from its rollout engine (vLLM's in a vllm run; the
    integration module checks that one): here the native one, whose greedy tokens must be
    the model's own decoding of the held-out prompts after the last update."""
    config = grpo_debug()
    config.job.dump_folder = str(tmp_path)
    config.checkpoint.initial_recipe = None
    config.metrics.tensorboard = False
    config.training.steps, config.training.seq_len = 1, 32
    config.training.local_batch_size = config.training.global_batch_size = 1
    config.objective.group_size, config.objective.max_new_tokens = 2, 4
    config.validation.interval, config.validation.generate = 1, 3
    config.validation.max_new_tokens = 6
    trainer = Trainer(config)
    assert trainer.driver is not None and trainer.validation is not None
    assert trainer.validation.sampler is trainer.driver.sampler
    recorder = RecordingEngine(trainer.driver.sampler)
    trainer.validation.sampler = recorder
    assert trainer.train()
    assert len(recorder.calls) == 1  # one validation, after the one step
    prompts, params, got = recorder.calls[0]
    assert prompts == [ids for ids, _ in trainer.validation.prompts]
    assert params.temperature == 0.0 and params.max_new_tokens == 6
    assert params.stop_tokens == frozenset(trainer.validation.stop_tokens)
    want = generate(
        trainer.engine.model.eval(), prompts, 6, stop_tokens=trainer.validation.stop_tokens
    )
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.lengths, want.lengths)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "val_exact_match" in rows[-1]
