"""One run per run folder: rank 0 holds an exclusive lock on ``<job.dump_folder>/.temper.lock``
for the run's whole life, so a second run on that folder is refused instead of mixing its
checkpoints and metrics rows with the first's.

The lock is ``fcntl.flock``: the kernel releases it when the process ends, however it ends, so
the lock of a run that died is free and the next run takes it over. The file's text only names
the holder (pid, host, start time) for the refusal.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from temper.config import ConfigError
from temper.parallel.collectives import all_gather_objects
from temper.utils.device import Runtime

LOCK_FILE = ".temper.lock"
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)
"""flock's errors on a file system without locks (Lustre mounted without ``-o flock``)."""


@dataclass
class _Held:
    fd: int
    count: int = 0


_HELD: dict[str, _Held] = {}
"""This process's held locks by the lock file's real path. A process that takes one again (a
second Trainer in a test or a notebook) shares it: flock would refuse the process itself."""


class RunLock:
    """The lock of run folder ``folder``, held from ``acquire`` to ``release``."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = str(folder)
        self.path = os.path.realpath(Path(folder) / LOCK_FILE)
        self.held = False

    def acquire(self) -> RunLock:
        """Take the lock (creating the folder), or raise ConfigError naming its holder."""
        if not self.held:
            held = _HELD.get(self.path)
            if held is None:
                held = _HELD[self.path] = _Held(self._take())
            held.count += 1
            self.held = True
        return self

    def release(self) -> None:
        """Let the next run in; the last holder in this process clears the holder's name."""
        held = _HELD.get(self.path)
        if not self.held or held is None:
            return
        self.held = False
        held.count -= 1
        if held.count == 0:
            del _HELD[self.path]
            if held.fd >= 0:
                os.ftruncate(held.fd, 0)
                os.close(held.fd)

    def _take(self) -> int:
        """A descriptor holding the lock, with this process named in the file; -1 where the
        file system has no locks (a note says the folder is unguarded)."""
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096)
            os.close(fd)
            raise _refusal(self.folder, holder) from None
        except OSError as error:
            os.close(fd)
            if error.errno not in _UNSUPPORTED:
                raise
            print(
                f"temper: job.dump_folder {self.folder}: the file system has no locks "
                f"({error.strerror}); nothing stops a second run on this folder",
                file=sys.stderr,
            )
            return -1
        os.ftruncate(fd, 0)
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n".encode())
        return fd


def _refusal(folder: str, holder: bytes) -> ConfigError:
    """The one-line refusal naming the run that holds ``folder`` (its lock file's text)."""
    named = holder.decode(errors="replace").strip() or "holder not named yet"
    return ConfigError(
        f"job.dump_folder {folder} is in use by another run ({named}): wait for it to end or "
        "stop it, or give this run its own --job.dump_folder"
    )


def hold_run_folder(folder: str, runtime: Runtime) -> RunLock:
    """Rank 0 takes ``folder``'s lock for the run; when another run holds it, every rank raises
    the same ConfigError, so they all exit 2 together instead of waiting on rank 0."""
    lock = RunLock(folder)
    refusal: str | None = None
    if runtime.is_main:
        try:
            lock.acquire()
        except ConfigError as error:
            refusal = str(error)
    if runtime.world_size > 1:
        refusal = all_gather_objects(refusal)[0]
    if refusal is not None:
        raise ConfigError(refusal)
    return lock


def check_run_folder_free(folder: str) -> None:
    """The pre-flight's look: ConfigError naming the holder if a run holds ``folder`` now.

    It looks with a shared lock, taken and dropped at once, so that the pre-flights of several
    nodes on one shared run folder, which run at the same moment, do not refuse each other;
    only a run's exclusive lock refuses them."""
    path = os.path.realpath(Path(folder) / LOCK_FILE)
    if path in _HELD or not os.path.exists(path):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _refusal(folder, os.read(fd, 4096)) from None
    except OSError as error:
        if error.errno not in _UNSUPPORTED:
            raise
    finally:
        os.close(fd)
