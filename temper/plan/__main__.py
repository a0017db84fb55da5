"""``python -m temper.plan --module M --config C --world_size N [--section.field value ...]``:
the dry run of a recipe at N ranks, in one process on a CPU; exit code 2 when the run would
hit a config error."""

from __future__ import annotations

import sys

from temper.plan import main

if __name__ == "__main__":
    sys.exit(main())
