"""What the runner and the sections share: the options, the section table, checks and skips."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any


@dataclasses.dataclass(frozen=True)
class Options:
    """How the check runs.

    Attributes:
        device: "cuda" (the lent GPU, cuda:0) or "cpu" (CI: the same code on CPU / gloo).
        quick: tiny sizes and fewer repetitions (CI); the full run sizes things for one H200.
        out: the output folder (reports, profiles, logs).
    """

    device: str = "cuda"
    quick: bool = False
    out: str = "gpu_check_out"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Options":
        return cls(**json.loads(text))


@dataclasses.dataclass(frozen=True)
class SectionSpec:
    """One section.

    Attributes:
        name: its module (in this package).
        limit_s: time limit of a full run on one H200, seconds (about twice the expected time; the run's
            deadline can shorten it, see runner.py).
        quick_limit_s: time limit with ``--quick`` (only a guard against hangs: generous, since a loaded
            2-core machine ran the quick shared_device past 300 s).
        checks: what it checks (one line).
        alone: whether it must run with nothing else on the machine (it times things); the others may
            share the GPU in lanes (their figures are per-process: allocator statistics, parity, counts).
    """

    name: str
    limit_s: int
    quick_limit_s: int
    checks: str
    alone: bool = False


SECTIONS: tuple[SectionSpec, ...] = (
    SectionSpec("cuda_tests", 120, 600, "the CUDA tests (pytest -m cuda over the files that carry the marker), once"),
    SectionSpec("shared_device", 120, 900, "2 and 4 gloo ranks on cuda:0: parity, host syncs by owner (hfzero's "
                                           "budget), prefetch trace, offload copy stream under the CUDA sanitizer"),
    SectionSpec("matrix", 90, 600, "world-1 NCCL: stages 0-3 x fp32/bf16/fp16 x offload x accumulation 1/2 "
                                   "against plain AdamW"),
    SectionSpec("fake_memory", 90, 600, "rank 0 of a fake world of 8, ~350M parameters, each stage in its own "
                                        "process: model states vs the formula, peaks falling with the stage, the "
                                        "stage 3 gathering every step with its unit buffers empty after it, the engine freed"),
    SectionSpec("trainer_profile", 60, 600, "an unmodified Trainer script under `hfzero run --zero_profile_dir`: "
                                            "profile fields, dashboard renders (where streamlit is installed)"),
    SectionSpec("step_time", 100, 900, "step time at world 1, each system in its own process: hfzero stages 0-3, "
                                       "a plain bf16 loop, the Trainer's recipe, FSDP2", alone=True),
)
"""Every section, in start order. A full run on one H200 is expected to take under three minutes (two
lanes for the sections that may share the GPU, then step_time alone) and is stopped at its deadline, 300 s
by default (runner.py)."""


@dataclasses.dataclass
class SectionResult:
    """The outcome of one section.

    Attributes:
        name: the section's module name.
        status: "pass", "fail" or "skip".
        seconds: wall time of its process.
        limit_s: the time limit it ran under.
        figures: what it measured (JSON-serializable).
        checks: its named checks, each ``{name, ok, detail}``.
        error: exception text, skip reason or time-out message (None when it passed).
    """

    name: str
    status: str
    seconds: float
    limit_s: int
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)
    checks: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    error: str | None = None


class SectionSkip(Exception):
    """Raised by a section that cannot run here (e.g. needs CUDA); the message says why."""


RESULTS_FILE = "results.jsonl"
"""Under ``Options.out``: one JSON object per line, appended as things happen (see runner.py)."""


def append_event(out: str, event: dict[str, Any]) -> None:
    """Append ``event`` as one line to ``<out>/results.jsonl`` in one write (lines of concurrent writers,
    the sections of other lanes, never interleave)."""
    line = (json.dumps(event, default=str) + "\n").encode()
    fd = os.open(os.path.join(out, RESULTS_FILE), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


class Checks:
    """Named pass/fail checks a section accumulates; the section passes when every check passes.

    With ``out`` and ``section``, every check and figure is also appended to ``<out>/results.jsonl`` as it
    is recorded, so a run killed later keeps it.
    """

    def __init__(self, out: str | None = None, section: str = "") -> None:
        self.items: list[dict[str, Any]] = []
        self._out = out
        self._section = section

    def add(self, name: str, ok: bool, detail: Any = "") -> bool:
        item = {"name": name, "ok": bool(ok), "detail": str(detail)[:2000]}
        self.items.append(item)
        if self._out is not None:
            append_event(self._out, {"event": "check", "section": self._section, **item})
        return bool(ok)

    def figure(self, name: str, value: Any) -> Any:
        """Record a figure (e.g. one row of a table) in results.jsonl now; returns ``value``."""
        if self._out is not None:
            append_event(self._out, {"event": "figure", "section": self._section, "name": name, "value": value})
        return value

    def run(self, name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Call ``fn``; an exception becomes a failed check named ``name`` (the section goes on)."""
        try:
            return fn(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - recorded as a failed check with its text
            self.add(name, False, f"{type(error).__name__}: {error}")
            return None

    @property
    def ok(self) -> bool:
        return all(item["ok"] for item in self.items)


def close(a: list[float], b: list[float], atol: float, rtol: float = 0.0) -> tuple[bool, float]:
    """Whether two equal-length lists agree elementwise within ``atol + rtol * |b|``; the worst difference."""
    if len(a) != len(b):
        return False, float("inf")
    worst = max((abs(x - y) for x, y in zip(a, b)), default=0.0)
    return all(abs(x - y) <= atol + rtol * abs(y) for x, y in zip(a, b)), worst


def in_process_group(fn: Any, world_size: int, *args: Any, backend: str) -> Any:
    """``fn(0, world_size, *args)`` in this process as rank 0 of a process group set up here and destroyed
    after: a real one-rank group (``world_size`` 1, gloo or nccl) or a fake world (backend "fake"). A
    section's process is its own, so this saves spawning a rank (a torch import) per world-1 run."""
    import torch
    import torch.distributed as dist

    if backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        store: Any = FakeStore()
    else:
        if world_size != 1:
            raise ValueError("in_process_group: a real backend runs one rank here; spawn larger worlds")
        store = dist.HashStore()
    if backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, store=store, rank=0, world_size=world_size)
    try:
        return fn(0, world_size, *args)
    finally:
        dist.destroy_process_group()
