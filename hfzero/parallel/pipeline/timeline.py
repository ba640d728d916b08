"""What one rank's pipeline stages did during one step: busy spans, idle time, P2P bytes.

[Note: measuring the bubble]
A step's window is the schedule's ``step()`` call on this rank (``Pipeline.forward_backward``). Inside
it the stage is *busy* while it runs one of its own actions: a micro-batch's forward
(``forward_one_chunk``), the loss (the driver's loss function, last stage), a backward
(``backward_one_chunk``; zero-bubble schedules also ``backward_weight_one_chunk``) and the end-of-step
reduction (``perform_reduce_grad``: ZeRO's deferred dp collectives and the tied-embedding sum). Each
action is timed with ``time.perf_counter`` at its entry and exit; busy time is the length of the union
of those spans (a nested span is not counted twice). Everything else in the window is *idle*: waiting
for a P2P receive (activations from the previous stage, gradients from the next), for a send to
complete, and the schedule's own bookkeeping. So ``busy + idle = wall`` by construction, and the idle
time of a stage is its share of the bubble. The bubble fraction comparable to the cost model's
(P - 1)/(vM) (idle time over the ideal, i.e. busy, time, as Megatron defines it) is ``idle / busy``;
``idle / wall`` is the share of the step the stage stood still. On CUDA no synchronization is added:
spans are host times (kernel launch), so the figures are exact on CPU/gloo only and indicative on GPU.

P2P traffic is counted where the schedule asks the stage for its operations (``get_fwd_send_ops``,
``get_bwd_recv_ops``, ...): every ``isend``/``irecv`` the stage hands the schedule, with its tensor's
bytes. Transfers between two stages of the same rank (V-shaped schedules) need no operation and are
not counted, which is what the cost model's ``p2p_bytes`` assumes too.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch.distributed as dist

_ROUND = 6


class StageClock:
    """Times the actions of one rank's stages inside one step, and counts their P2P bytes.

    Resident memory: a few floats per action (2 to 4 actions per micro-batch and stage), kept for the
    last step only. Active only between ``begin()`` and ``end()`` (training steps; evaluation is not timed).
    """

    def __init__(self) -> None:
        self._active = False
        self._t0 = 0.0
        self._spans: list[tuple[str, int, int, float, float]] = []
        self._p2p: dict[str, dict[str, int]] = {}
        self.last: dict[str, Any] | None = None
        """The summary of the last finished step (see ``end``), or None before the first."""

    def begin(self) -> None:
        """Start a step's window now."""
        self._active = True
        self._spans = []
        self._p2p = {"send": {"calls": 0, "bytes": 0}, "recv": {"calls": 0, "bytes": 0}}
        self._t0 = time.perf_counter()

    @contextlib.contextmanager
    def span(self, action: str, stage: int, micro: int) -> Iterator[None]:
        """Time ``action`` ("forward", "loss", "backward", "backward_weight", "reduce") of global stage
        ``stage`` on micro-batch ``micro`` (-1 for the reduction)."""
        if not self._active:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self._spans.append((action, stage, micro, start - self._t0, time.perf_counter() - self._t0))

    def count_p2p(self, direction: str, ops: Iterable[dist.P2POp]) -> None:
        """Add the tensors of ``ops`` (the stage's isend or irecv operations) to ``direction``'s figures."""
        if not self._active:
            return
        entry = self._p2p[direction]
        for op in ops:
            entry["calls"] += 1
            entry["bytes"] += op.tensor.numel() * op.tensor.element_size()

    def end(self, *, n_micro: int, micro_shape: tuple[int, int] | None = None) -> dict[str, Any]:
        """Close the window; return (and keep as ``last``) the step's summary.

        Keys: ``wall_seconds`` (the window), ``busy_seconds`` (union of the spans), ``idle_seconds``
        (wall - busy), ``seconds_by_action`` (summed per action, nested spans included), ``bubble_fraction``
        (idle / busy), ``idle_fraction`` (idle / wall), ``n_micro``, ``micro_shape`` ([rows, seq] of one
        micro-batch, or None), ``actions`` (spans per action),
        ``p2p`` ({send, recv}: {calls, bytes}) and ``spans`` ([action, stage, micro, start, end], seconds
        since the window opened). See [Note: measuring the bubble].
        """
        wall = time.perf_counter() - self._t0
        self._active = False
        busy = _union_length((s[3], s[4]) for s in self._spans)
        idle = max(0.0, wall - busy)
        by_action: dict[str, float] = {}
        counts: dict[str, int] = {}
        for action, *_rest, start, stop in self._spans:
            by_action[action] = by_action.get(action, 0.0) + (stop - start)
            counts[action] = counts.get(action, 0) + 1
        self.last = {
            "wall_seconds": round(wall, _ROUND), "busy_seconds": round(busy, _ROUND),
            "idle_seconds": round(idle, _ROUND),
            "seconds_by_action": {k: round(v, _ROUND) for k, v in by_action.items()},
            "bubble_fraction": round(idle / busy, _ROUND) if busy > 0 else None,
            "idle_fraction": round(idle / wall, _ROUND) if wall > 0 else None,
            "n_micro": int(n_micro), "micro_shape": list(micro_shape) if micro_shape else None, "actions": counts, "p2p": {k: dict(v) for k, v in self._p2p.items()},
            "spans": [[a, s, m, round(b, _ROUND), round(e, _ROUND)] for a, s, m, b, e in self._spans],
        }
        return self.last


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
