"""What one rank's pipeline stages did during one step: busy spans, idle time, P2P bytes.

[Note: measuring the bubble]
A step's window is the schedule's ``step()`` call on this rank (``Pipeline.forward_backward``). Inside
it the stage is *busy* while it runs one of its own actions: a micro-batch's forward
(``forward_one_chunk``), the loss (the driver's loss function, last stage), a backward
(``backward_one_chunk``; zero-bubble schedules also ``backward_weight_one_chunk``) and the end-of-step
reduction (``perform_reduce_grad``: ZeRO's deferred dp collectives and the tied-embedding sum). Each
action is timed at its entry and exit by ``hfzero.comm.timing.DeviceTimer`` marks; busy time is the length of the union
of those spans (a nested span is not counted twice). Everything else in the window is *idle*: waiting
for a P2P receive (activations from the previous stage, gradients from the next), for a send to
complete, and the schedule's own bookkeeping. So ``busy + idle = wall`` by construction, and the idle
time of a stage is its share of the bubble. The bubble fraction comparable to the cost model's
(P - 1)/(vM) (idle time over the ideal, i.e. busy, time, as Megatron defines it) is ``idle / busy``;
``idle / wall`` is the share of the step the stage stood still. On CPU/gloo the marks are host wall
times. On CUDA they are timing events recorded on the current stream (see [Note: device timing] in
hfzero/comm/timing.py): a span runs from when the stream reaches the action's first kernel to when its last
one is done, so busy and idle are the stream's own, and a P2P receive's wait (a stream wait on NCCL)
is idle as it should be; host launch times would bill it to whichever later call blocks. Nothing waits
when a mark is taken: the summary (``last``) is computed when first read, by the profiler at its
per-step record, which then waits for the window's last event.

P2P traffic is counted where the schedule asks the stage for its operations (``get_fwd_send_ops``,
``get_bwd_recv_ops``, ...): every ``isend``/``irecv`` the stage hands the schedule, with its tensor's
bytes. Transfers between two stages of the same rank (V-shaped schedules) need no operation and are
not counted, which is what the cost model's ``p2p_bytes`` assumes too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from hfzero.comm.timing import DeviceTimer, Mark

_ROUND = 6


class StageClock:
    """Times the actions of one rank's stages inside one step, and counts their P2P bytes.

    Resident memory: two marks per action (2 to 4 actions per micro-batch and stage: floats, or CUDA
    events on a CUDA device), kept for the last step only. Active only between ``begin()`` and ``end()``
    (training steps; evaluation is not timed).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.timer = DeviceTimer(device)
        self._active = False
        self._t0: Mark = None
        self._spans: list[tuple[str, int, int, Mark, Mark]] = []
        self._p2p: dict[str, dict[str, int]] = {}
        self._closed: tuple[Mark, Mark, list, dict[str, Any]] | None = None  # the last window, not summarized
        self._last: dict[str, Any] | None = None

    @property
    def last(self) -> dict[str, Any] | None:
        """The summary of the last finished step (see ``end``), or None before the first. On CUDA the first
        read after a step waits for that step's window to be over on the device."""
        if self._closed is not None:
            self._last, self._closed = self._summarize(*self._closed), None
        return self._last

    def begin(self) -> None:
        """Start a step's window now."""
        self._active = True
        self._spans = []
        self._p2p = {"send": {"calls": 0, "bytes": 0}, "recv": {"calls": 0, "bytes": 0}}
        self._t0 = self.timer.mark()

    @contextlib.contextmanager
    def span(self, action: str, stage: int, micro: int) -> Iterator[None]:
        """Time ``action`` ("forward", "loss", "backward", "backward_weight", "reduce") of global stage
        ``stage`` on micro-batch ``micro`` (-1 for the reduction)."""
        if not self._active:
            yield
            return
        start = self.timer.mark()
        try:
            yield
        finally:
            self._spans.append((action, stage, micro, start, self.timer.mark()))

    def count_p2p(self, direction: str, ops: Iterable[dist.P2POp]) -> None:
        """Add the tensors of ``ops`` (the stage's isend or irecv operations) to ``direction``'s figures."""
        if not self._active:
            return
        entry = self._p2p[direction]
        for op in ops:
            entry["calls"] += 1
            entry["bytes"] += op.tensor.numel() * op.tensor.element_size()

    def end(self, *, n_micro: int, micro_shape: tuple[int, int] | None = None) -> None:
        """Close the window; its summary is ``last`` (computed when first read).

        Keys: ``wall_seconds`` (the window), ``busy_seconds`` (union of the spans), ``idle_seconds``
        (wall - busy), ``seconds_by_action`` (summed per action, nested spans included), ``bubble_fraction``
        (idle / busy), ``idle_fraction`` (idle / wall), ``n_micro``, ``micro_shape`` ([rows, seq] of one
        micro-batch, or None), ``actions`` (spans per action),
        ``p2p`` ({send, recv}: {calls, bytes}) and ``spans`` ([action, stage, micro, start, end], seconds
        since the window opened). See [Note: measuring the bubble].
        """
        self._active = False
        extra = {"n_micro": int(n_micro), "micro_shape": list(micro_shape) if micro_shape else None,
                 "p2p": {k: dict(v) for k, v in self._p2p.items()}}
        self._closed = (self._t0, self.timer.mark(), self._spans, extra)
        self._last = None
        if self.timer.kind == "wall":  # wall marks are complete: summarize now
            self._last, self._closed = self._summarize(*self._closed), None

    def _summarize(self, t0: Mark, closed: Mark, marks: list, extra: dict[str, Any]) -> dict[str, Any]:
        """The summary ``end`` documents, from the window's marks (blocks on CUDA until they happened)."""
        wall = self.timer.seconds(t0, closed) or 0.0
        spans = [(a, s, m, self.timer.seconds(t0, b) or 0.0, self.timer.seconds(t0, e) or 0.0)
                 for a, s, m, b, e in marks if b is not None and e is not None]
        busy = _union_length((s[3], s[4]) for s in spans)
        idle = max(0.0, wall - busy)
        by_action: dict[str, float] = {}
        counts: dict[str, int] = {}
        for action, *_rest, start, stop in spans:
            by_action[action] = by_action.get(action, 0.0) + (stop - start)
            counts[action] = counts.get(action, 0) + 1
        return {
            "wall_seconds": round(wall, _ROUND), "busy_seconds": round(busy, _ROUND),
            "idle_seconds": round(idle, _ROUND),
            "seconds_by_action": {k: round(v, _ROUND) for k, v in by_action.items()},
            "bubble_fraction": round(idle / busy, _ROUND) if busy > 0 else None,
            "idle_fraction": round(idle / wall, _ROUND) if wall > 0 else None,
            "n_micro": extra["n_micro"], "micro_shape": extra["micro_shape"], "actions": counts, "p2p": extra["p2p"],
            "spans": [[a, s, m, round(b, _ROUND), round(e, _ROUND)] for a, s, m, b, e in spans],
        }


def _union_length(spans: Iterable[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    total, reach = 0.0, None
    for start, stop in sorted(spans):
        if reach is None or start > reach:
            total += stop - start
            reach = stop
        elif stop > reach:
            total += stop - reach
            reach = stop
    return total
