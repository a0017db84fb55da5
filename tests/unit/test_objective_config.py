"""Each objective owns a typed config section: the CLI parses the chosen one's fields and
refuses the others', and a user's own objective gets flags and help like the built-in ones."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from torch import nn

from temper.config import Config, ConfigError, ObjectiveConfig, load_config
from temper.models import build_model
from temper.objectives import (
    CausalLM,
    CausalLMConfig,
    DPOConfig,
    GRPOConfig,
    build_objective,
    register_objective,
)

MODULE, RECIPE = "temper.recipes.llama3", "llama3_debug"


class Scaled(CausalLM):
    """Next-token loss times a factor: the user objective of these tests."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]):
        loss_sum, count, metrics = super().loss(model, batch)
        return self.scale * loss_sum, count, metrics


@register_objective
@dataclass
class ScaledConfig(ObjectiveConfig):
    name: str = "test_scaled"
    scale: float = 1.0
    """Factor on the summed next-token loss."""

    data_formats: ClassVar[tuple[str, ...]] = ("text",)

    def validate(self, config: Config) -> None:
        if self.scale <= 0:
            raise ConfigError(f"objective.scale must be > 0, got {self.scale}")

    def build(self, config: Config, build_reference: Callable[[], nn.Module]) -> Scaled:
        return Scaled(self.scale)


def test_the_default_objective_has_its_own_fields_and_refuses_others(capsys) -> None:
    config = load_config(MODULE, RECIPE, ["--objective.z_loss_weight", "1e-4"])
    assert config.objective == CausalLMConfig(z_loss_weight=1e-4)
    with pytest.raises(SystemExit):
        load_config(MODULE, RECIPE, ["--objective.beta", "0.5"])
    assert "--objective.beta" in capsys.readouterr().err


def test_objective_name_picks_the_section_whose_flags_parse() -> None:
    argv = ["--objective.name", "dpo", "--objective.beta", "0.5", "--data.format", "preference"]
    config = load_config(MODULE, RECIPE, argv)
    assert config.objective == DPOConfig(beta=0.5)
    grpo = load_config(
        MODULE,
        RECIPE,
        ["--objective.name=grpo", "--objective.group_size", "4", "--data.format", "prompt"],
    )
    assert grpo.objective == GRPOConfig(group_size=4)


def test_a_recipe_section_keeps_its_values_under_its_own_name() -> None:
    config = load_config("temper.recipes.posttrain", "dpo_debug", ["--objective.name", "dpo"])
    assert config.objective.beta == 1.0  # the recipe's, not DPOConfig's default 0.1


def test_help_lists_the_objectives_and_the_chosen_ones_fields(capsys) -> None:
    with pytest.raises(SystemExit):
        load_config(MODULE, RECIPE, ["--objective.name", "test_scaled", "--help"])
    out = capsys.readouterr().out
    assert "--objective.scale FLOAT" in out
    assert "Factor on the summed next-token loss." in out
    assert "causal_lm, dpo, grpo, test_scaled" in out
    assert "--objective.beta" not in out


def test_a_user_objective_parses_validates_and_builds() -> None:
    argv = ["--objective.name", "test_scaled", "--objective.scale", "2.0"]
    config = load_config(MODULE, RECIPE, argv)
    objective = build_objective(config, build_reference=lambda: pytest.fail("no reference"))
    assert isinstance(objective, Scaled) and objective.scale == 2.0
    with pytest.raises(ConfigError, match=r"objective.scale must be > 0, got -1.0"):
        load_config(MODULE, RECIPE, ["--objective.name", "test_scaled", "--objective.scale", "-1"])


def test_each_objective_states_the_data_it_reads() -> None:
    with pytest.raises(ConfigError, match="objective.name 'test_scaled' does not read data.format"):
        load_config(MODULE, RECIPE, ["--objective.name", "test_scaled", "--data.format", "sft"])
    with pytest.raises(ConfigError, match="'causal_lm' does not read data.format 'preference'"):
        load_config(MODULE, RECIPE, ["--data.format", "preference"])


def test_a_section_of_another_objective_is_refused() -> None:
    with pytest.raises(ConfigError, match="objective.name 'dpo' takes a DPOConfig section"):
        Config(objective=CausalLMConfig(name="dpo")).validate(1)
    with pytest.raises(ConfigError, match="objective.name 'nope' is not registered"):
        load_config(MODULE, RECIPE, ["--objective.name", "nope"])


def test_z_loss_weight_reaches_the_loss() -> None:
    """The section's weight adds weight * sum of logsumexp(logits)^2 over the labelled tokens
    to the loss the built objective computes, and logs its mean as z_loss."""
    config = Config(objective=CausalLMConfig(z_loss_weight=0.25))
    objective = build_objective(config, build_reference=lambda: pytest.fail("no reference"))
    plain = build_objective(Config(), build_reference=lambda: pytest.fail("no reference"))
    torch.manual_seed(0)
    model = build_model("llama3", "debug", device="cpu")
    ids = torch.randint(0, 600, (2, 9))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    with torch.no_grad():
        with_z, count, metrics = objective.loss(model, batch)
        without, _, _ = plain.loss(model, batch)
        lse = model(batch["input_ids"]).float().logsumexp(-1)
    torch.testing.assert_close(with_z - without, 0.25 * lse.pow(2).sum(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(metrics["z_loss"], lse.pow(2).sum() / count, rtol=1e-5, atol=0)
