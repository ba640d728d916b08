"""ZeroProfiler against a small fake engine implementing exactly the engine interface it relies on.

The fake holds known bytes per role at each phase and counts known collectives, so every recorded
figure has an exact expected value.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from hfzero.config import ZeroConfig
from hfzero.planning.estimate import model_states_bytes
from hfzero.profiler import ZeroProfiler, load_run, summarize
from hfzero.roles import MemoryRole
from hfzero.runtime.lifetime import Installed
from hfzero.testing.spawn import run_distributed


@dataclasses.dataclass
class FakeCommStats:
    calls: int = 0
    elements: int = 0
    bytes: int = 0
    seconds: float = 0.0


class FakeComm:
    timing = "wall"

    def __init__(self) -> None:
        self._stats: dict[str, FakeCommStats] = {}

    def stats(self) -> dict[str, FakeCommStats]:
        return {k: dataclasses.replace(v) for k, v in self._stats.items()}

    def settle_timings(self, *, wait: bool = False) -> None:
        """Wall times are complete at once: nothing to read later (see hfzero/comm/timing.py)."""

    def run(self, kind: str, elements: int, element_size: int = 2) -> None:
        s = self._stats.setdefault(kind, FakeCommStats())
        s.calls += 1
        s.elements += elements
        s.bytes += elements * element_size
        s.seconds += 0.001


class FakeEngine:
    """Stage 2, bf16, SGD with momentum: params 2Ψ, grad shard 2Ψ_p/N, master and momentum 4Ψ_p/N each.

    A bucket's gradients wait in GRAD_BUCKET (transient) during backward; backward's end reduces
    them (one reduce-scatter of Ψ_p); the step all-gathers the parameters (one all-gather of Ψ_p).
    """

    def __init__(self, model: nn.Module, rank: int = 0, world_size: int = 2) -> None:
        self.config = ZeroConfig(stage=2, dtype="bf16")
        self.rank, self.world_size, self.stage = rank, world_size, 2
        self.num_params = sum(p.numel() for p in model.parameters())
        self.num_params_padded = -(-self.num_params // world_size) * world_size
        self.comm = FakeComm()
        self.shard = self.num_params_padded // world_size
        self.held = {MemoryRole.PARAM_FULL: 2 * self.num_params, MemoryRole.MASTER_SHARD: 4 * self.shard,
                     MemoryRole.GRAD_SHARD: 0, MemoryRole.OPTIM_STATE: 0, MemoryRole.GRAD_BUCKET: 0}
        self._backward_end_hooks: list[Callable[[], None]] = []
        self.installed = Installed()  # what unprepare undoes: the profiler records its stop there

    def memory_by_role(self) -> dict[MemoryRole, int]:
        return dict(self.held)

    def add_backward_end_hook(self, fn: Callable[[], None]) -> None:
        self._backward_end_hooks.append(fn)

    def grads_arrive(self) -> None:
        self.held[MemoryRole.GRAD_BUCKET] = 2 * self.num_params_padded

    def end_backward(self) -> None:
        self.comm.run("reduce_scatter", self.num_params_padded)
        self.held[MemoryRole.GRAD_BUCKET] = 0
        self.held[MemoryRole.GRAD_SHARD] = 2 * self.shard
        for hook in self._backward_end_hooks:
            hook()


class FakeOptimizer(torch.optim.Optimizer):
    """Wraps an SGD as ZeroOptimizer wraps its inner optimizer. (Subclassing SGD and calling
    ``super().step()`` would run this instance's step hooks twice once SGD.step is patched by torch.)"""

    def __init__(self, model: nn.Module, engine: FakeEngine) -> None:
        super().__init__(model.parameters(), {"lr": 0.01, "momentum": 0.9})
        self.inner = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        self.engine = engine

    def step(self, closure: None = None) -> None:  # type: ignore[override]
        self.inner.step()
        self.engine.held[MemoryRole.OPTIM_STATE] = 4 * self.engine.shard
        self.engine.held[MemoryRole.GRAD_SHARD] = 0
        self.engine.comm.run("all_gather", self.engine.num_params_padded)


def _setup(seed: int = 0, rank: int = 0, world_size: int = 2) -> tuple[nn.Module, FakeOptimizer, FakeEngine]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))  # Ψ = 195, padded 196
    engine = FakeEngine(model, rank, world_size)
    return model, FakeOptimizer(model, engine), engine


