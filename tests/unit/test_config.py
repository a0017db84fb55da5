"""Recipe loading, typed overrides and every config error."""

from __future__ import annotations

import json
import math
import textwrap

import pytest

from temper.config import (
    Config,
    ConfigError,
    DataSource,
    Training,
    load_config,
    save_config,
)
from temper.parallel.dims import ParallelDims
from temper.recipes.llama3 import llama3_debug

MODULE, RECIPE = "temper.recipes.llama3", "llama3_debug"


def test_recipe_values_are_the_defaults() -> None:
    assert load_config(MODULE, RECIPE, []) == llama3_debug()


def test_overrides_are_typed_and_applied() -> None:
    config = load_config(
        MODULE,
        RECIPE,
        ["--training.steps", "20", "--optimizer.lr", "1e-3", "--lr_scheduler.decay", "wsd"],
    )
    expected = llama3_debug()
    expected.training.steps = 20
    expected.optimizer.lr = 1e-3
    expected.lr_scheduler.decay = "wsd"
    assert config == expected
    assert isinstance(config.training.steps, int)


def test_bool_flag_and_optional_string() -> None:
    config = load_config(
        MODULE, RECIPE, ["--training.deterministic", "--data.path", "corpus.jsonl"]
    )
    assert config.training.deterministic is True
    assert config.data.path == "corpus.jsonl"


def test_unknown_flag_exits_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        load_config(MODULE, RECIPE, ["--training.stepz", "3"])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert "--training.stepz" in err
    assert "--training.steps" in err  # the closest valid choice is suggested


def test_wrong_type_exits_naming_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        load_config(MODULE, RECIPE, ["--training.steps", "many"])
    assert exit_info.value.code != 0
    assert "training.steps" in capsys.readouterr().err


def test_wrong_choice_lists_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load_config(MODULE, RECIPE, ["--lr_scheduler.decay", "exponential"])
    err = capsys.readouterr().err
    assert "cosine" in err and "wsd" in err


def test_missing_module_lists_builtin_modules() -> None:
    with pytest.raises(ConfigError, match=r"'no_such_recipes' not found.*temper\.recipes\.llama3"):
        load_config("no_such_recipes", RECIPE, [])


def test_missing_function_lists_recipes() -> None:
    with pytest.raises(ConfigError, match=r"no recipe function 'llama3_huge'.*llama3_debug"):
        load_config(MODULE, "llama3_huge", [])


