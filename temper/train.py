"""Entry point: `python -m temper.train --module M --config C [--section.field value ...]`.

`run_train.sh` launches this under torchrun. Everything after the two recipe
options is a typed override of the recipe's config (see `--help`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import temper.engine  # noqa: F401  (registers every built-in config rule and objective)
from temper.config import ConfigError, load_config

DEFAULT_MODULE = "temper.recipes.llama3"
DEFAULT_CONFIG = "llama3_debug"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--module", default=DEFAULT_MODULE)
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument(
        "--check_only",
        action="store_true",
        help="validate the config and every input a run reads (data, tokenizer, chat "
        "template, LoRA targets, checkpoint, run folder), print the config, and exit "
        "(run_train.sh's pre-flight)",
    )
    known, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        config = load_config(known.module, known.config, overrides)
        if known.check_only:
            from temper.trainer.preflight import preflight

            preflight(config)
    except ConfigError as err:
        print(f"temper: config error: {err}", file=sys.stderr)
        return 2
    if known.check_only:
        print(json.dumps(config.to_dict(), indent=2))
        return 0

    from temper.trainer import Trainer
    from temper.utils.device import shutdown_runtime

    try:
        finished = Trainer(config).train()
    except KeyboardInterrupt:  # a second Ctrl-C: stop now, without a traceback per rank
        if os.environ.get("RANK", "0") == "0":
            print("temper: interrupted", file=sys.stderr)
        return 130
    except ConfigError as err:
        # Every rank meets the same bad input; one line says it.
        if os.environ.get("RANK", "0") == "0":
            print(f"temper: config error: {err}", file=sys.stderr)
        return 2
    finally:
        shutdown_runtime()
    return 0 if finished else 130


if __name__ == "__main__":
    sys.exit(main())
