"""Time marks on one device: host wall clock on CPU, CUDA events on CUDA, read lazily.

[Note: device timing]
On CUDA a host clock read around a collective or a phase measures when its kernels were *launched*,
not when they ran: NCCL calls and waits return at once, and the time they take lands in whatever later
call blocks. So on a CUDA device ``DeviceTimer.mark()`` records a timing event on the current stream
and an interval is the device time between two marks on that stream's timeline. Nothing waits when a
mark is taken. Intervals are read where the host already stands still or where it may: ``settle()``
completes the ones whose events have happened (``query``, no wait), ``settle(wait=True)`` blocks on the
last mark taken, once, and is called only at the profiler's per-step record; hfzero never adds a host
synchronization per collective. While a stream is being captured into a CUDA graph no event is
recorded (the interval is skipped: timing lives at unit boundaries, outside compiled regions).
On CPU (and gloo) a mark is ``time.perf_counter()`` and intervals are complete at once: wall times.

``DeviceTimer.kind`` says which: ``"wall"`` or ``"cuda_event"``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Union

import torch

from hfzero.devices import with_index

Mark = Union[float, "torch.cuda.Event", None]
"""A point in time: a wall-clock reading (CPU), a recorded CUDA event, or None (not taken: capture)."""


class DeviceTimer:
    """Marks and intervals on ``device``; holds two events per pending interval until it is settled."""

    def __init__(self, device: torch.device | str):
        self.device = with_index(device)  # See [Note: device index] in hfzero/devices.py
        self.kind = "cuda_event" if self.device.type == "cuda" else "wall"
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event, Callable[[float], None]]] = []
        self._last: torch.cuda.Event | None = None

    def mark(self) -> Mark:
        """Now, on this device's current stream (a recorded event on CUDA; no host wait)."""
        if self.kind == "wall":
            return time.perf_counter()
        if torch.cuda.is_current_stream_capturing():
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        self._last = event
        return event

    def interval(self, start: Mark, end: Mark, into: Callable[[float], None]) -> None:
        """Give ``into`` the seconds from ``start`` to ``end``: now on CPU, at a later ``settle`` on CUDA."""
        if start is None or end is None:
            return
        if self.kind == "wall":
            into(end - start)
            return
        self._pending.append((start, end, into))
        if len(self._pending) >= 512:  # bound what is held when nobody settles: take what is done
            self.settle()

    def settle(self, *, wait: bool = False) -> None:
        """Deliver the intervals whose end has happened; with ``wait``, first block until the last mark
        taken has happened (one host wait), so every interval is delivered. See [Note: device timing]."""
        if not self._pending:
            return
        if wait and self._last is not None:
            self._last.synchronize()
        left = []
        for start, end, into in self._pending:
            if end.query():
                into(start.elapsed_time(end) / 1000.0)
            else:
                left.append((start, end, into))
        self._pending = left

    @property
    def pending(self) -> int:
        """Intervals not delivered yet."""
        return len(self._pending)

    def seconds(self, start: Mark, end: Mark) -> float | None:
        """The seconds between two marks, blocking on ``end`` on CUDA: only where the caller waits anyway."""
        if start is None or end is None:
            return None
        if self.kind == "wall":
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1000.0