def test_error_inside_a_recipe_module_is_not_hidden(tmp_path, monkeypatch) -> None:
    (tmp_path / "broken_recipes.py").write_text("import module_that_does_not_exist\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModuleNotFoundError, match="module_that_does_not_exist"):
        load_config("broken_recipes", "anything", [])


def test_recipe_must_return_a_config(tmp_path, monkeypatch) -> None:
    (tmp_path / "odd_recipes.py").write_text("def run():\n    return {'steps': 3}\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="returned dict, not a temper Config"):
        load_config("odd_recipes", "run", [])


USER_MODULE = textwrap.dedent(
    """
    from dataclasses import dataclass

    from temper.config import Config, Training
    from temper.recipes.llama3 import llama3_debug


    @dataclass
    class MyTraining(Training):
        label_noise: float = 0.05
        \"\"\"Fraction of labels to corrupt.\"\"\"


    def my_run() -> Config:
        config = llama3_debug()
        config.training = MyTraining(steps=7, seq_len=64)
        return config
    """
)


def test_user_module_with_a_subclassed_section(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "user_recipes_a.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    config = load_config("user_recipes_a", "my_run", ["--training.label_noise", "0.2"])
    assert type(config.training).__name__ == "MyTraining"
    assert config.training.label_noise == 0.2
    assert (config.training.steps, config.training.seq_len) == (7, 64)
    with pytest.raises(SystemExit) as exit_info:
        load_config("user_recipes_a", "my_run", ["--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert "--training.label_noise" in help_text
    assert "Fraction of labels to corrupt" in help_text


def test_help_groups_fields_with_types_and_defaults(capsys) -> None:
    with pytest.raises(SystemExit):
        load_config(MODULE, RECIPE, ["--help"])
    out = capsys.readouterr().out
    for section in ("job", "model", "training", "optimizer", "lr_scheduler", "data", "metrics"):
        assert f"{section} options" in out
    assert "--training.local_batch_size INT" in out
    assert "(default: 60)" in out  # the recipe's steps, not the dataclass default


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("training.steps", 0, "training.steps must be > 0"),
        ("optimizer.lr", -1.0, "optimizer.lr must be > 0"),
        ("optimizer.beta2", 1.0, r"optimizer.beta2 must be in \[0.0, 1.0\)"),
        ("lr_scheduler.min_lr_ratio", 1.5, "lr_scheduler.min_lr_ratio must be in"),
        ("lr_scheduler.warmup_steps", -1, "lr_scheduler.warmup_steps must be >= 0"),
        ("training.max_norm", -1.0, "training.max_norm must be >= 0"),
        ("metrics.log_freq", 0, "metrics.log_freq must be > 0"),
        ("model.flavor", "9b", "model.flavor '9b' is not a flavor of llama3; choose one of"),
        ("model.name", "gpt2", "model.name 'gpt2' is not a registered model"),
        ("parallelism.dp_shard", 0, "parallelism.dp_shard must be -1 or >= 1"),
        ("parallelism.dp_replicate", 3, r"world size 1 is not divisible .* \(3 x 1 x 1\)"),
        ("parallelism.dp_replicate", 0, "parallelism.dp_replicate must be >= 1, got 0"),
    ],
)
def test_validate_names_the_field(field: str, value: object, message: str) -> None:
    config = llama3_debug()
    section, name = field.split(".")
    setattr(getattr(config, section), name, value)
    with pytest.raises(ConfigError, match=message):
        config.validate(world_size=1)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--checkpoint.resume", "latest"], "checkpoint.resume must be auto, never or a step"),
        (["--checkpoint.keep_latest_k", "-1"], "checkpoint.keep_latest_k must be >= 0"),
        (["--checkpoint.initial_load", "/nowhere"], "'/nowhere' is not a temper checkpoint"),
    ],
)
def test_checkpoint_fields_are_checked(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(MODULE, RECIPE, flags)


def test_hf_path_without_a_config_is_named(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"model.hf_path: .*config.json: HF model config not"):
        load_config(MODULE, RECIPE, ["--model.hf_path", str(tmp_path)])


def test_validation_runs_on_cli_values() -> None:
    with pytest.raises(ConfigError, match="training.steps must be > 0"):
        load_config(MODULE, RECIPE, ["--training.steps", "0"])


def test_global_batch_and_accumulation() -> None:
    config = Config(training=Training(local_batch_size=4, global_batch_size=32))
    config.validate(world_size=2)
    dims = ParallelDims.from_config(config.parallelism, 2)
    assert dims.dp == 2
    assert dims.grad_accum_steps(config.training) == 4  # 32 / (4 x 2)
    config.training.global_batch_size = -1
    assert dims.grad_accum_steps(config.training) == 1
    config.training.global_batch_size = 12
    with pytest.raises(ConfigError, match=r"global_batch_size \(12\).*\(4 x 2 = 8\)"):
        config.validate(world_size=2)


def test_sp_and_ep_are_not_data_parallel() -> None:
    config = Config()
    config.parallelism.sp = 2
    config.parallelism.ep = 4
    assert ParallelDims.from_config(config.parallelism, 8).dp == 4
    config.parallelism.dp_shard = 3
    with pytest.raises(ConfigError, match="1 x 3 x 1 x 2 does not equal the world size 8"):
        ParallelDims.from_config(config.parallelism, 8)


def test_sp_checks_heads_and_sequence_length() -> None:
    config = Config()  # llama3 debug: 8 heads, 4 KV heads
    config.parallelism.sp = 2
    config.validate(world_size=2)
    config.parallelism.sp = 8  # KV heads are replicated over SP ranks
    config.validate(world_size=8)
    config.parallelism.sp = 3
    with pytest.raises(ConfigError, match=r"parallelism.sp \(3\) must divide .* heads \(8\)"):
        config.validate(world_size=3)
    config.parallelism.sp = 2
    config.training.seq_len = 1
    with pytest.raises(ConfigError, match=r"training.seq_len \(1\) must be at least"):
        config.validate(world_size=2)


def test_ep_checks_experts_and_the_fsdp_group() -> None:
    from temper.recipes.qwen3 import qwen3_moe_debug

    config = qwen3_moe_debug()  # 8 experts
    config.parallelism.ep = 2
    config.validate(world_size=2)
    config.parallelism.ep = 8
    config.validate(world_size=8)
    config.parallelism.ep = 3
    with pytest.raises(ConfigError, match=r"parallelism.ep \(3\) must divide the number of exp"):
        config.validate(world_size=3)
    config.parallelism.ep = 4
    with pytest.raises(ConfigError, match=r"parallelism.ep \(4\) must divide .*\(2 x 1 x 1 = 2\)"):
        config.validate(world_size=2)
    config.parallelism.ep = 2
    config.compile.enable = True
    for mode in ("none", "full", "selective"):  # blocks compiled in parts around the dispatch
        config.activation_checkpoint.mode = mode
        config.validate(world_size=2)
    dense = Config()
    dense.parallelism.ep = 2
    with pytest.raises(ConfigError, match="ep = 2 needs a mixture-of-experts model"):
        dense.validate(world_size=2)


def test_new_sections_parse_and_default_off() -> None:
    config = load_config(
        MODULE,
        RECIPE,
        [
            "--activation_checkpoint.mode",
            "selective",
            "--compile.enable",
            "--parallelism.fsdp_reshard_after_forward",
            "never",
        ],
    )
    assert config.activation_checkpoint.mode == "selective"
    assert config.compile.enable is True
    assert config.parallelism.fsdp_reshard_after_forward == "never"
    assert Config().activation_checkpoint.mode == "none" and not Config().compile.enable
    with pytest.raises(SystemExit):
        load_config(MODULE, RECIPE, ["--activation_checkpoint.mode", "partial"])


def test_saved_config_is_the_resolved_one(tmp_path) -> None:
    config = load_config(MODULE, RECIPE, ["--training.seed", "9"])
    saved = json.loads(save_config(config, tmp_path).read_text())
    assert saved["training"]["seed"] == 9
    assert saved == config.to_dict()


@pytest.mark.parametrize(
    ("flags", "field", "value"),
    [
        (["--optimizer.lr", "nan"], "optimizer.lr", "nan"),
        (["--optimizer.eps", "inf"], "optimizer.eps", "inf"),
        (["--training.max_norm", "nan"], "training.max_norm", "nan"),
        (["--lr_scheduler.min_lr_ratio", "-inf"], "lr_scheduler.min_lr_ratio", "-inf"),
        (["--objective.name", "dpo", "--objective.beta", "inf"], "objective.beta", "inf"),
    ],
)
def test_non_finite_numbers_are_refused_by_field(flags: list[str], field: str, value: str) -> None:
    """NaN passes every range rule (``nan <= 0`` is False): each float is checked by name."""
    with pytest.raises(ConfigError) as error:
        load_config(MODULE, RECIPE, flags)
    assert str(error.value) == f"{field}: {value} is not a finite number"


def test_non_finite_numbers_in_lists_are_named_by_index() -> None:
    config = llama3_debug()
    config.data.sources = [DataSource("a.jsonl"), DataSource("b.jsonl", weight=math.nan)]
    with pytest.raises(ConfigError) as error:
        config.validate(world_size=1)
    assert str(error.value) == "data.sources.1.weight: nan is not a finite number"


@pytest.mark.parametrize(
    ("module", "instead"),
    [
        ("my_recipes.py", "MODULE=my_recipes, run from the folder that holds my_recipes.py"),
        (
            "./recipes/my_recipes.py",
            "MODULE=recipes.my_recipes from here, or MODULE=my_recipes, run from recipes",
        ),
        ("recipes/my.py", "MODULE=recipes.my from here, or MODULE=my, run from recipes"),
        ("/srv/recipes/my.py", "MODULE=my, run from /srv/recipes"),
    ],
)
def test_module_given_as_a_file_path_says_what_to_type(module: str, instead: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(module, "my_run", [])
    assert str(error.value) == (
        f"recipe module {module!r} (MODULE / --module) is a file path, not a module name; "
        f"type {instead}"
    )


def test_the_module_name_suggested_for_a_path_loads(tmp_path, monkeypatch) -> None:
    folder = tmp_path / "path_recipes"
    folder.mkdir()
    (folder / "my_path_run.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="type MODULE=path_recipes.my_path_run from here"):
        load_config("path_recipes/my_path_run.py", "my_run", [])
    assert load_config("path_recipes.my_path_run", "my_run", []).training.steps == 7
