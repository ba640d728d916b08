"""Restart support without processes: which checkpoint a restart resumes from, the global batch on a world
change, `hfzero run` options before the script, and how a failed worker is reported."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from hfzero.integrations import launch
from hfzero.integrations.resume import (BatchDecision, TrainerBatch, complete_steps, keep_global_batch,
                                       newest_common_step, restart_count, resume_checkpoint)

SCRIPT = str(Path(__file__).resolve().parents[1] / "examples" / "train_clm.py")


@pytest.mark.parametrize("saved, now, expected", [
    ((4, 2, 2), (4, 2, 2), BatchDecision(2)),  # nothing changed
    ((4, 2, 2), (4, 2, 1), BatchDecision(4, "x")),  # shrink 2 -> 1 replica: accumulation doubles
    ((4, 4, 1), (4, 4, 2), BatchDecision(2, "x")),  # grow: accumulation halves
    ((4, 1, 2), (4, 1, 4), BatchDecision(1, "x", warning=True)),  # 8 rows is not a multiple of 16
    ((4, 2, 3), (4, 2, 2), BatchDecision(3, "x")),  # 24 = 4 x 3 x 2
    ((4, 2, 3), (4, 2, 4), BatchDecision(2, "x", warning=True)),  # 24 % 16 != 0
    ((4, 2, 2), (8, 2, 1), BatchDecision(2)),  # other factors, same global batch: nothing to say
    ((4, 2, 2), (8, 2, 2), BatchDecision(2, "x", warning=True)),  # the script changed it: kept, warned
])
def test_keep_global_batch(saved: tuple[int, int, int], now: tuple[int, int, int], expected: BatchDecision) -> None:
    decision = keep_global_batch(TrainerBatch(*saved), TrainerBatch(*now))
    assert (decision.accumulation, bool(decision.message), decision.warning) == (
        expected.accumulation, bool(expected.message), expected.warning), decision
    if not decision.warning and decision.message:
        assert TrainerBatch(now[0], decision.accumulation, now[2]).global_batch == TrainerBatch(*saved).global_batch
    if decision.warning and now[:2] == saved[:2]:
        assert "--gradient_accumulation_steps" in decision.message  # says what to set


def test_trainer_batch_record_round_trip() -> None:
    batch = TrainerBatch(per_device=4, accumulation=2, replicas=3)
    assert TrainerBatch.from_dict(json.loads(json.dumps(batch.to_dict()))) == batch
    assert TrainerBatch.from_dict(None) is None and TrainerBatch.from_dict({"per_device": 0}) is None


def _checkpoint(root: Path, step: int, *, manifest: bool = True, state: str | None = "{}",
                previous: bool = False) -> None:
    shards = root / f"checkpoint-{step}" / (".zero_optimizer.previous" if previous else "zero_optimizer")
    shards.mkdir(parents=True)
    if manifest:
        (shards / "manifest.json").write_text("{}")
    if state is not None:
        (root / f"checkpoint-{step}" / "trainer_state.json").write_text(state)


def test_complete_steps_skip_interrupted_saves(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 4, previous=True)  # killed between the shard renames: the complete previous copy counts
    _checkpoint(tmp_path, 6, manifest=False)  # killed before the manifest
    _checkpoint(tmp_path, 8, state=None)  # killed before trainer_state.json
    _checkpoint(tmp_path, 10, state='{"log_hist')  # killed while writing it
    (tmp_path / "checkpoint-x").mkdir()
    assert complete_steps(tmp_path) == [2, 4]
    assert complete_steps(tmp_path / "absent") == []


def test_newest_common_step() -> None:
    assert newest_common_step([[2, 4, 6], [2, 4]]) == 4  # node 1's checkpoint-6 save did not finish
    assert newest_common_step([[2], [4]]) is None
    assert newest_common_step([[]]) is None


def test_auto_resume_only_after_a_restart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    comm = SimpleNamespace(rank=0, world_size=1, all_gather_bytes=lambda b: [b])
    _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 4)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert restart_count() == 0 and resume_checkpoint(str(tmp_path), None, True, comm) is None  # fresh start
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert resume_checkpoint(str(tmp_path), None, True, comm) == str(tmp_path / "checkpoint-4")
    assert resume_checkpoint(str(tmp_path), None, False, comm) is None  # --zero_auto_resume false
    assert resume_checkpoint(str(tmp_path / "empty"), None, True, comm) is None
    # resume_from_checkpoint=True: the newest complete one, not checkpoint-6 whose save was killed; a path: as given
    _checkpoint(tmp_path, 6, manifest=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert resume_checkpoint(str(tmp_path), True, True, comm) == str(tmp_path / "checkpoint-4")
    assert resume_checkpoint(str(tmp_path / "empty"), True, True, comm) is True  # the Trainer reports "none"
    assert resume_checkpoint(str(tmp_path), "elsewhere", True, comm) == "elsewhere"
    # a node whose agent restarted only because another node's worker failed keeps count 0: still a restart
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    peer = json.dumps({"restart": 1, "steps": [2]}).encode()
    two_nodes = SimpleNamespace(rank=0, world_size=2, all_gather_bytes=lambda b: [b, peer])
    assert resume_checkpoint(str(tmp_path), None, True, two_nodes) == str(tmp_path / "checkpoint-2")  # common step


@pytest.mark.parametrize("argv", [
    ["--zero_stage", "2", "--nproc_per_node", "2", SCRIPT, "--output_dir", "o"],
    ["--nproc_per_node", "2", "--zero_stage=2", SCRIPT, "--output_dir", "o"],
    ["--zero_overlap_comm", "--zero_stage", "2", "--nproc_per_node=2", SCRIPT, "--output_dir", "o"],
])
def test_zero_options_before_the_script_are_taken(argv: list[str]) -> None:
    p = launch.plan(argv)
    assert p.env["HFZERO_STAGE"] == "2" and p.torchrun_args.nproc_per_node == "2"
    assert p.torchrun_args.training_script_args == [SCRIPT, "--output_dir", "o"]


@pytest.mark.parametrize("options, message", [
    (["--nnodes", "2:1"], "--nnodes '2:1' is invalid"),
    (["--nnodes", "0"], "--nnodes '0' is invalid"),
    (["--nnodes", "1:2"], "needs a dynamic rendezvous: add --rdzv_backend c10d"),
    (["--nnodes", "2", "--node_rank", "2"], "--node_rank 2 is outside --nnodes 2"),
    (["--max_restarts", "-1"], "--max_restarts -1 is invalid"),
])
def test_bad_node_options_are_refused_before_start(options: list[str], message: str) -> None:
    with pytest.raises(launch.ConfigError, match=message):
        launch.plan([*options, "--nproc_per_node", "1", SCRIPT, "--output_dir", "o", "--zero_stage", "2"])
    launch.plan(["--nnodes", "1:2", "--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:1", "--nproc_per_node",
                 "1", SCRIPT, "--output_dir", "o", "--zero_stage", "2"])  # elastic with c10d: fine


def test_zero_options_without_a_script_say_so() -> None:
    with pytest.raises(launch.ConfigError, match="--zero_stage 2 but no script"):
        launch.plan(["--nproc_per_node", "2", "--zero_stage", "2"])


def test_mixed_precision_conflict_is_refused_before_start() -> None:
    with pytest.raises(launch.ConfigError, match="--bf16 and --zero_dtype fp16 conflict"):
        launch.plan(["--nproc_per_node", "2", SCRIPT, "--bf16", "true", "--zero_dtype", "fp16", "--output_dir", "o"])
    launch.plan(["--nproc_per_node", "2", SCRIPT, "--bf16", "true", "--zero_dtype", "bf16", "--output_dir", "o"])


@pytest.mark.parametrize("user, expected", [(None, "1"), ("0", "0")])
def test_restart_environment_keeps_the_users_setting(monkeypatch: pytest.MonkeyPatch, user: str | None,
                                                     expected: str) -> None:
    import torch.distributed.run

    seen = {}
    monkeypatch.setattr(torch.distributed.run, "run", lambda args: seen.update(
        value=launch.os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")))
    if user is None:
        monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    else:
        monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", user)
    for name in ("HFZERO_STAGE", "ACCELERATE_USE_CPU"):
        monkeypatch.setenv(name, launch.os.environ.get(name, ""))  # restored after the test; launch sets them
        monkeypatch.delenv(name)
    assert launch.launch(["--nproc_per_node", "1", SCRIPT, "--output_dir", "o", "--zero_stage", "2"]) == 0
    assert seen["value"] == expected


def test_failure_message_names_rank_node_and_error(tmp_path: Path) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    error_file = tmp_path / "error.json"
    error_file.write_text(json.dumps({"message": {"message": "ConfigError: bad dtype\nmore", "extraInfo": {
        "py_callstack": "", "timestamp": "100"}}}))
    failures = {1: ProcessFailure(local_rank=1, pid=11, exitcode=1, error_file=str(error_file)),
                3: ProcessFailure(local_rank=3, pid=13, exitcode=-9, error_file=str(tmp_path / "none"))}
    failures[3].timestamp = 200
    args = SimpleNamespace(node_rank=1, max_restarts=1)
    message = launch.failure_message(ChildFailedError("w", failures), args)
    assert message.startswith("worker rank 1 (local rank 1) on node 1 (") and "exited with code 1: ConfigError: bad dtype" \
        in message and "rank(s) 3 on this node failed too" in message and "after 1 restart(s)" in message
    killed = launch.failure_message(ChildFailedError("w", {3: failures[3]}), SimpleNamespace(node_rank=0, max_restarts=0))
    assert "rank 3 (local rank 3) on node 0" in killed and "killed by signal 9 (SIGKILL)" in killed
