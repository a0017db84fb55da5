"""Atomic DCP checkpoints in `<dump>/checkpoints/step-<N>/`, the latest K kept.

A save is written to `.step-<N>.partial/` and renamed to `step-<N>/` only once every
rank's shards, the DCP metadata, `state.json`, `temper.json` and last `manifest.json` (each
file's size and SHA-256, each rank hashing its share) are on disk. So a folder named
`step-<N>` was complete when written: a crash or a full disk mid-save leaves the previous
checkpoint as it was (a full disk is reported in one line and the partial folder removed).
A file lost, truncated or altered since is found by the manifest at load, as is a
`.metadata` that no longer parses, and `resume auto` falls back to the checkpoint before.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import LoadPlanner, WriteItem

from temper.checkpoint.integrity import (
    MANIFEST_FILE,
    IncompleteCheckpoint,
    file_records,
    listed_files,
    manifest_text,
    verify,
)
from temper.checkpoint.metadata import METADATA_FILE, read_metadata
from temper.checkpoint.reader import DCP_METADATA_FILE, CheckpointReader, read_dcp_metadata
from temper.checkpoint.state import join_tensors, split_tensors

# DCP warns at every save and load without a process group that it assumes one process,
# even when told so (no_dist=True; torch 2.11 to 2.13), and an async save warns from its
# worker thread. One process is what a single-process run and the converter mean; the
# warning says nothing else, and is raised only then.
warnings.filterwarnings(
    "ignore",
    message="torch.distributed is disabled, unavailable or uninitialized",
    category=UserWarning,
    module=r"torch\.distributed\.checkpoint",
)

STATE_FILE = "state.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_PARTIAL_DIR = re.compile(r"^\.step-\d+\.partial$")


class CheckpointWarning(UserWarning):
    """A checkpoint was passed over or a partial save removed; the run goes on."""


class DiskFull(OSError):
    """A save ran out of space; the partial folder is gone, the previous checkpoint kept."""


def checkpoint_dir(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f"step-{step}"


def complete_steps(root: str | os.PathLike[str]) -> list[int]:
    """Steps with a complete checkpoint under `root`, ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and (entry / METADATA_FILE).is_file() and (entry / DCP_METADATA_FILE).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def resolve_resume(root: str | os.PathLike[str], resume: str, digests: bool = True) -> int | None:
    """The step to resume from: `auto` = the latest whose files are intact (None if none;
    each one passed over is warned about), `never`, or a step (which must be intact).

    Intact: every file as the manifest records it (size and SHA-256) and a `.metadata`
    that parses (``digests=False``: sizes only, the pre-flight's quick look). A checkpoint
    that would run code or read outside its folder raises UnsafeCheckpoint (or UnsafePath)
    whatever `resume` says: that is not damage to step over.
    """
    if resume == "never":
        return None
    steps = complete_steps(root)
    if resume == "auto":
        for step in reversed(steps):
            try:
                check_intact(checkpoint_dir(root, step), digests)
                return step
            except IncompleteCheckpoint as err:
                _warn(f"{err}; resuming from the checkpoint before it instead")
        return None
    step = int(resume)
    if step not in steps:
        raise FileNotFoundError(
            f"checkpoint.resume {resume}: no complete checkpoint {checkpoint_dir(root, step)}; "
            f"complete steps there: {steps or 'none'}"
        )
    check_intact(checkpoint_dir(root, step), digests)
    return step


def check_intact(folder: str | os.PathLike[str], digests: bool = True) -> None:
    """Every byte of a checkpoint folder as its save wrote it (IncompleteCheckpoint if not),
    and its `.metadata` safe to hand DCP (UnsafeCheckpoint if not)."""
    verify(folder, digests)
    read_dcp_metadata(folder)


def remove_partial_saves(root: str | os.PathLike[str]) -> None:
    """Delete the `.step-<N>.partial` folders of saves a crash interrupted (main rank)."""
    root = Path(root)
    if not _is_main() or not root.is_dir():
        return
    for entry in sorted(root.iterdir()):
        if _PARTIAL_DIR.match(entry.name) and entry.is_dir():
            shutil.rmtree(entry)
            _warn(f"{entry}: removed the partial save an interrupted run left")


