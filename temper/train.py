"""Entry point: `python -m temper.train --module M --config C [--section.field value ...]`.

`run_train.sh` launches this under torchrun. Everything after the two recipe
options is a typed override of the recipe's config (see `--help`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import temper.components  # noqa: F401  (every built-in config rule and objective)
from temper.config import Config, ConfigError, load_config
from temper.config.loading import short_help

NOTHING_TO_DO = 3
"""``--check_only``'s exit code for a run already complete: run_train.sh launches nothing."""
CHECKED = "the data, tokenizer, chat template, model folder and checkpoints"

DEFAULT_MODULE = "temper.recipes.llama3"
DEFAULT_CONFIG = "llama3_debug"

USAGE = f"""\
usage: MODULE=<module> CONFIG=<function> NGPU=<n> ./run_train.sh [--section.field value ...]

  MODULE  the Python module of the recipe (default {DEFAULT_MODULE}); --module here
  CONFIG  the recipe: a function in MODULE returning a Config (default {DEFAULT_CONFIG});
          --config here
  NGPU    processes per node, one per GPU (default 1); NNODES=<n> MASTER_ADDR=<host> for
          several nodes
  MAX_RESTARTS  restart the group up to n times when a rank dies; each restart resumes
          from the newest complete checkpoint (default 0)
  ./run_train.sh --list   the built-in recipes and model families
  ./run_train.sh --help_all   every field of every section, with its type and default
"""


def catalog() -> str:
    """The built-in recipes (MODULE and CONFIG, each with its docstring's first line) and
    the model families with their flavors."""
    import importlib
    import inspect

    from temper.config.loading import builtin_recipe_modules, recipe_names
    from temper.models.registry import all_model_specs

    lines = ["Recipes (MODULE=<module> CONFIG=<function> ./run_train.sh):"]
    wrap = textwrap.TextWrapper(width=88, initial_indent=" " * 6, subsequent_indent=" " * 6)
    for module in builtin_recipe_modules():
        lines.append(f"  {module}")
        mod = importlib.import_module(module)
        # Each recipe once, under the module that defines it (not where it is re-exported).
        for name in recipe_names(mod):
            recipe = getattr(mod, name)
            if recipe.__module__ == module:
                lines.append(f"    {name}")
                lines.extend(wrap.wrap(_first_sentence(inspect.getdoc(recipe))))
    lines.append("Model families (--model.name, --model.flavor; or --model.hf_path FOLDER):")
    for spec in sorted(all_model_specs(), key=lambda spec: spec.name):
        lines.append(f"  {spec.name:<12} {', '.join(spec.flavors)}")
    return "\n".join(lines)


def _first_sentence(doc: str | None) -> str:
    paragraph = " ".join((doc or "").split("\n\n")[0].split())
    return paragraph.split(". ")[0].removesuffix(".") + "."


def announce_restart(config: Config, restart: int) -> None:
    """torchrun restarted the group after a rank died (``MAX_RESTARTS``): continue from the
    newest complete checkpoint, whatever ``checkpoint.resume`` said for the first launch."""
    config.checkpoint.resume = "auto"
    if os.environ.get("RANK", "0") != "0":
        return
    if config.checkpoint.enable:
        what = "resuming from the newest complete checkpoint"
    else:
        what = "checkpoint.enable is off, so training starts again from step 0"
    print(f"temper: restart {restart} after a rank failed: {what}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--module", default=DEFAULT_MODULE)
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument(
        "--list", action="store_true", help="list the built-in recipes and model families"
    )
    parser.add_argument(
        "--dry_run",
        action="store_true",
        help="plan the run for WORLD_SIZE ranks (run_train.sh: NNODES x NGPU; or --world_size N) "
        "in this one process: per-rank memory, communication and every config error; then exit "
        "(python -m temper.plan)",
    )
    parser.add_argument(
        "--check_only",
        action="store_true",
        help="validate the config and every input a run reads (data, tokenizer, chat "
        "template, LoRA targets, checkpoint, run folder), print the config, and exit "
        "(run_train.sh's pre-flight before torchrun); exit 3 when the run is already complete",
    )
    parser.add_argument(
        "--preflight",
        action="store_true",
        help="run the pre-flight checks in this process, then train (run_train.sh's "
        "one-process launch: one interpreter, one import of everything)",
    )
    args = sys.argv[1:] if argv is None else list(argv)
    known, overrides = parser.parse_known_args(args)
    if known.dry_run:
        from temper.plan import main as plan

        return plan(args)
    if known.list:
        print(catalog())
        return 0
    try:
        if "-h" in overrides or "--help" in overrides:
            print(USAGE)
            print(short_help(known.module, known.config, overrides))
            return 0
        if "--help_all" in overrides:
            print(USAGE)
            overrides = ["--help" if arg == "--help_all" else arg for arg in overrides]
        config = load_config(known.module, known.config, overrides)
        if known.check_only or known.preflight:
            from temper.trainer.console import complete_line, finished_step

            finished = finished_step(config)
            if finished is not None:  # answered before the Engine is imported or input read
                root = Path(config.job.dump_folder) / config.checkpoint.folder
                print(complete_line(finished, root), file=sys.stderr)
                return NOTHING_TO_DO if known.check_only else 0
            from temper.trainer.preflight import preflight

            if known.preflight:  # --check_only keeps stderr to the one line of a refusal
                print(f"temper: checking {CHECKED}", flush=True)
            preflight(config)
    except ConfigError as err:
        print(f"temper: config error: {err}", file=sys.stderr)
        return 2
    if known.check_only:
        print(json.dumps(config.to_dict(), indent=2))
        return 0

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart:
        announce_restart(config, restart)

    from temper.checkpoint.manager import DiskFull
    from temper.data.sources.base import RecordError
    from temper.models.safetensors_io import WeightError
    from temper.trainer import Trainer
    from temper.utils.device import shutdown_runtime

    try:
        trainer = Trainer(config)
        finished = trainer.train()
    except KeyboardInterrupt:  # a second Ctrl-C: stop now, without a traceback per rank
        if os.environ.get("RANK", "0") == "0":
            print("temper: interrupted", file=sys.stderr)
        return 130
    except ConfigError as err:
        # Every rank meets the same bad input; one line says it.
        if os.environ.get("RANK", "0") == "0":
            print(f"temper: config error: {err}", file=sys.stderr)
        return 2
    except (RecordError, WeightError) as err:
        # A record past the pre-flight's sample, a weight's values: only the rank that read
        # it knows, so that rank says it, in one line.
        kind = "data" if isinstance(err, RecordError) else "model"
        print(f"temper: {kind} error: {err}", file=sys.stderr)
        return 2
    except DiskFull as err:
        # The step's metrics are written and the last good checkpoint kept: one line says so.
        if os.environ.get("RANK", "0") == "0":
            print(f"temper: {err}", file=sys.stderr)
        return 1
    finally:
        shutdown_runtime()
    return 0 if finished else trainer.stop.exit_code  # 130 on Ctrl-C, 143 on SIGTERM


if __name__ == "__main__":
    sys.exit(main())
