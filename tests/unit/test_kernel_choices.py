"""Kernel choices travel with the objective a run's config builds, not with the process: two
runs' objectives in one process each compute their loss the way their own config says,
whatever the process-wide choice (the last Engine's) is."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from test_kernels import _packed_batch, _tiny_moe

from temper.config import Config, Kernels
from temper.kernels import dispatch
from temper.kernels.dispatch import REFERENCE, configure_kernels
from temper.objectives import build_objective
from temper.objectives import causal_lm as causal_lm_module
from temper.objectives.causal_lm import label_log_probs


@pytest.fixture
def restore_kernels() -> Iterator[None]:
    yield
    configure_kernels(REFERENCE, torch.device("cpu"))


def _run_config(kernels: Kernels) -> Config:
    config = Config()
    config.kernels = kernels
    return config


def test_two_runs_kernel_choices_coexist_in_one_process(
    restore_kernels: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiled: list[str] = []

    def record(fn: Callable[..., Any]) -> Callable[..., Any]:  # "compile" without compiling
        compiled.append(fn.__name__)
        return fn

    fused: list[tuple[int, str | None]] = []
    chunked = causal_lm_module.linear_cross_entropy

    def spy(*args: Any) -> Any:
        fused.append((args[4], args[5]))  # chunk_tokens, impl
        return chunked(*args)

    monkeypatch.setattr(dispatch, "compiled", record)
    monkeypatch.setattr(causal_lm_module, "linear_cross_entropy", spy)
    chunked_run = _run_config(Kernels(cross_entropy_chunk=7, cross_entropy="compile"))
    full_run = _run_config(Kernels(fused_cross_entropy=False))
    no_reference = lambda: pytest.fail("no reference")  # noqa: E731
    first = build_objective(chunked_run, no_reference)
    second = build_objective(full_run, no_reference)
    configure_kernels(full_run.kernels, torch.device("cpu"))  # the later run's Engine's

    model, batch = _tiny_moe(), _packed_batch()
    losses = [objective.loss(model, batch)[0] for objective in (first, second, first)]
    assert fused == [(7, "compile"), (7, "compile")]  # only the first run's, both times
    assert compiled == ["log_probs_from_logits", "logits_grad_reference"] * 2
    assert losses[0] == losses[2]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=0)

    # The per-token log-probs that DPO and GRPO build on take a run's choices the same way.
    ids, labels = batch["input_ids"], batch["labels"]
    compiled.clear()
    with torch.no_grad():
        own = label_log_probs(model, ids, labels, kernels=chunked_run.kernels)
        assert compiled == ["log_probs_from_logits"]
        process_wide = label_log_probs(model, ids, labels)
    assert compiled == ["log_probs_from_logits"]  # the process-wide choice: full logits
    torch.testing.assert_close(own, process_wide, rtol=1e-5, atol=1e-6)
