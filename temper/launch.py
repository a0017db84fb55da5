"""torchrun, quiet on Ctrl-C, SIGTERM and config errors: the run says what happened in one
line, and this entry point leaves only the exit code.

A terminal's Ctrl-C (or a scheduler's SIGTERM) reaches torchrun's agent. The agent forwards
the signal, waits for the workers, then raises its ``SignalException`` with a traceback and
logs the shutdown at warning level: noise after the run's own "stopped at step N" line. Bad
input that only the run can find (another run took the run folder after the pre-flight)
ends the run with exit code 2 after its one line, where torchrun would add its failure
report. This entry point runs torchrun unchanged and, for these, returns 128 + the signal
(130, 143) or 2.
"""

from __future__ import annotations

import logging
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun

_STOPS = (signal.SIGINT, signal.SIGTERM)
CONFIG_ERROR = 2
"""temper.train's exit code for bad input, which the run has said in one line."""
_SHUTDOWN_NOTICES = (
    "death signal, shutting down workers",
    *(f"closing signal {stop.name}" for stop in _STOPS),
    f"failed (exitcode: {CONFIG_ERROR})",
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
    except ChildFailedError as failed:
        if failed.get_first_failure()[1].exitcode != CONFIG_ERROR:
            raise
        return CONFIG_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