def _train(model: nn.Module, optimizer: FakeOptimizer, engine: FakeEngine, steps: int, micro: int = 1) -> None:
    for step in range(steps):
        for m in range(micro):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + m))
            out = model(x)
            out.register_hook(lambda grad: engine.grads_arrive())
            out.pow(2).mean().backward()
            engine.end_backward()
        optimizer.step()
        optimizer.zero_grad()


def _phases(records: list[dict]) -> list[tuple]:
    return [(r["step"], r["phase"], r["edge"]) if r["kind"] == "phase" else (r["step"], r["kind"])
            for r in records if r["kind"] != "event"]


def test_records_every_phase_with_exact_figures(tmp_path: Path) -> None:
    model, optimizer, engine = _setup()
    wall = time.perf_counter()
    with ZeroProfiler(model, optimizer, tmp_path / "run"):
        _train(model, optimizer, engine, steps=2)
    wall = time.perf_counter() - wall
    run = load_run(tmp_path / "run")
    assert run.warnings == []
    records = run.ranks[0].records
    assert records[0]["event"] == "start" and records[-1]["event"] == "stop" and "exception" not in records[-1]
    # The hooks' time lies inside the profiled region (it is a sum of disjoint intervals of it); it is not bounded
    # by the steps' time: with a model this small, writing a step's records can take longer than the step.
    assert 0 < records[-1]["overhead_seconds"] < wall
    assert 0 < records[-1]["overhead_cpu_seconds"] <= records[-1]["overhead_seconds"] + 1e-3
    assert _phases(records) == [
        (s, *p) for s in (0, 1) for p in (("forward", "begin"), ("forward", "end"), ("backward", "begin"),
                                          ("backward", "end"), ("step", "begin"), ("step", "end"), ("step",))]
    psi, padded, shard = 195, 196, 98
    by_edge = {(r["step"], r["phase"], r["edge"]): r for r in records if r["kind"] == "phase"}
    # Backward begins before the fake's bucket fills; the bucket is transient, not a model state.
    assert by_edge[0, "backward", "begin"]["roles"]["grad_bucket"] == 0
    assert by_edge[0, "backward", "end"]["roles"]["grad_shard"] == 2 * shard
    assert by_edge[0, "backward", "end"]["model_state_bytes"] == 2 * psi + 4 * shard + 2 * shard
    assert by_edge[0, "backward", "end"]["comm"] == {
        "reduce_scatter": {"calls": 1, "elements": padded, "bytes": 2 * padded, "seconds": 0.001}}
    assert by_edge[0, "step", "end"]["comm"]["all_gather"]["elements"] == padded
    assert by_edge[0, "forward", "end"]["comm"] == {} and by_edge[0, "forward", "end"]["micro"] == 1
    for phase in ("forward", "backward", "step"):
        assert by_edge[0, phase, "end"]["seconds"] >= 0

    steps = run.ranks[0].of_kind("step")
    # Step 0 peaks at its end (master and momentum, the grad shard released: 2Ψ + 8 shards); step 1
    # peaks when its new grad shard and the momentum coexist: the formula's 2Ψ + (2 + 8)Ψ_p/N.
    assert steps[0]["model_state_bytes"] == 2 * psi + 8 * shard
    assert steps[1]["model_state_bytes"] == 2 * psi + 10 * shard
    assert steps[1]["roles"]["grad_shard"] == 2 * shard and steps[1]["micro_batches"] == 1
    assert steps[1]["comm"] == {
        "reduce_scatter": {"calls": 1, "elements": padded, "bytes": 2 * padded, "seconds": 0.001},
        "all_gather": {"calls": 1, "elements": padded, "bytes": 2 * padded, "seconds": 0.001}}
    assert steps[1]["seconds"] >= sum(steps[1]["phase_seconds"].values()) - 1e-5
    assert steps[1]["allocator_max"]["rss"] >= steps[1]["allocator"]["rss"] > 0

    header = run.header
    assert header["stage"] == 2 and header["world_size"] == 2 and header["model"]["num_params"] == psi
    assert header["model"]["class"] == "Sequential" and header["dtypes"]["master"] == "fp32"
    prediction = header["prediction"]
    assert prediction["optimizer"] == "sgd_momentum" and prediction["formula"] == "2Ψ + (2 + 8)Ψ/N_d"
    assert prediction["model_state_bytes"] == model_states_bytes(psi, 2, 2, optimizer_k=8)
    rank0 = summarize(run)["ranks"][0]
    assert rank0["model_state_bytes"] == 2 * psi + 10 * shard
    assert rank0["ratio"] == pytest.approx((2 * psi + 10 * shard) / (2 * psi + 10 * psi / 2))
    assert rank0["comm_elements_per_step"] == 2 * padded


