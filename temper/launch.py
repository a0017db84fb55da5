"""torchrun, quiet on Ctrl-C and SIGTERM: the workers stop at a step boundary and say so.

A terminal's Ctrl-C (or a scheduler's SIGTERM) reaches torchrun's agent. The agent forwards
the signal, waits for the workers, then raises its ``SignalException`` with a traceback and
logs the shutdown at warning level: noise after the run's own "stopped at step N" line. This
entry point runs torchrun unchanged and, for such a stop, leaves only the exit code.
"""

from __future__ import annotations

import logging
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main as torchrun

_STOPS = (signal.SIGINT, signal.SIGTERM)
_SHUTDOWN_NOTICES = (
    "death signal, shutting down workers",
    *(f"closing signal {stop.name}" for stop in _STOPS),
)


def _not_a_shutdown_notice(record: logging.LogRecord) -> bool:
    return not any(notice in record.getMessage() for notice in _SHUTDOWN_NOTICES)


def main(argv: list[str]) -> int:
    for name in ("agent.server.api", "multiprocessing.api"):
        logging.getLogger(f"torch.distributed.elastic.{name}").addFilter(_not_a_shutdown_notice)
    try:
        torchrun(argv)
    except SignalException as stop:
        if stop.sigval not in _STOPS:
            raise
        return 128 + stop.sigval
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
