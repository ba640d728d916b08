"""Section: the repository's CUDA tests (``pytest -m cuda``, whatever files carry the marker), three times
(once with --quick), so a flaky ordering or stream race shows up as a difference between runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from hfzero.testing.gpu_check.common import Checks, Options, SectionSkip

_COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)")


def run(options: Options, checks: Checks) -> dict[str, Any]:
    if options.device != "cuda":
        raise SectionSkip("needs CUDA: every -m cuda test skips without a GPU")
    tests = Path(__file__).resolve().parents[3] / "tests"
    if not tests.is_dir():
        raise SectionSkip(f"no tests folder at {tests} (run from a source checkout)")
    runs = []
    for attempt in range(1 if options.quick else 3):
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                               str(tests)], capture_output=True, text=True, cwd=tests.parent)
        tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
        counts = {kind.rstrip("s"): int(n) for n, kind in _COUNTS.findall(tail)}
        runs.append({"returncode": proc.returncode, "summary": tail, "counts": counts})
        Path(options.out, "logs", f"cuda_tests_{attempt}.log").write_text(proc.stdout + proc.stderr)
        checks.add(f"run {attempt + 1}: pytest -m cuda exit 0 with tests run", proc.returncode == 0
                   and counts.get("passed", 0) > 0, tail)
    # skips are expected for multi-GPU cases (e.g. world 2 in test_offload_cuda.py): counted, not failed
    return {"summary": runs}
