"""Runs the sections one after another, each in a process of its own under its time limit.

A section that raises, fails a check, crashes or runs past its limit is recorded as failed with its
error text (a timed-out section's whole process group is killed, spawned ranks included), and the run
goes on with the next section. Section output (stdout + stderr) goes to ``<out>/logs/<name>.log``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hfzero.logging import get_logger
from hfzero.testing.gpu_check.common import SECTIONS, Options, SectionSpec

logger = get_logger(__name__)


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


def run_section(spec: SectionSpec, options: Options) -> SectionResult:
    """Run one section in a child process (a new session, so a time-out kills its ranks too)."""
    out = Path(options.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    result_path = out / "logs" / f"{spec.name}.json"
    result_path.unlink(missing_ok=True)
    limit = spec.quick_limit_s if options.quick else spec.limit_s
    command = [sys.executable, "-m", "hfzero.testing.gpu_check._section", spec.name, options.to_json(),
               str(result_path)]
    started = time.monotonic()
    with open(out / "logs" / f"{spec.name}.log", "w", encoding="utf-8") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return SectionResult(spec.name, "fail", time.monotonic() - started, limit,
                                 error=f"timed out after {limit} s (killed); see logs/{spec.name}.log")
    seconds = time.monotonic() - started
    if not result_path.exists():
        tail = (out / "logs" / f"{spec.name}.log").read_text(errors="replace")[-3000:]
        return SectionResult(spec.name, "fail", seconds, limit, error=f"the section's process exited with {code} "
                                                                      f"without a result; log tail:\n{tail}")
    with open(result_path, encoding="utf-8") as f:
        outcome = json.load(f)
    return SectionResult(spec.name, outcome["status"], seconds, limit, outcome.get("figures") or {},
                         outcome.get("checks") or [], outcome.get("error"))


def run_all(options: Options, names: list[str] | None = None) -> list[SectionResult]:
    """Run the named sections (default: all, in ``SECTIONS`` order); never stops on a failure."""
    known = {s.name: s for s in SECTIONS}
    unknown = [n for n in names or [] if n not in known]
    if unknown:
        raise ValueError(f"unknown section(s) {unknown}; choose from {list(known)}")
    results = []
    for spec in SECTIONS:
        if names and spec.name not in names:
            continue
        logger.info("gpu_check: section %s (limit %d s)", spec.name, spec.quick_limit_s if options.quick else spec.limit_s)
        result = run_section(spec, options)
        logger.info("gpu_check: section %s %s in %.1f s", spec.name, result.status, result.seconds)
        results.append(result)
    return results
