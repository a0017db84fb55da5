"""Recipe loading: import a module, call its recipe function, apply typed CLI overrides."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import os
import sys
import textwrap
import typing
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import tyro

from temper.config.config import (
    Config,
    ConfigError,
    objective_config_names,
    objective_config_type,
)

OBJECTIVE_FLAG = "--objective.name"


def load_config(
    module: str, function: str, argv: Sequence[str] = (), *, validate: bool = True
) -> Config:
    """Build the run's Config: `module.function()` with `argv` overrides, validated (unless
    ``validate`` is False: a dry run lists every error itself).

    The recipe's result is the default of every flag, so `--help` shows the recipe's
    values. Sections that a recipe replaced by a subclass (a `Training` with an extra
    knob, say) are parsed as that subclass, so their extra fields get flags too.
    """
    recipe = _find_recipe(_import_recipe_module(module), module, function)
    config = _call_recipe(recipe, module, function)
    _select_objective(config, argv)
    cli_type = _runtime_typed(type(config), config)
    default = cli_type(**_sections(config))
    if "-h" in argv or "--help" in argv:  # tyro prints the tree and exits
        cli_type, default = _help_typed(cli_type, config)
    description = inspect.getdoc(recipe) or f"Recipe {module}.{function}"
    parsed = tyro.cli(
        cli_type,
        default=default,
        args=list(argv),
        prog=f"{module}:{function}",
        description=f"{description}\n\n{_objectives_help(config)}",
        use_underscores=True,
    )
    config = type(config)(**_sections(parsed))
    if validate:
        config.validate()
    return config


def _call_recipe(recipe, module: str, function: str) -> Config:
    config = recipe()
    if not isinstance(config, Config):
        raise ConfigError(
            f"recipe {module}.{function} returned {type(config).__name__}, not a temper Config"
        )
    return config


# The flags a first run most often sets; `--help` shows these, `--help_all` every field.
COMMON_FLAGS = (
    "model.hf_path",
    "data.path",
    "data.format",
    "data.tokenizer_path",
    "objective.name",
    "training.steps",
    "training.seq_len",
    "training.global_batch_size",
    "optimizer.lr",
    "lora.enable",
    "checkpoint.enable",
    "checkpoint.interval",
    "checkpoint.hf_export",
    "job.dump_folder",
)


def short_help(module: str, function: str, argv: Sequence[str] = (), width: int = 88) -> str:
    """``--help``: the recipe's sections and the common flags with the recipe's values, each
    help text wrapped to ``width`` columns (the full tree is ``--help_all``)."""
    recipe = _find_recipe(_import_recipe_module(module), module, function)
    config = _call_recipe(recipe, module, function)
    _select_objective(config, argv)
    wrap = textwrap.TextWrapper(width=width, initial_indent="  ", subsequent_indent="  ")
    lines = [f"{module}:{function}", *wrap.wrap(inspect.getdoc(recipe) or ""), ""]
    lines.append("Sections (--<section>.<field>; `--help_all` lists every field):")
    lines.extend(wrap.wrap(", ".join(_sections(config))))
    lines.append("")
    lines.append("Common flags (the recipe's value):")
    flag_wrap = textwrap.TextWrapper(width=width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    for name in COMMON_FLAGS:
        section_name, _, field_name = name.partition(".")
        section = getattr(config, section_name)
        lines.append(f"  --{name} {getattr(section, field_name)}")
        lines.extend(flag_wrap.wrap(_field_doc(type(section), field_name)))
    names = ", ".join(objective_config_names())
    objectives = (
        f"Objectives: {names} (this recipe: {config.objective.name}); "
        f"`{OBJECTIVE_FLAG} NAME --help_all` lists NAME's fields."
    )
    lines.extend(["", *textwrap.wrap(objectives, width=width)])
    return "\n".join(lines)


def _help_typed(config_type: type[Config], config: Config) -> tuple[type[Config], Config]:
    """``config_type`` and its instance for ``--help`` alone, each section field's help given
    on one line: tyro keeps the line breaks of an indented docstring's continuation lines,
    and wrapped each line of them apart (ragged help)."""
    sections = {name: _with_flat_help(section) for name, section in _sections(config).items()}
    fields = [(name, type(s), dataclasses.field(default=None)) for name, s in sections.items()]
    help_type = dataclasses.make_dataclass(config_type.__name__, fields, bases=(config_type,))
    return help_type, help_type(**sections)


def _with_flat_help(section: object) -> object:
    """``section`` as an instance of a subclass whose fields carry their help on one line;
    nested sections (``quantize.float8``) alike."""
    cls = type(section)
    hints = typing.get_type_hints(cls, include_extras=True)
    values = {f.name: getattr(section, f.name) for f in dataclasses.fields(cls)}
    fields = []
    for name, value in values.items():
        hint = hints[name]
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            values[name] = _with_flat_help(value)
            hint = type(values[name])
        text = _field_doc(cls, name) or None
        fields.append((name, typing.Annotated[hint, tyro.conf.arg(help=text)], None))
    fields = [(name, hint, dataclasses.field(default=None)) for name, hint, _ in fields]
    help_cls = dataclasses.make_dataclass(cls.__name__, fields, bases=(cls,))
    return help_cls(**values)


def _field_doc(cls: type, name: str) -> str:
    """The string under ``name``'s annotation in ``cls`` or a base (its help text), on one
    line."""
    for klass in cls.__mro__:
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):  # a class made at runtime: its bases hold the text
            continue
        body = ast.parse(textwrap.dedent(source)).body[0].body
        for node, after in zip(body, body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and node.target.id == name
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
            ):
                return " ".join(str(after.value.value).split())
    return ""


def _select_objective(config: Config, argv: Sequence[str]) -> None:
    """Give the config the section type of the objective ``--objective.name`` names (else the
    recipe's), so that tyro parses that objective's own fields and refuses the others'.
    A recipe's section of the same objective keeps its values; another objective starts from
    its defaults."""
    name = _flag_value(argv, OBJECTIVE_FLAG) or config.objective.name
    wanted = objective_config_type(name)
    if not isinstance(config.objective, wanted):
        config.objective = wanted()


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The last value given to ``flag`` (``--flag v`` or ``--flag=v``), or None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.partition("=")[2]
    return value


def _objectives_help(config: Config) -> str:
    names = ", ".join(objective_config_names())
    return (
        f"Objectives: {names}. The --objective.* flags below are {config.objective.name}'s; "
        f"`{OBJECTIVE_FLAG} NAME --help_all` lists another's."
    )


def save_config(config: Config, folder: str | os.PathLike[str]) -> Path:
    """Write the resolved config as JSON into the run folder and return its path."""
    path = Path(folder) / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    return path


def _import_recipe_module(module: str) -> ModuleType:
    _refuse_file_path(module)
    # A user's recipe module usually sits in the folder they launch from.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is not None and module.startswith(err.name):
            raise ConfigError(
                f"recipe module {module!r} not found (MODULE / --module); built-in recipe "
                f"modules: {', '.join(builtin_recipe_modules())}"
            ) from err
        raise


def _refuse_file_path(module: str) -> None:
    """MODULE is imported, not run: a file path (``my_recipes.py``, ``./recipes/my.py``) gets
    the module name to type instead."""
    path = Path(module)
    if path.suffix != ".py" and "/" not in module and os.sep not in module:
        return
    stem, folder = path.stem, path.parent
    if str(folder) == ".":
        instead = f"MODULE={stem}, run from the folder that holds {path.name}"
    else:
        instead = f"MODULE={stem}, run from {folder}"
        if not path.is_absolute() and ".." not in folder.parts:
            instead = f"MODULE={'.'.join((*folder.parts, stem))} from here, or {instead}"
    raise ConfigError(
        f"recipe module {module!r} (MODULE / --module) is a file path, not a module name; "
        f"type {instead}"
    )


def _find_recipe(mod: ModuleType, module: str, function: str):
    recipe = getattr(mod, function, None)
    if not callable(recipe):
        choices = recipe_names(mod)
        raise ConfigError(
            f"module {module!r} has no recipe function {function!r} (CONFIG / --config); "
            f"recipes there: {', '.join(choices) or 'none'}"
        )
    return recipe


def recipe_names(mod: ModuleType) -> list[str]:
    """Public zero-argument functions of a module whose return annotation is a Config."""
    names = []
    for name, obj in vars(mod).items():
        if name.startswith("_") or not inspect.isfunction(obj):
            continue
        hints = inspect.get_annotations(obj, eval_str=False).get("return")
        if hints in (Config, "Config") or (isinstance(hints, type) and issubclass(hints, Config)):
            names.append(name)
    return sorted(names)


def builtin_recipe_modules() -> list[str]:
    folder = Path(__file__).resolve().parent.parent / "recipes"
    return sorted(
        f"temper.recipes.{p.stem}" for p in folder.glob("*.py") if not p.stem.startswith("_")
    )


def _sections(config: Config) -> dict[str, object]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def _runtime_typed(config_type: type[Config], config: Config) -> type[Config]:
    """A subclass of the config type whose section annotations are the runtime types."""
    declared = typing.get_type_hints(config_type)
    overrides = [
        (name, type(section), dataclasses.field(default_factory=type(section)))
        for name, section in _sections(config).items()
        if type(section) is not declared[name]
    ]
    if not overrides:
        return config_type
    return dataclasses.make_dataclass(config_type.__name__, overrides, bases=(config_type,))
