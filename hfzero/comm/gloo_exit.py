"""Let gloo's worker threads finish releasing completed collectives before the interpreter finalizes.

[Note: gloo teardown abort]
A gloo collective runs on a ``pt_gloo_runloop`` thread. When the work completes, the caller's
``wait()`` returns at once, and the runloop thread drops its own reference to the work a moment
later. Dropping it releases the work's tensors, which are Python tensors: that takes the GIL. If
the main thread has meanwhile reached interpreter finalization (the script ended right after its
last collective, e.g. the parameter all-gather that ends a ZeRO step), CPython makes any thread
that asks for the GIL exit with ``pthread_exit``; the forced unwind through torch's C++ frames
calls ``std::terminate`` ("terminate called without an active exception", SIGABRT, exit 1 under
torchrun) although the script succeeded. Backtrace of such an abort (torch 2.13, 2 ranks, gloo):
``Py_FinalizeEx`` on the main thread; on ``pt_gloo_runloop``: ``ProcessGroupGloo::runLoop`` ->
``~AsyncAllgatherWork`` -> ``TensorImpl::decref_pyobject`` -> ``gil_scoped_acquire`` ->
``take_gil`` -> ``PyThread_exit_thread`` -> ``std::terminate``. Plain DDP has the same race (its
last collective is in backward, further from the exit, so it hits it less often).

The fix here: an ``atexit`` hook (run before finalization, while threads may still take the GIL)
releases the GIL for a few milliseconds, so a runloop thread waiting for it finishes its release.
Measured on 2 shared CPU cores, 2 ranks, stage 2: 12 of 32 direct-API torchrun runs aborted at
exit without it, 0 of 32 with it (DDP: 2 of 32). Installed once, by the first gloo Communicator.

The same race can hang a script instead (seen 2026-11-29 in the plain-DDP reference of TRL's DPO script, torch
2.14.1): ``trainer.end()`` calls ``destroy_process_group``, so torch's registry no longer holds the gloo group and
the last holder is an object the script drops later (there DDP's reducer; for hfzero an engine, which since
wave 4 is collected when the script drops it). Dropping the last reference runs ``~ProcessGroupGloo`` on the
main thread, which holds the GIL and joins the runloop threads; a runloop thread still releasing its last work
waits for the GIL: a deadlock (main thread in ``thread::join`` under ``Reducer`` dealloc, both runloops in a
futex wait). So every gloo group a Communicator uses is also held here (``keep``) until the interpreter exits:
an engine's collection never destroys a process group, and the exit hook above has let the runloops finish
before finalization destroys it. This holds no tensor memory (a group object and its idle threads).
"""

from __future__ import annotations

import atexit
import time

_GIL_RELEASES = 20
"""Sleeps of 1 ms at exit: each lets a thread waiting for the GIL take it (20 ms in all)."""

_installed = False
_kept: list[object] = []
"""Gloo process groups held until the interpreter exits (``keep``)."""


def _release_gil_briefly() -> None:
    for _ in range(_GIL_RELEASES):
        time.sleep(0.001)


def install() -> None:
    """Register the exit hook once per process. See [Note: gloo teardown abort]."""
    global _installed
    if not _installed:
        atexit.register(_release_gil_briefly)
        _installed = True


def keep(group: object) -> None:
    """Hold ``group`` (a gloo process group) until the interpreter exits, so that dropping its other holders
    (an engine, after ``destroy_process_group``) never destroys it on a thread holding the GIL. See [Note: gloo
    teardown abort]."""
    if not any(kept is group for kept in _kept):
        _kept.append(group)
