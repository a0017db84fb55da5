"""Runs a vLLM server and ends it when the run that started it is gone.

Started by ``temper.generation.engines.vllm_server`` with the vLLM virtualenv's interpreter
as ``python vllm_watchdog.py <trainer pid> <command...>``, in a process group of its own
that the server joins. It checks once a second that the trainer process still exists; when
it does not (the trainer was killed, even by SIGKILL, where no atexit handler runs), it
stops the whole group: no orphan server holds the port or the memory. It imports nothing
from temper (it runs in vLLM's environment) and exits with the server's exit code.
"""

import os
import signal
import subprocess
import sys
import time


def main() -> int:
    trainer, command = int(sys.argv[1]), sys.argv[2:]
    server = subprocess.Popen(command)
    # The trainer stops the group with SIGTERM: the server shuts down, then this loop ends.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while server.poll() is None:
        if os.getppid() != trainer:  # the trainer died: this process was re-parented
            os.killpg(os.getpgrp(), signal.SIGTERM)
            time.sleep(10)
            os.killpg(os.getpgrp(), signal.SIGKILL)
        time.sleep(1)
    return server.returncode


if __name__ == "__main__":
    sys.exit(main())
