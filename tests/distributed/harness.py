"""Run a function on N gloo ranks on CPU, each in a fresh process, and collect what it returns.

A rank that raises, dies or hangs fails the caller with that rank's traceback or a timeout,
so a broken collective fails the test instead of hanging CI.

Ranks fork from a forkserver that imported torch and temper once per test session: a
spawned process would spend ~3 s of CPU importing them, and a world-4 test on CI's two
cores paid that four times per run. The server runs no torch op before forking, so each
rank starts as clean as a spawned one (no threads, no process group, default kernels).
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_on_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0
) -> list[Any]:
    """`fn(*args)` on ranks 0..world_size-1 (env:// rendezvous on 127.0.0.1); results by rank.

    `fn` must be importable by name (a module-level function) and its result picklable;
    tensors in it come back by value.
    Each rank uses one CPU thread, so ranks do not fight over the cores.
    """
    ctx = mp.get_context("forkserver")
    results: queue.Queue[tuple[int, bool, Any]] = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, rank, world_size, port, results, args))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    done: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(done) < world_size:
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(done))
                raise TimeoutError(f"ranks {missing} of {world_size} did not finish in {timeout}s")
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [
                    f"rank {r} exited with code {p.exitcode}"
                    for r, p in enumerate(procs)
                    if r not in done and p.exitcode not in (None, 0)
                ]
                if dead:
                    raise RuntimeError("; ".join(dead)) from None
                continue
            if not ok:
                failures = {rank: value, **_other_failures(results, world_size - len(done) - 1)}
                report = "\n".join(
                    f"rank {r} of {world_size} failed:\n{failures[r]}" for r in sorted(failures)
                )
                raise RuntimeError(report)
            done[rank] = pickle.loads(value)
        for proc in procs:
            proc.join(timeout=60)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [done[rank] for rank in range(world_size)]


def _other_failures(
    results: queue.Queue[tuple[int, bool, Any]], pending: int, wait: float = 10.0
) -> dict[int, str]:
    """The tracebacks of the ranks still to report that fail within ``wait`` seconds: one
    rank's failure often shows on its peers first, as a closed connection, and the report
    should name the cause, not only its echo."""
    failures: dict[int, str] = {}
    deadline = time.monotonic() + wait
    while pending and time.monotonic() < deadline:
        try:
            rank, ok, value = results.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            break
        pending -= 1
        if not ok:
            failures[rank] = value
    return failures


_PRELOAD = ["torch", "torch.distributed", "temper.trainer.trainer", "training"]
"""Imported once by the forkserver (``training`` is this folder's run helper module)."""
mp.set_forkserver_preload(_PRELOAD)


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    results: queue.Queue[tuple[int, bool, Any]],
    args: tuple[Any, ...],
) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    try:
        # Pickled here, by value: tensors put on the queue as they are would be shared
        # through file descriptors that vanish when this process exits.
        value = pickle.dumps(fn(*args))
        if dist.is_initialized():
            # Collectives a rank issued but never waited on (an async ``full_tensor`` whose
            # parts it did not read) are still running; leaving now would close the sockets
            # under its peers ("connection reset by peer" on CI). Gloo runs them in order, so
            # a barrier ends after them.
            dist.barrier()
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
