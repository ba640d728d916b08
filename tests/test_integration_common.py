"""Helpers shared by the Trainer integration tests (launch a script, read its per-step losses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CLM = str(ROOT / "examples" / "train_clm.py")
STEPS = 4


def clm_args(out: Path, per_device_batch: int = 2) -> list[str]:
    """train_clm.py arguments: tiny dropout-free GPT-2, accumulation 2, clipping, eval and saves every 2 steps."""
    return [CLM, "--do_train", "--config_name", "tiny", "--config_overrides", "resid_pdrop=0,embd_pdrop=0,attn_pdrop=0",
            "--output_dir", str(out), "--max_steps", str(STEPS), "--per_device_train_batch_size",
            str(per_device_batch), "--gradient_accumulation_steps", "2", "--learning_rate", "1e-3",
            "--max_grad_norm", "0.5", "--logging_steps", "1", "--save_steps", "2", "--eval_strategy", "steps",
            "--eval_steps", "2", "--per_device_eval_batch_size", "8", "--load_best_model_at_end", "true",
            "--report_to", "none", "--disable_tqdm", "true", "--seed", "0"]


def launch(cmd: list[str]) -> None:
    """Run a launcher command; plain torchrun on a CPU host gets ACCELERATE_USE_CPU (as `hfzero run` sets)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not torch.accelerator.is_available():
        env["ACCELERATE_USE_CPU"] = "true"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def torchrun(nproc: int, args: list[str]) -> None:
    launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), *args])


def hfzero_run(nproc: int, args: list[str]) -> None:
    launch([sys.executable, "-m", "hfzero", "run", "--nproc_per_node", str(nproc), *args])


def losses(out: Path) -> dict[int, float]:
    """Per-step training losses the Trainer logged (averaged over ranks), from trainer_state.json."""
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return {h["step"]: h["loss"] for h in history if "loss" in h}


def assert_losses_match(got: dict[int, float], want: dict[int, float], rel: float = 1e-5) -> None:
    assert sorted(got) == sorted(want), (got, want)
    for step in want:
        assert abs(got[step] - want[step]) <= rel * abs(want[step]), (step, got, want)