class CheckpointManager:
    """Saves and loads training state; every rank calls every method at the same steps."""

    def __init__(
        self, root: str | os.PathLike[str], *, keep_latest_k: int, async_mode: bool
    ) -> None:
        self.root = Path(root)
        self.keep_latest_k = keep_latest_k
        self.async_mode = async_mode
        self._pending: Future | None = None
        self._publisher: ThreadPoolExecutor | None = None
        self._async_group: dist.ProcessGroup | None = None

    def save(
        self,
        step: int,
        state: dict[str, Any],
        metadata: dict[str, Any],
        files: dict[str, str] | None = None,
    ) -> None:
        """Write `state` (nested dicts of tensors and JSON values) as checkpoint `step`, with
        `files` (relative name -> text: the tokenizer's) beside it.

        In async mode this returns once the tensors are staged in memory; the files are
        written in the background and renamed into place as soon as every rank's are
        written, so a run killed later resumes from this step.
        """
        self.wait()
        final = checkpoint_dir(self.root, step)
        if not self.async_mode:
            write_checkpoint(final, state, metadata, self.keep_latest_k, files)
            return
        partial, tensors, files = _prepare(final, state, metadata, files)
        group = self._background_group()
        writes = dcp.async_save(tensors, checkpoint_id=str(partial), process_group=group)
        if self._publisher is None:
            self._publisher = ThreadPoolExecutor(1, thread_name_prefix="temper-checkpoint")
        self._pending = self._publisher.submit(
            _publish_when_written, writes, partial, final, files, self.keep_latest_k, group
        )

    def wait(self) -> None:
        """Block until a pending asynchronous save is published (no-op when none); raises
        what failed in it."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        pending.result()

    def load(
        self, step: int | Path, state: dict[str, Any], planner: LoadPlanner | None = None
    ) -> dict[str, Any]:
        """Fill the tensors of `state` in place from a checkpoint (a step or a folder) and
        return the full state with the checkpoint's non-tensor values; `planner`: DCP's
        load planner, when the default cannot place a tensor (QLoRA's sharded NF4 base).

        Keys absent from `state` are not read, so a model-only state loads the weights
        of a full checkpoint. Sharded tensors are resharded to the current layout.
        """
        folder = step if isinstance(step, Path) else checkpoint_dir(self.root, step)
        verify(folder)
        tensors, _ = split_tensors(state)
        dcp.load(tensors, storage_reader=CheckpointReader(folder), planner=planner)
        skeleton = json.loads((folder / STATE_FILE).read_text())
        return join_tensors(_select(skeleton, state), tensors)

    def metadata(self, step: int) -> dict[str, Any]:
        return read_metadata(checkpoint_dir(self.root, step))

    def _background_group(self) -> dist.ProcessGroup | None:
        """Async saves talk on their own gloo group so they never interleave with training
        collectives on the default group."""
        if not dist.is_initialized():
            return None
        if self._async_group is None:
            self._async_group = dist.new_group(backend="gloo")
        return self._async_group


def write_checkpoint(
    final: Path,
    state: dict[str, Any],
    metadata: dict[str, Any],
    keep_latest_k: int = 0,
    files: dict[str, str] | None = None,
    produce: Callable[[str], torch.Tensor] | None = None,
) -> None:
    """Synchronously and atomically write `state` as the checkpoint folder `final`, with the
    text `files` (relative name -> text).

    With `produce`, the tensors of `state` are placeholders (meta tensors of the right shape
    and dtype) and `produce(dotted_name)` makes each one only when DCP writes it, each to a
    file of its own: one tensor in memory at a time.
    """
    partial, tensors, files = _prepare(final, state, metadata, files)
    with _reporting_full_disk(partial, final):
        if produce is None:
            dcp.save(tensors, checkpoint_id=str(partial))
        else:
            writer = FileSystemWriter(partial, single_file_per_rank=False)
            dcp.save(tensors, storage_writer=writer, planner=_ProducingPlanner(produce))
        _publish(partial, final, files, keep_latest_k)


class _ProducingPlanner(DefaultSavePlanner):
    """Plans from placeholders; hands DCP each tensor's value only when it writes it."""

    def __init__(self, produce: Callable[[str], torch.Tensor]) -> None:
        super().__init__()
        self.produce = produce

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self.produce(write_item.index.fqn)


def _prepare(
    final: Path, state: dict[str, Any], metadata: dict[str, Any], extra: dict[str, str] | None
) -> tuple[Path, dict[str, torch.Tensor], dict[str, str]]:
    """A fresh partial folder beside `final`, the tensors to save and the text files."""
    partial = final.parent / f".{final.name}.partial"
    if _is_main():
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier()
    tensors, skeleton = split_tensors(state)
    files = {STATE_FILE: json.dumps(skeleton), METADATA_FILE: json.dumps(metadata, indent=2)}
    return partial, tensors, {**(extra or {}), **files}


def _publish_when_written(
    writes: Future,
    partial: Path,
    final: Path,
    files: dict[str, str],
    keep_latest_k: int,
    group: dist.ProcessGroup | None,
) -> None:
    """An async save's last part, on the publisher thread: its writes, then `_publish` (on
    the save's own group, never the training one)."""
    with _reporting_full_disk(partial, final):
        writes.result()
        _publish(partial, final, files, keep_latest_k, group)


def _publish(
    partial: Path,
    final: Path,
    files: dict[str, str],
    keep_latest_k: int,
    group: dist.ProcessGroup | None = None,
) -> None:
    """After every rank's shards are written: JSON files, the manifest (each rank hashing a
    share of the files), the atomic rename."""
    if _is_main():
        for name, text in files.items():
            _write_durably(partial / name, text)
    _barrier(group)
    records = _records_hashed_by_every_rank(partial, group)
    if _is_main():
        _write_durably(partial / MANIFEST_FILE, manifest_text(records))
        if final.exists():  # re-saving a step: the new copy replaces the old one
            shutil.rmtree(final)
        os.replace(partial, final)
        _fsync_dir(final.parent)
        if keep_latest_k > 0:
            for step in complete_steps(final.parent)[:-keep_latest_k]:
                shutil.rmtree(checkpoint_dir(final.parent, step), ignore_errors=True)
    _barrier(group)


def _records_hashed_by_every_rank(
    folder: Path, group: dist.ProcessGroup | None
) -> dict[str, dict[str, int | str]]:
    """Size and SHA-256 of every file in `folder`, the files dealt over the ranks largest
    first, so each rank reads back about its own share of the save (gathered on rank 0)."""
    names = sorted(listed_files(folder), key=lambda name: (-(folder / name).stat().st_size, name))
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return file_records(folder, names)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    shares: list[dict | None] = [None] * world
    dist.all_gather_object(shares, file_records(folder, names[rank::world]), group=group)
    return {name: record for share in shares for name, record in (share or {}).items()}


@contextlib.contextmanager
def _reporting_full_disk(partial: Path, final: Path) -> Iterator[None]:
    """A save that ran out of space ends in one DiskFull naming the folder (torch's own
    error names neither: ``unexpected pos 704 vs 598``); the partial folder is removed, so
    the space goes back, and the previous checkpoint stays untouched."""
    try:
        yield
    except (Exception, CheckpointException) as err:  # DCP's is a BaseException
        if not _out_of_space(err, final.parent):
            raise
        if _is_main():
            shutil.rmtree(partial, ignore_errors=True)
        kept = complete_steps(final.parent)
        previous = f"step-{kept[-1]} is kept" if kept else "there is no earlier checkpoint"
        raise DiskFull(
            f"{partial}: no space left on device while saving {final.name}; the partial "
            f"save was removed and {previous}"
        ) from None


_FULL = 16 << 20
"""Free bytes under which a failed save is put down to a full disk: torch's zip writer
reports ENOSPC as a bare position mismatch, with no errno to read."""


def _out_of_space(err: BaseException, folder: Path) -> bool:
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        return shutil.disk_usage(folder).free < _FULL
    except OSError:
        return False


def _warn(message: str) -> None:
    if _is_main():
        warnings.warn(message, CheckpointWarning, stacklevel=3)


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _select(skeleton: dict[str, Any], wanted: dict[str, Any]) -> dict[str, Any]:
    """The sections of a saved skeleton that `wanted` asks for (a model-only load, say)."""
    return {key: skeleton[key] for key in wanted if key in skeleton}


def _write_durably(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _barrier(group: dist.ProcessGroup | None = None) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier(group=group)


def rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
