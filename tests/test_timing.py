"""Device timing (issue 19, item 12), one process: wall marks on CPU, and the CUDA-event path's lazy
resolution driven by stand-in events (what is read when, and that nothing waits per interval); the
pipeline clock's bubble computed from marks only when read. Real CUDA events: tests/test_streams_cuda.py."""

from __future__ import annotations

import torch

from hfzero.comm.collectives import Communicator
from hfzero.parallel.pipeline.timeline import StageClock
from hfzero.comm.timing import DeviceTimer


class _Event:
    """Stands for a CUDA timing event recorded at ``t`` seconds on one stream: it has happened once the
    device reached ``t`` (``_Event.device_time``); waiting for it brings the device there."""

    waits = 0
    device_time = float("inf")

    def __init__(self, t: float) -> None:
        self.t = t

    def query(self) -> bool:
        return self.t <= _Event.device_time

    def synchronize(self) -> None:
        _Event.waits += 1
        _Event.device_time = max(_Event.device_time, self.t)

    def elapsed_time(self, end: "_Event") -> float:
        return (end.t - self.t) * 1000.0  # milliseconds, as torch.cuda.Event.elapsed_time


class _EventTimer(DeviceTimer):
    """A DeviceTimer on the CUDA-event path whose marks are stand-ins at given times."""

    def __init__(self, times: list[float], happened: bool = True) -> None:
        super().__init__("cpu")
        self.kind = "cuda_event"
        self._times = iter(times)
        _Event.waits, _Event.device_time = 0, float("inf") if happened else float("-inf")

    def mark(self):
        self._last = _Event(next(self._times))
        return self._last


def test_wall_intervals_are_delivered_at_once():
    timer = DeviceTimer("cpu")
    got = []
    start = timer.mark()
    timer.interval(start, timer.mark(), got.append)
    assert timer.kind == "wall" and len(got) == 1 and got[0] >= 0 and timer.pending == 0
    assert Communicator().timing == "wall"  # no process group: host wall times


def test_event_intervals_wait_for_nothing_until_settled_once():
    timer = _EventTimer([0.0, 0.25, 1.0, 1.5], happened=False)
    got = []
    for _ in range(2):
        start = timer.mark()
        timer.interval(start, timer.mark(), got.append)
    timer.settle()  # nothing has happened on the device yet: nothing delivered, nothing waited for
    assert got == [] and timer.pending == 2 and _Event.waits == 0
    timer.settle(wait=True)  # where the step waits anyway: one wait, on the last mark, then all are read
    assert _Event.waits == 1 and got == [0.25, 0.5] and timer.pending == 0


def test_event_intervals_that_happened_are_read_without_waiting():
    timer = _EventTimer([0.0, 2.0])
    got = []
    timer.interval(timer.mark(), timer.mark(), got.append)
    timer.settle()
    assert got == [2.0] and _Event.waits == 0


def test_pipeline_clock_summarizes_event_marks_when_read():
    clock = StageClock()
    clock.timer = _EventTimer([10.0, 11.0, 13.0, 15.0, 16.0, 20.0, 30.0], happened=False)
    clock.begin()  # t0 = 10
    with clock.span("forward", 0, 0):  # 11 .. 13
        pass
    with clock.span("backward", 0, 0):  # 15 .. 16
        pass
    clock.end(n_micro=1)  # window closes at 20
    assert _Event.waits == 0  # ending the window waits for nothing
    last = clock.last
    assert _Event.waits >= 1
    assert last["wall_seconds"] == 10.0 and last["busy_seconds"] == 3.0 and last["idle_seconds"] == 7.0
    assert last["bubble_fraction"] == round(7 / 3, 6) and last["spans"][0] == ["forward", 0, 0, 1.0, 3.0]
    clock.begin()  # a new window does not change the summary already read
    assert clock.last is last


def test_pipeline_clock_on_cpu_summarizes_at_the_window_end():
    clock = StageClock(torch.device("cpu"))
    clock.begin()
    with clock.span("forward", 0, 0):
        pass
    clock.end(n_micro=1)
    assert clock._closed is None and clock.last["actions"] == {"forward": 1}
