"""Runs the sections, each in a process of its own under its time limit, and writes results as they come.

A section that raises, fails a check, crashes or runs past its limit is recorded as failed with its error
text (a timed-out section's whole process group is killed, spawned ranks included), and the run goes on.
Sections that may share the GPU run ``lanes`` at a time (two by default on CUDA), in ``SECTIONS`` order;
then the ``alone`` ones (step_time), one by one with nothing else running. A run ``deadline_s`` (300 s by
default on a full run) bounds the whole: a section's limit is cut to the time left, and one that cannot
start before the deadline is recorded as failed, not run.

Everything goes under ``options.out``, at most 8 files, written as the run goes (a killed run keeps what
it finished):

- ``results.jsonl``: one JSON line per event, appended: the run's start (options, environment), each
  check and figure as a section records it, each section's end (its whole result);
- ``gpu_check.json`` and ``gpu_check.md``: every section finished so far, rewritten after each;
- ``logs.txt``: each finished section's output (stdout and stderr), appended when it ends; while a
  section runs, its output is in ``running-<name>.log`` (one per lane), removed once appended;
- ``trainer_profile/header.json`` and ``trainer_profile/rank-0.jsonl``: the Trainer run's profile.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from hfzero.logging import get_logger
from hfzero.testing.gpu_check.common import (
    SECTIONS,
    Options,
    SectionResult,
    SectionSpec,
    append_event,
)
from hfzero.testing.gpu_check.report import write_json, write_markdown

logger = get_logger(__name__)

DEADLINE_S = 300
"""A full run's default deadline: five minutes of one H200, so a run, a fix and a second run fit in a
session's fifteen minutes of device time."""

MIN_START_S = 10
"""A section is not started with less than this left before the deadline."""


def _log_tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def run_section(spec: SectionSpec, options: Options, limit: int | None = None) -> SectionResult:
    """Run one section in a child process (a new session, so a time-out kills its ranks too); its output
    goes to ``running-<name>.log`` under ``options.out`` (the caller appends it to logs.txt)."""
    out = Path(options.out)
    limit = limit if limit is not None else (spec.quick_limit_s if options.quick else spec.limit_s)
    log_path = out / f"running-{spec.name}.log"
    fd, result_name = tempfile.mkstemp(prefix=f"gpu_check-{spec.name}-", suffix=".json")
    os.close(fd)
    result_path = Path(result_name)
    result_path.unlink()
    command = [sys.executable, "-m", "hfzero.testing.gpu_check._section", spec.name, options.to_json(),
               str(result_path)]
    started = time.monotonic()
    try:
        with open(log_path, "w", encoding="utf-8") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return SectionResult(spec.name, "fail", time.monotonic() - started, limit,
                                     error=f"timed out after {limit} s (killed); its output is in logs.txt")
        seconds = time.monotonic() - started
        if not result_path.exists():
            return SectionResult(spec.name, "fail", seconds, limit, error=f"the section's process exited with {code} "
                                                                          f"without a result; log tail:\n{_log_tail(log_path)}")
        outcome = json.loads(result_path.read_text(encoding="utf-8"))
        return SectionResult(spec.name, outcome["status"], seconds, limit, outcome.get("figures") or {},
                             outcome.get("checks") or [], outcome.get("error"))
    finally:
        result_path.unlink(missing_ok=True)


class _Run:
    """One run's shared state: the results so far and the files they are written to (lanes share it)."""

    def __init__(self, options: Options, env: dict[str, Any], deadline_s: float | None) -> None:
        self.options = options
        self.env = env
        self.out = Path(options.out)
        self.deadline = None if not deadline_s else time.monotonic() + deadline_s
        self.deadline_s = deadline_s
        self.results: dict[str, SectionResult] = {}
        self._lock = threading.Lock()

    def limit(self, spec: SectionSpec) -> int | None:
        """The section's limit, cut to the time left; None when it cannot start before the deadline."""
        limit = spec.quick_limit_s if self.options.quick else spec.limit_s
        if self.deadline is None:
            return limit
        left = self.deadline - time.monotonic()
        return None if left < MIN_START_S else min(limit, int(left))

    def run(self, spec: SectionSpec) -> SectionResult:
        limit = self.limit(spec)
        if limit is None:
            result = SectionResult(spec.name, "fail", 0.0, 0, error=f"not run: the run's {self.deadline_s:.0f} s "
                                                                    "deadline passed before it could start")
        else:
            logger.info("gpu_check: section %s (limit %d s)", spec.name, limit)
            result = run_section(spec, self.options, limit)
        self.finish(result)
        return result

    def finish(self, result: SectionResult) -> None:
        """Record a finished section: results.jsonl, its output into logs.txt, the reports rewritten."""
        with self._lock:
            self.results[result.name] = result
            append_event(str(self.out), {"event": "section", **dataclasses.asdict(result)})
            running = self.out / f"running-{result.name}.log"
            with open(self.out / "logs.txt", "a", encoding="utf-8") as logs:
                logs.write(f"\n===== {result.name}: {result.status} in {result.seconds:.1f} s =====\n")
                logs.write(running.read_text(errors="replace") if running.exists() else "(no output)\n")
            running.unlink(missing_ok=True)
            ordered = [self.results[s.name] for s in SECTIONS if s.name in self.results]
            ordered += [r for n, r in self.results.items() if n not in {s.name for s in SECTIONS}]
            write_json(self.out / "gpu_check.json", self.options, ordered, self.env)
            write_markdown(self.out / "gpu_check.md", self.options, ordered, self.env)
        logger.info("gpu_check: section %s %s in %.1f s", result.name, result.status, result.seconds)


def run_all(options: Options, names: list[str] | None = None, *, lanes: int = 1,
            deadline_s: float | None = None, env: dict[str, Any] | None = None) -> list[SectionResult]:
    """Run the named sections (default: all), ``lanes`` of the shareable ones at a time, then the ``alone``
    ones; never stops on a failure. Returns the results in ``SECTIONS`` order."""
    known = {s.name: s for s in SECTIONS}
    unknown = [n for n in names or [] if n not in known]
    if unknown:
        raise ValueError(f"unknown section(s) {unknown}; choose from {list(known)}")
    chosen = [s for s in SECTIONS if not names or s.name in names]
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("running-*.log"), *(out / n for n in ("results.jsonl", "logs.txt", "gpu_check.json",
                                                                  "gpu_check.md"))]:
        stale.unlink(missing_ok=True)  # the folder describes one run
    run = _Run(options, env or {}, deadline_s)
    append_event(options.out, {"event": "start", "options": dataclasses.asdict(options), "environment": env or {},
                               "sections": [s.name for s in chosen], "lanes": lanes, "deadline_s": deadline_s})
    shared = [s for s in chosen if not s.alone]
    if lanes > 1 and len(shared) > 1:
        with concurrent.futures.ThreadPoolExecutor(max_workers=lanes) as pool:
            list(pool.map(run.run, shared))
    else:
        for spec in shared:
            run.run(spec)
    for spec in chosen:
        if spec.alone:
            run.run(spec)
    return [run.results[s.name] for s in chosen]
