"""Dry runs: a recipe's real parallel layout at a target world size, laid out in one process
(torch's fake process group), with each rank's memory, the step's communication and every
config error the run would hit; ``python -m temper.plan`` or ``./run_train.sh --dry_run``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from temper.plan.planner import EP_IMBALANCE, Plan, plan_run
from temper.plan.report import format_plan


def main(argv: Sequence[str] | None = None) -> int:
    import temper.engine  # noqa: F401  (registers every built-in config rule and objective)
    from temper.config import ConfigError, load_config

    parser = argparse.ArgumentParser(
        prog="python -m temper.plan", description=__doc__.splitlines()[0], add_help=False
    )
    parser.add_argument("--module", default="temper.recipes.llama3")
    parser.add_argument("--config", default="llama3_debug")
    parser.add_argument(
        "--world_size",
        type=int,
        default=int(os.environ.get("WORLD_SIZE", "1")),
        help="ranks to plan for (default: WORLD_SIZE, else 1)",
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--ep_imbalance",
        type=float,
        default=EP_IMBALANCE,
        help="under expert parallelism, the busiest rank's routed rows over its even share "
        f"(default {EP_IMBALANCE}, measured on the debug MoE recipes; the worst case is "
        "ep x min(top_k, experts per rank) / top_k)",
    )
    parser.add_argument("--dry_run", action="store_true", help=argparse.SUPPRESS)
    known, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if "-h" in overrides or "--help" in overrides:
        parser.print_help()
        return 0
    try:  # validated for the target world below, where each error is listed
        config = load_config(known.module, known.config, overrides, validate=False)
    except ConfigError as error:
        print(f"temper: config error: {error}", file=sys.stderr)
        return 2
    plan = plan_run(config, known.world_size, known.device, known.ep_imbalance)
    print(format_plan(plan))
    return 2 if plan.errors else 0


__all__ = ["Plan", "main", "plan_run"]
