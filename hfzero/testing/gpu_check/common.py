"""What the runner and the sections share: the options, the section table, checks and skips."""

from __future__ import annotations

import dataclasses
import json
from typing import Any


@dataclasses.dataclass(frozen=True)
class Options:
    """How the check runs.

    Attributes:
        device: "cuda" (the lent GPU, cuda:0) or "cpu" (CI: the same code on CPU / gloo).
        quick: tiny sizes and fewer repetitions (CI); the full run sizes things for one H100.
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
    """One section: its module (in this package), time limit in seconds (full run on one H100 / quick run:
    the quick limits only guard against hangs on a loaded CI machine), and what it checks (one line)."""

    name: str
    limit_s: int
    quick_limit_s: int
    checks: str


SECTIONS: tuple[SectionSpec, ...] = (
    SectionSpec("cuda_tests", 175, 120, "the CUDA tests (pytest -m cuda), three times"),
    SectionSpec("matrix", 75, 240, "world-1 NCCL: stages 0-3 x fp32/bf16/fp16 x offload x accumulation 1/2 "
                                  "against plain AdamW"),
    SectionSpec("shared_device", 105, 240, "2 and 4 gloo ranks on cuda:0: parity, host syncs, prefetch trace, "
                                           "offload copy stream under the CUDA sanitizer"),
    SectionSpec("fake_memory", 120, 180, "rank 0 of a fake world of 8, ~350M parameters: model states vs the formula, "
                                       "CUDA peak allocated / reserved"),
    SectionSpec("trainer_profile", 60, 240, "an unmodified Trainer script under `hfzero run --zero_profile_dir`: "
                                            "profile fields, dashboard renders"),
    SectionSpec("step_time", 60, 180, "step time of stages 0-3 against a plain loop and FSDP2 at world 1"),
)
"""Every section, in run order. The full run's limits add up to 595 s (under 10 minutes on one H100)."""


class SectionSkip(Exception):
    """Raised by a section that cannot run here (e.g. needs CUDA); the message says why."""


class Checks:
    """Named pass/fail checks a section accumulates; the section passes when every check passes."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    def add(self, name: str, ok: bool, detail: Any = "") -> bool:
        self.items.append({"name": name, "ok": bool(ok), "detail": str(detail)[:2000]})
        return bool(ok)

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
