"""The worker harness (hfzero/testing/spawn.py, [Note: worker start]): each worker is a fresh process that sees the
caller's environment and directory as they are now, whichever start method, and a failure is reported by rank."""

from __future__ import annotations

import os
import sys

import pytest

from hfzero.testing import spawn
from hfzero.testing.spawn import WorkerFailure, run_distributed, run_fake_rank

_MARK = "hfzero_test_spawn_mark"


def _look_and_mark(rank: int, world: int) -> dict:
    """What a worker starts with; then it leaves a mark on a module that a later worker must not see."""
    seen = {"pid": os.getpid(), "ppid_is_caller": os.getppid() == int(os.environ["SPAWN_TEST_CALLER"]),
            "env": os.environ.get("SPAWN_TEST_VALUE"), "gone": os.environ.get("SPAWN_TEST_GONE"),
            "cwd": os.getcwd(), "path": sys.path[0], "marked": hasattr(spawn, _MARK),
            "world": int(os.environ["WORLD_SIZE"]), "rank": int(os.environ["RANK"])}
    setattr(spawn, _MARK, True)
    os.environ["SPAWN_TEST_GONE"] = "set by a worker"
    return seen


def _fail_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    return rank


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_each_worker_is_fresh_and_sees_the_callers_environment_now(
        method: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(spawn.START_ENV, method)
    monkeypatch.setenv("SPAWN_TEST_CALLER", str(os.getpid()))
    monkeypatch.delenv("SPAWN_TEST_GONE", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for value in ("first", "second"):  # set after any forkserver started: the worker still sees it
        monkeypatch.setenv("SPAWN_TEST_VALUE", value)
        seen = run_distributed(_look_and_mark, 2)
        assert [s["rank"] for s in seen] == [0, 1] and {s["world"] for s in seen} == {2}
        for s in seen:
            assert s["env"] == value and s["gone"] is None and not s["marked"], s
            assert s["cwd"] == str(tmp_path) and s["path"] == str(tmp_path), s
            assert s["pid"] != os.getpid() and s["ppid_is_caller"] == (method == "spawn"), s
    assert run_fake_rank(_look_and_mark, 8, rank=3)["rank"] == 3


def test_a_failing_rank_is_named_with_its_traceback() -> None:
    with pytest.raises(WorkerFailure, match="rank 1 failed:(.|\n)*rank 1 fails on purpose"):
        run_distributed(_fail_on_rank_1, 2)


def test_the_start_method_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(spawn.START_ENV, "fork")
    with pytest.raises(ValueError, match="use 'spawn' or 'forkserver'"):
        run_distributed(_fail_on_rank_1, 1)
    monkeypatch.delenv(spawn.START_ENV)
    assert spawn.start_method() == "forkserver"  # Linux has it
