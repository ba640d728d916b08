"""Section: the repository's CUDA tests, ``pytest -m cuda`` over the test files that carry the marker.

The files are found by reading them for ``pytest.mark.cuda`` (``marked_files``), so pytest collects those
few files and not the whole suite (the first GPU run spent ~170 s collecting 1,260 tests to run 11), and a
file marked later is included without a list to keep. Run once: a flaky ordering shows up between GPU runs.
Multi-GPU cases skip on one GPU (counted, not failed)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from hfzero.logging import get_logger
from hfzero.testing.gpu_check.common import Checks, Options, SectionSkip

_COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)")
MARKER = "pytest.mark.cuda"

logger = get_logger(__name__)


def marked_files(tests: Path) -> list[Path]:
    """The test files under ``tests`` whose text names the cuda marker, sorted."""
    return sorted(p for p in tests.glob("test_*.py") if MARKER in p.read_text(encoding="utf-8", errors="replace"))


def run(options: Options, checks: Checks) -> dict[str, Any]:
    if options.device != "cuda":
        raise SectionSkip("needs CUDA: every -m cuda test skips without a GPU")
    tests = Path(__file__).resolve().parents[3] / "tests"
    if not tests.is_dir():
        raise SectionSkip(f"no tests folder at {tests} (run from a source checkout)")
    files = marked_files(tests)
    if not checks.add("test files carry the cuda marker", bool(files), [f.name for f in files]):
        return {}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "-rfEs",
                           *map(str, files)], capture_output=True, text=True, cwd=tests.parent)
    logger.info("%s\n%s", proc.stdout[-20000:], proc.stderr[-5000:])  # into the section's log
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    counts = {kind.rstrip("s"): int(n) for n, kind in _COUNTS.findall(tail)}
    failed = [line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    checks.add("pytest -m cuda exits 0 with tests run", proc.returncode == 0 and counts.get("passed", 0) > 0,
               f"{tail}; {failed[:10]}")
    return {"summary": {"files": [f.name for f in files], "returncode": proc.returncode, "summary": tail,
                        "counts": counts, "failed": failed}}