def test_a_snapshot_adds_its_figures_under_keys_of_their_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``cuda_snapshot=True`` the step record gains the snapshot's figures; its scatter ratio goes under
    ``snapshot_fragmentation`` and ``fragmentation`` stays the counters' figure of every sample (one series, one
    meaning). The snapshot is faked (a CPU run has none)."""
    from hfzero.profiler.allocator import AllocatorProbe

    snapshot = {"reserved": 8, "allocated": 3, "total_free": 5, "largest_free_block": 2, "reserved_unallocated": 5,
                "fragmentation": 0.6, "segments": [{}, {}]}
    monkeypatch.setattr(AllocatorProbe, "snapshot", lambda self: snapshot)
    model, optimizer, engine = _setup()
    with ZeroProfiler(model, optimizer, tmp_path / "run", cuda_snapshot=True):
        _train(model, optimizer, engine, steps=2)
    records = load_run(tmp_path / "run").ranks[0].records
    ends = {r["step"]: r["allocator"] for r in records
            if r["kind"] == "phase" and (r["phase"], r["edge"]) == ("step", "end")}
    steps = [r for r in records if r["kind"] == "step"]
    assert len(steps) == 2 and sum(r.get("event") == "cuda_snapshot" for r in records) == 2
    for step in steps:
        sample = step["allocator"]
        assert sample["snapshot_fragmentation"] == 0.6 and sample["largest_free_block"] == 2 and sample["segments"] == 2
        assert sample["fragmentation"] == ends[step["step"]]["fragmentation"]  # the heap's, as at the step's end


def test_every_n_steps_and_gradient_accumulation(tmp_path: Path) -> None:
    model, optimizer, engine = _setup()
    with ZeroProfiler(model, optimizer, tmp_path / "run", every_n_steps=2):
        _train(model, optimizer, engine, steps=4, micro=2)
    records = load_run(tmp_path / "run").ranks[0].records
    steps = [r for r in records if r["kind"] == "step"]
    assert [s["step"] for s in steps] == [0, 2]
    assert {r["step"] for r in records if r["kind"] == "phase"} == {0, 2}
    # The step-2 record covers step 2 only, though step 1's collectives ran unrecorded in between.
    assert steps[1]["comm"]["reduce_scatter"]["calls"] == 2 and steps[1]["comm"]["all_gather"]["calls"] == 1
    assert steps[1]["micro_batches"] == 2
    micros = [(r["micro"], r["edge"]) for r in records if r["step"] == 2 and r.get("phase") == "backward"]
    assert micros == [(1, "begin"), (1, "end"), (2, "begin"), (2, "end")]


def test_no_grad_forwards_are_not_recorded_and_stop_detaches(tmp_path: Path) -> None:
    model, optimizer, engine = _setup()
    profiler = ZeroProfiler(model, optimizer, tmp_path / "run").start()
    with torch.no_grad():
        model(torch.randn(2, 8))
    profiler.stop()
    size = (tmp_path / "run" / "rank-0.jsonl").stat().st_size
    _train(model, optimizer, engine, steps=1)
    assert (tmp_path / "run" / "rank-0.jsonl").stat().st_size == size
    kinds = [r.get("event", r["kind"]) for r in load_run(tmp_path / "run").ranks[0].records]
    assert kinds == ["start", "stop"]


def test_exception_is_named_in_the_stop_record(tmp_path: Path) -> None:
    model, optimizer, engine = _setup()
    with pytest.raises(RuntimeError, match="boom"):
        with ZeroProfiler(model, optimizer, tmp_path / "run"):
            model(torch.randn(2, 8))
            raise RuntimeError("boom")
    last = load_run(tmp_path / "run").ranks[0].records[-1]
    assert last["event"] == "stop" and last["exception"] == "RuntimeError"


def test_profiling_changes_neither_training_nor_allocator_counters(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the profiler must not reset or empty the allocator")

    for name in ("reset_peak_memory_stats", "reset_accumulated_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, forbidden)
    plain = _setup(seed=3)
    _train(*plain, steps=3)
    profiled = _setup(seed=3)
    with ZeroProfiler(profiled[0], profiled[1], tmp_path / "run"):
        _train(*profiled, steps=3)
    for a, b in zip(plain[0].parameters(), profiled[0].parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert plain[2].comm.stats() == profiled[2].comm.stats()


def test_rejects_a_plain_optimizer_and_bad_sampling(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="hfzero.prepare"):
        ZeroProfiler(model, torch.optim.SGD(model.parameters(), lr=0.1), tmp_path)
    model, optimizer, _ = _setup()
    with pytest.raises(ValueError, match="every_n_steps"):
        ZeroProfiler(model, optimizer, tmp_path, every_n_steps=0)


def test_restart_into_a_used_directory_replaces_the_old_run(tmp_path: Path) -> None:
    old = tmp_path / "run"
    old.mkdir()
    (old / "rank-5.jsonl").write_text('{"kind": "event"}\n')
    model, optimizer, engine = _setup()
    with ZeroProfiler(model, optimizer, old):
        _train(model, optimizer, engine, steps=1)
    run = load_run(old)
    assert list(run.ranks) == [0] and not (old / "rank-5.jsonl").exists()


def _profile_two_ranks(rank: int, world_size: int, run_dir: str) -> str:
    model, optimizer, engine = _setup(rank=rank, world_size=world_size)
    with ZeroProfiler(model, optimizer, run_dir):
        _train(model, optimizer, engine, steps=2)
    return json.loads(Path(run_dir, f"rank-{rank}.jsonl").read_text().splitlines()[0])["run_id"]


def test_ranks_share_one_run_id_and_one_header(tmp_path: Path) -> None:
    run_ids = run_distributed(_profile_two_ranks, 2, str(tmp_path / "run"))
    assert run_ids[0] == run_ids[1]
    run = load_run(tmp_path / "run")
    assert run.run_id == run_ids[0] and sorted(run.ranks) == [0, 1] and run.warnings == []
    assert run.header["global_world_size"] == 2
    assert [r["dp_rank"] for r in summarize(run)["ranks"]] == [0, 1]


def test_records_are_on_disk_while_the_run_is_live(tmp_path: Path) -> None:
    """Every record is flushed as written: a reader (or a crash) mid-run sees all complete lines."""
    model, optimizer, engine = _setup()
    profiler = ZeroProfiler(model, optimizer, tmp_path / "run").start()
    try:
        _train(model, optimizer, engine, steps=2)
        live = load_run(tmp_path / "run")
        assert live.warnings == [] and not live.ranks[0].stopped
        assert [r["step"] for r in live.ranks[0].of_kind("step")] == [0, 1]
        assert live.ranks[0].records[-1]["kind"] == "step"
    finally:
        profiler.stop()


class SubclassedFakeOptimizer(torch.optim.SGD):
    """An optimizer subclass whose step calls super().step(): once torch has patched SGD.step (any
    SGD built), this instance's step hooks fire twice per step, nested."""

    def __init__(self, model: nn.Module, engine: FakeEngine) -> None:
        super().__init__(model.parameters(), lr=0.01, momentum=0.9)
        self.engine = engine

    def step(self, closure: None = None) -> None:  # type: ignore[override]
        super().step()
        self.engine.comm.run("all_gather", self.engine.num_params_padded)


def test_nested_step_hooks_count_one_step(tmp_path: Path) -> None:
    torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)  # patches SGD.step
    model, _, engine = _setup()
    optimizer = SubclassedFakeOptimizer(model, engine)
    fired = []
    handle = optimizer.register_step_post_hook(lambda *args: fired.append(1))
    with ZeroProfiler(model, optimizer, tmp_path / "run"):
        _train(model, optimizer, engine, steps=2)  # type: ignore[arg-type]
    handle.remove()
    assert len(fired) == 4  # the torch behaviour this guards against
    records = load_run(tmp_path / "run").ranks[0].records
    assert [r["step"] for r in records if r["kind"] == "step"] == [0, 1]
    assert [r["edge"] for r in records if r.get("phase") == "step"] == ["begin", "end"] * 2
