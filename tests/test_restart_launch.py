"""`hfzero run` restarts and node-local checkpoints, end to end (tests/scripts/restart_trainer.py, a tiny Llama).

Two phases of launches run side by side:
1. "kill": `--max_restarts 1` on 2 ranks; rank 1 SIGKILLs itself at the end of step 3 (first start only).
   torchelastic restarts both workers; ZeroTrainer resumes from checkpoint-2 on its own.
   "nodes": two `hfzero run --nnodes 2 --node_rank k --nproc_per_node 1` launchers, each with its own
   output directory (no directory in common) and `--save_on_each_node true`: the uninterrupted reference.
2. "nodes" again with `--resume_from_checkpoint <its node's>/checkpoint-4`: each node resumes from its own copy.
   "world1": the kill run's checkpoint-4 resumed on 1 rank: gradient accumulation 2 -> 4 keeps the global batch.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from test_integration_common import LAUNCH_TIMEOUT_S, launch_env

SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "restart_trainer.py")
ARGS = ["--max_steps", "6", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
        "--learning_rate", "1e-3", "--logging_steps", "1", "--save_steps", "2", "--report_to", "none",
        "--disable_tqdm", "true", "--seed", "0", "--zero_stage", "2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(log: Path, launcher: list[str], script_args: list[str]) -> tuple[subprocess.Popen, Path]:
    handle = open(log, "w")
    proc = subprocess.Popen([sys.executable, "-m", "hfzero", "run", *launcher, SCRIPT, *script_args, *ARGS],
                            stdout=handle, stderr=subprocess.STDOUT, env=launch_env())
    handle.close()
    return proc, log


def _finish(procs: list[tuple[subprocess.Popen, Path]]) -> dict[str, str]:
    logs = {}
    for proc, log in procs:
        try:
            proc.wait(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
        logs[log.stem] = log.read_text()
        assert proc.returncode == 0, f"{log.stem}:\n{logs[log.stem][-6000:]}"
    return logs


def _nodes(root: Path, phase: str, extra: list[str] = ()) -> list[tuple[subprocess.Popen, Path]]:
    port = _free_port()
    return [_start(root / f"{phase}{k}.log", ["--nnodes", "2", "--node_rank", str(k), "--nproc_per_node", "1",
                                              "--master_addr", "127.0.0.1", "--master_port", str(port)],
                   ["--output_dir", str(root / f"node{k}"), "--save_on_each_node", "true",
                    *[a.replace("NODE", f"node{k}") for a in extra]]) for k in (0, 1)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("restart")
    kill = _start(root / "kill.log", ["--standalone", "--nproc_per_node", "2", "--max_restarts", "1"],
                  ["--output_dir", str(root / "kill"), "--kill_at_step", "3"])
    logs = _finish([kill, *_nodes(root, "nodes")])
    resume = _nodes(root, "resume", ["--resume_from_checkpoint", str(root / "NODE" / "checkpoint-4")])
    world1 = _start(root / "world1.log", ["--standalone", "--nproc_per_node", "1"],
                    ["--output_dir", str(root / "world1"), "--resume_from_checkpoint",
                     str(root / "kill" / "checkpoint-4")])
    logs.update(_finish([*resume, world1]))
    return root, logs


def _losses(out: Path) -> dict[int, float]:
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return {h["step"]: h["loss"] for h in history if "loss" in h}


def test_kill_9_restarts_and_resumes_from_the_last_checkpoint(runs: tuple[Path, dict[str, str]]) -> None:
    root, logs = runs
    assert "failed (exitcode: -9) local_rank: 1" in logs["kill"]  # the SIGKILL happened
    assert "restart 1: resuming from" in logs["kill"] and "checkpoint-2, the newest complete" in logs["kill"]
    assert "connectFullMesh" not in logs["kill"]
    reference = _losses(root / "node0")
    assert sorted(reference) == [1, 2, 3, 4, 5, 6]
    assert _losses(root / "kill") == reference  # steps 1-2 before the kill, 3-6 after the restart: equal


def test_node_local_checkpoints_save_and_resume_without_a_shared_directory(
        runs: tuple[Path, dict[str, str]]) -> None:
    root, logs = runs
    for k in (0, 1):
        held = sorted(p.name for p in (root / f"node{k}" / "checkpoint-4" / "zero_optimizer").iterdir())
        assert f"rank0000{k}-of-00002.safetensors" in held and f"rank0000{1 - k}-of-00002.safetensors" not in held
        assert "manifest.json" in held
    # the resumed pair appended steps 5-6 to node 0's log history (loaded from its checkpoint-4)
    assert _losses(root / "node0") == _losses(root / "kill")


def test_resume_on_another_world_size_keeps_the_global_batch(runs: tuple[Path, dict[str, str]]) -> None:
    root, logs = runs
    assert "gradient accumulation 2 -> 4 keeps the global batch of 8" in logs["world1"]
    got, want = _losses(root / "world1"), _losses(root / "kill")
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for step in (5, 6):  # the same samples per step, reduced in another order: float rounding only
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got, want)
