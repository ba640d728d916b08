"""The background half of an asynchronous checkpoint save, and the points that wait for it.

[Note: asynchronous saves]
With ``ZeroConfig.async_save`` a save does in the foreground (the step waits) everything that reads live
training state or needs the ranks together: it waits for the previous asynchronous save, prepares the
``.partial`` directory, copies the persistent buffers into the host staging buffer (staging.py), and gathers
every rank's report, from which rank 0 builds the manifest (hyper-parameters, loss scale and step counters
as they are *now*). Then a background thread, one per process, does the rest of [Note: atomic checkpoint]:
it copies the rank's master and optimizer-state slices into the staging buffer (only an optimizer step
changes them, and the next one waits for this copy: ``ZeroEngine.wait_checkpoint_copy``), writes and
fsyncs the rank file from the staged copies, the ranks exchange the files' digests, rank 0
writes the manifest and renames the directory into place, and the ranks agree on the outcome.
- The thread's collectives run on a gloo group of their own over the same ranks (``side_comm``, created once
  at the first asynchronous save, a point the same on every rank, by the whole world), never on the training's
  group, so they cannot interleave with the step's collectives. A save whose ranks are not the whole world (a
  model prepared over a sub-group by hand) runs synchronously, with a warning: see ``side_comm``. They run in the same order on every rank, and the thread
  ends with an agreement: every rank holds the same outcome.
- Waiting (``wait``) is rank-local: join the thread, raise its outcome. Every rank reaches the same result,
  so every rank raises the same CheckpointError. Points that wait: the next save and any load (both
  collectives), the end of ``ZeroTrainer.train`` and of ``ZeroAccelerator.end_training``,
  ``torch.distributed.destroy_process_group`` (wrapped here: destroying the groups under the thread would
  break its collectives) and process exit (the thread is not a daemon: the interpreter waits for it; then an
  ``atexit`` hook logs a failure and ends the process with status 1, so the launcher sees it).
- A kill during the background work leaves what a kill of a synchronous save at the same phase leaves: the
  previous checkpoint (see [Note: atomic checkpoint]).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from hfzero.checkpoint.errors import CheckpointError
from hfzero.comm.collectives import Communicator
from hfzero.logging import get_logger

logger = get_logger(__name__)


@dataclasses.dataclass
class _Pending:
    """The asynchronous save in flight: its thread and, once it ended, its failure (None: succeeded)."""

    directory: Path
    thread: threading.Thread
    started: float
    error: str | None = None


_pending: _Pending | None = None
_side: dict[tuple[int, ...], Communicator] = {}
_hooks_installed = False


def side_comm(comm: Communicator) -> Communicator | None:
    """A gloo communicator over ``comm``'s ranks for the background thread's collectives (created once per set
    of ranks, at a save: a point the same on every rank), or None when ``comm`` is not the whole world. A group
    of some ranks only would have to be made with local synchronization, which hangs once the default group
    is bound to a device and split (see [Note: one communicator per data-parallel group] in
    runtime/stage3/engine.py); such a save runs synchronously."""
    if comm.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return comm  # nothing to exchange
    ranks = tuple(dist.get_process_group_ranks(comm.group if comm.group is not None else dist.group.WORLD))
    if len(ranks) != dist.get_world_size():
        return None
    if ranks not in _side:
        group = dist.new_group(list(ranks), backend="gloo")  # a collective of the whole world, at this save
        _side[ranks] = Communicator(group, device=torch.device("cpu"))
    return _side[ranks]


def start(directory: Path, job: Callable[[], None]) -> None:
    """Run ``job`` (the rest of the save into ``directory``) on the background thread."""
    global _pending
    if _pending is not None:
        raise CheckpointError("an asynchronous save is already in flight; wait() for it first")  # a bug of ours
    _install_hooks()
    pending = _Pending(directory, threading.Thread(), time.perf_counter())

    def run() -> None:
        try:
            job()
        except CheckpointError as exc:
            pending.error = str(exc)
        except BaseException as exc:  # noqa: BLE001 - reported where the save is waited for
            logger.exception("asynchronous save of %s failed", directory)
            pending.error = f"{type(exc).__name__}: {exc}"

    pending.thread = threading.Thread(target=run, name="hfzero-async-save", daemon=False)
    _pending = pending
    pending.thread.start()


def pending_directory() -> Path | None:
    """Where the asynchronous save in flight (or ended but not yet waited for) writes; None without one."""
    return _pending.directory if _pending is not None else None


def wait() -> None:
    """Wait for the asynchronous save in flight, if any; raise its failure (the same on every rank).

    Rank-local (the thread's own agreement made the outcome common); returns at once without one.
    """
    global _pending
    pending = _pending
    if pending is None:
        return
    if pending.thread.is_alive():
        waited = time.perf_counter()
        pending.thread.join()
        logger.info("waited %.2fs for the asynchronous save of %s", time.perf_counter() - waited, pending.directory)
    _pending = None
    if pending.error is not None:
        raise CheckpointError(f"the asynchronous save of {pending.directory} failed: {pending.error}. That "
                              "checkpoint was not completed; an earlier one in that directory, if any, is kept")


def _install_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    atexit.register(_at_exit)
    original = dist.destroy_process_group

    def destroy_process_group(*args, **kwargs):
        wait()  # the thread's collectives need the groups: finish before they go
        _side.clear()
        return original(*args, **kwargs)

    destroy_process_group.__doc__ = original.__doc__
    destroy_process_group.__wrapped__ = original  # type: ignore[attr-defined]
    dist.destroy_process_group = destroy_process_group
    _hooks_installed = True


def _at_exit() -> None:
    """At interpreter exit (the non-daemon thread has ended by now): a failed save ends the process with 1."""
    try:
        wait()
    except CheckpointError as exc:
        logger.error("%s", exc)
        logging.shutdown()
        os._exit(1)
