"""The GPU validation command's CPU-possible parts (docs/gpu.md), so it cannot rot between GPU runs.

``python -m hfzero.testing.gpu_check --device cpu --quick`` runs every section's code on CPU / gloo with
tiny sizes: the world-1 matrix (12 of its 48 cases) against plain AdamW, 2 gloo ranks (parity, prefetch
trace), the fake-world memory check, a Trainer script under ``hfzero run --zero_profile_dir`` with the
dashboard rendering its profile, and the step-time table; the CUDA-only section skips with its reason.
The runner records a section that fails, hangs past its limit or does not exist, and goes on.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hfzero.testing.gpu_check import runner
from hfzero.testing.gpu_check.common import Options, SectionSpec
from hfzero.testing.gpu_check.report import environment, write_json, write_markdown

CPU_SECTIONS = {"matrix", "shared_device", "fake_memory", "trainer_profile", "step_time"}


@pytest.mark.slow
def test_quick_cpu_run_passes_every_cpu_section(tmp_path: Path) -> None:
    out = tmp_path / "check"
    proc = subprocess.run([sys.executable, "-m", "hfzero.testing.gpu_check", "--device", "cpu", "--quick",
                           "--out", str(out)], capture_output=True, text=True, timeout=900)
    report = json.loads((out / "gpu_check.json").read_text())
    status = {s["name"]: s for s in report["sections"]}
    failed = {n: (s["error"], [c for c in s["checks"] if not c["ok"]]) for n, s in status.items() if s["status"] == "fail"}
    assert proc.returncode == 0 and not failed, (failed, proc.stderr[-2000:])
    assert status["cuda_tests"]["status"] == "skip" and "needs CUDA" in status["cuda_tests"]["error"]
    for name in CPU_SECTIONS:
        assert status[name]["status"] == "pass" and status[name]["checks"], name
    assert len(status["matrix"]["checks"]) == 12  # every stage with each dtype, offload and accumulation mixed
    assert status["fake_memory"]["figures"]["summary"]["stage 3"]["num_params"] > 0
    medians = status["step_time"]["figures"]["summary"]["median"]
    assert set(medians) == {"plain", "fsdp2", "zero0", "zero1", "zero2", "zero3"}
    markdown = (out / "gpu_check.md").read_text()
    assert all(f"## {name}: " in markdown for name in status)


@pytest.mark.slow
def test_failures_and_time_outs_are_recorded_and_the_run_goes_on(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    sections = (SectionSpec("no_such_section", 120, 120, "a module that does not exist"),
                SectionSpec("matrix", 1, 1, "cannot finish in one second"))
    monkeypatch.setattr(runner, "SECTIONS", sections)
    options = Options(device="cpu", quick=True, out=str(tmp_path))
    results = runner.run_all(options)
    assert [r.name for r in results] == ["no_such_section", "matrix"]
    assert results[0].status == "fail" and "ModuleNotFoundError" in results[0].error
    assert results[1].status == "fail" and results[1].error.startswith("timed out after 1 s")
    with pytest.raises(ValueError, match="unknown section"):
        runner.run_all(options, ["nope"])
    write_json(tmp_path / "r.json", options, results, environment())
    write_markdown(tmp_path / "r.md", options, results, environment())
    assert json.loads((tmp_path / "r.json").read_text())["passed"] is False
    assert "timed out after 1 s" in (tmp_path / "r.md").read_text()


def test_matrix_comparison_fails_on_drift_skips_and_placement() -> None:
    """The matrix's verdict can fail: a parameter or loss off by more than its derived bound (fp32) or the
    16-bit tolerance, a skipped step, or an offload that did not happen each fail the case (no spawn: the
    comparison alone, against a hand-made float64 reference whose bounds are 1e-5 everywhere)."""
    from hfzero.testing.gpu_check.matrix import Case, compare
    from hfzero.testing.parity import AdamRoundingBound, ParityReference

    ref = {"losses": [2.0, 1.9], "params": {"w": torch.zeros(3)}}
    bound = AdamRoundingBound(3, 1e-3)
    bound.bound.fill_(1e-5)
    ref64 = ParityReference([2.0, 1.9], [], [1e-5, 1e-5], [], torch.zeros(3, dtype=torch.float64), bound,
                            [("w", 0, 3)])
    good = {"losses": [2.0, 1.9], "params": {"w": torch.full((3,), 5e-6)}, "skipped": 0, "offloaded": True}
    case = Case(2, "fp32", True, 1)
    ok, detail = compare(case, good, ref, ref64)
    assert ok and "0.50" in detail  # the share of the bound used is reported
    assert not compare(case, {**good, "params": {"w": torch.tensor([0.0, 2e-5, 0.0])}}, ref, ref64)[0]
    assert not compare(case, {**good, "losses": [2.0, 1.9001]}, ref, ref64)[0]
    assert not compare(case, {**good, "skipped": 1}, ref, ref64)[0]
    assert not compare(case, {**good, "offloaded": False}, ref, ref64)[0]
    assert compare(Case(2, "bf16", True, 1), {**good, "params": {"w": torch.full((3,), 1e-2)}}, ref, ref64)[0]
    assert not compare(Case(2, "bf16", True, 1), {**good, "losses": [2.1, 1.9]}, ref, ref64)[0]
    assert not compare(case, {"error": "RuntimeError: boom"}, ref, ref64)[0]
