"""Section: an unmodified Trainer script (tests/scripts/llama_trainer.py, no hfzero import) under
``hfzero run --nproc_per_node 1 ... --zero_stage 2 --zero_profile_dir``; the profile loads without
warnings, its step records carry the device's allocator figures (on CUDA: device "cuda:0" with allocated,
reserved, peak_allocated, peak_reserved filled; on CPU: rss), and every dashboard page renders it
(Streamlit's AppTest, no browser; listed under ``not_run`` where streamlit or plotly is not installed, as on
the lent GPU machine, where only the repository travels). The Trainer's own output goes to a temporary
folder; only the profile (header.json, rank-0.jsonl) stays under ``<out>/trainer_profile``."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from hfzero.logging import get_logger
from hfzero.testing.gpu_check.common import Checks, Options, SectionSkip

CUDA_FIELDS = ("allocated", "reserved", "peak_allocated", "peak_reserved")

logger = get_logger(__name__)


def run(options: Options, checks: Checks) -> dict[str, Any]:
    root = Path(__file__).resolve().parents[3]
    script = root / "tests" / "scripts" / "llama_trainer.py"
    if not script.exists() or not (root / "dashboard" / "app.py").exists():
        raise SectionSkip(f"needs a source checkout ({script} and dashboard/app.py)")
    profile = Path(options.out) / "trainer_profile"
    steps = 2 if options.quick else 3
    with tempfile.TemporaryDirectory(prefix="gpu_check-trainer-") as work:
        command = [sys.executable, "-m", "hfzero", "run", "--nproc_per_node", "1", str(script),
                   "--output_dir", str(Path(work) / "out"), "--max_steps", str(steps), "--per_device_train_batch_size",
                   "4", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none", "--disable_tqdm",
                   "true", "--zero_stage", "2", "--zero_profile_dir", str(profile)]
        if options.device == "cuda":
            command.append("--bf16")
        env = dict(os.environ)
        if options.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=root)
    logger.info("%s\n%s", proc.stdout[-20000:], proc.stderr[-20000:])  # into the section's log
    if not checks.add("hfzero run exits 0", proc.returncode == 0, proc.stderr[-1500:]):
        return {}
    from hfzero.profiler.reader import load_run

    run_dir = profile if (profile / "header.json").exists() else next(p.parent for p in profile.rglob("header.json"))
    loaded = load_run(run_dir)
    checks.add("profile loads without warnings", not loaded.warnings, loaded.warnings)
    records = loaded.ranks[0].of_kind("step")
    checks.add(f"{steps} step records", len(records) == steps, len(records))
    allocator = records[-1]["allocator"] if records else {}
    if options.device == "cuda":
        checks.add("the profile's CUDA fields are filled", loaded.header.get("device_type") == "cuda"
                   and str(allocator.get("device", "")).startswith("cuda")
                   and all(isinstance(allocator.get(k), int) and allocator[k] > 0 for k in CUDA_FIELDS),
                   {k: allocator.get(k) for k in ("device", *CUDA_FIELDS)})
    else:
        checks.add("the profile's host fields are filled", loaded.header.get("device_type") == "cpu"
                   and isinstance(allocator.get("rss"), int) and allocator["rss"] > 0, allocator)
    missing = [m for m in ("streamlit", "plotly") if importlib.util.find_spec(m) is None]
    if not missing:
        checks.run("dashboard pages render", _render, run_dir, checks)
    not_run = [f"dashboard renders ({', '.join(missing)} not installed)"] if missing else []
    return {"summary": {"run_dir": str(run_dir), "device_type": loaded.header.get("device_type"),
                        "allocator_last_step": allocator, "not_run": not_run}}


def _render(run_dir: Path, checks: Checks) -> None:
    from streamlit.testing.v1 import AppTest

    import dashboard
    from dashboard.pages import RUN_VIEWS, RUNS_ENV

    os.environ[RUNS_ENV] = str(run_dir)
    app_file = Path(dashboard.__file__).parent / "app.py"
    for view in RUN_VIEWS:
        if view == "Pipeline stages":
            continue  # needs a pipeline run
        app = AppTest.from_file(str(app_file), default_timeout=60)
        app.session_state["view"] = view
        app.run()
        problems = [e.value for e in app.exception] + [e.value for e in app.error]
        checks.add(f"dashboard '{view}' renders", not problems and bool(app.get("plotly_chart")), problems)
