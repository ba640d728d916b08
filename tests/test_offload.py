"""ZeRO-Offload on CPU (gloo, world 2, one spawn): the offload path forced on (host placement, the same
copies, ordering and host accumulation as on a GPU, synchronous here) against the ordinary path, at
stages 0-3 with one micro-batch, two "sharded" and two "local" micro-batches per step (the case
DeepSpeed PR #7981 lost offloaded gradients in); clipping and fp16 overflow; the CPU "nothing to offload"
message; host placement in the profile, meeting the estimator. CUDA checks are in test_offload_cuda.py."""

from __future__ import annotations

import logging
import os

import pytest
import torch

import hfzero
from hfzero.profiler import ZeroProfiler
from hfzero.profiler.reader import load_run, summarize
from hfzero.runtime.offload import FORCE_ENV
from hfzero.testing import run_distributed
from hfzero.testing.models import tiny_causal_lm, token_batches
from hfzero.testing.offload import OffloadCase, train_case
from hfzero.testing.workloads import param_groups

PARITY = [OffloadCase(stage, accumulation, policy, offload=True)
          for stage in (1, 2, 3) for accumulation, policy in ((1, "sharded"), (2, "sharded"), (2, "local"))]
PARITY.append(OffloadCase(0, 2, "local", offload=True))
EXACT = [OffloadCase(2, 2, "sharded", offload=True, fused=False), OffloadCase(3, 2, "local", offload=True, fused=False)]
FP16 = OffloadCase(2, 1, "sharded", dtype="fp16", offload=True, overflow_step=1)
ALL = PARITY + EXACT + [FP16]
RUNS = list(dict.fromkeys([c for case in ALL for c in (case, case.plain())]))
_id = lambda c: f"stage{c.stage}-{c.accumulation}x{c.policy}-{c.dtype}" + ("-foreach" if c.fused is False else "")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _nothing_to_offload(rank: int) -> dict:
    """offload_optimizer on a CPU device without the testing switch: said once on rank 0, ordinary path."""
    os.environ[FORCE_ENV] = "0"
    handler = _Records()
    logging.getLogger("hfzero.runtime.offload").addHandler(handler)
    engines = []
    for _ in range(2):
        model = tiny_causal_lm("gpt2")
        model, _ = hfzero.prepare(model, torch.optim.AdamW(model.parameters()),
                                  hfzero.ZeroConfig(stage=2, offload_optimizer=True))
        engines.append(hfzero.get_engine(model))
    logging.getLogger("hfzero.runtime.offload").removeHandler(handler)
    return {"messages": [m for m in handler.messages if "nothing to offload" in m],
            "offloaded": [e.offload is not None for e in engines],
            "separate_master": [e.master_flat is not None for e in engines],
            "host_roles": [len(e.host_memory_by_role()) for e in engines]}


def _profiled(rank: int, world: int, run_dir: str) -> None:
    """Two profiled steps at stage 2, fp32, the offload path forced on."""
    os.environ[FORCE_ENV] = "1"
    model = tiny_causal_lm("gpt2")
    model, optimizer = hfzero.prepare(model, torch.optim.AdamW(param_groups(model), lr=1e-3),
                                      hfzero.ZeroConfig(stage=2, reduce_bucket_size=4096, offload_optimizer=True))
    with ZeroProfiler(model, optimizer, run_dir):
        for batch in token_batches(2, 8, 16):
            mine = batch.chunk(world)[rank]
            optimizer.backward(model(input_ids=mine, labels=mine).loss)
            optimizer.step()
            optimizer.zero_grad()


def _resumed(rank: int, world: int, directory: str) -> list[dict[str, torch.Tensor]]:
    """Stage 3, the offload path forced on: 3 steps straight, and 2 steps, checkpoint, a fresh offloaded
    engine loads it, 1 more step. Returns both runs' final parameters."""
    os.environ[FORCE_ENV] = "1"
    batches = token_batches(3, 8, 16)
    finals = []
    for resume in (False, True):
        model = tiny_causal_lm("gpt2")
        config = hfzero.ZeroConfig(stage=3, reduce_bucket_size=4096, offload_optimizer=True, param_persistence_threshold=0)
        model, optimizer = hfzero.prepare(model, torch.optim.AdamW(param_groups(model), lr=1e-3), config)
        for step, batch in enumerate(batches):
            if resume and step == 2:
                hfzero.save_checkpoint(directory, model, optimizer)
                model = tiny_causal_lm("gpt2", seed=1)  # other weights: the checkpoint must restore them
                model, optimizer = hfzero.prepare(model, torch.optim.AdamW(param_groups(model), lr=1e-3), config)
                hfzero.load_checkpoint(directory, model, optimizer)
            mine = batch.chunk(world)[rank]
            optimizer.backward(model(input_ids=mine, labels=mine).loss)
            optimizer.step()
            optimizer.zero_grad()
        finals.append(hfzero.full_state_dict(model, rank0_only=False))
    return finals


def _worker(rank: int, world: int, run_dir: str, checkpoint_dir: str) -> dict:
    out = {"nothing": _nothing_to_offload(rank)}
    out["runs"] = [train_case(rank, world, case) for case in RUNS]
    _profiled(rank, world, run_dir)
    out["resumed"] = _resumed(rank, world, checkpoint_dir)
    return out


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("offload-profile"))
    checkpoint_dir = str(tmp_path_factory.mktemp("offload-checkpoint") / "ckpt")
    per_rank = run_distributed(_worker, 2, run_dir, checkpoint_dir, timeout=600)
    return {"ranks": per_rank, "run_dir": run_dir}


def _runs(outputs, case: OffloadCase) -> list[dict]:
    index = RUNS.index(case)
    return [rank["runs"][index] for rank in outputs["ranks"]]


def _assert_same(offloaded: dict, plain: dict, atol: float, what: str) -> None:
    torch.testing.assert_close(torch.tensor(offloaded["losses"]), torch.tensor(plain["losses"]), atol=atol, rtol=0,
                               msg=lambda m: f"{what} losses: {m}")
    torch.testing.assert_close(torch.tensor(offloaded["norms"]), torch.tensor(plain["norms"]), atol=atol, rtol=0,
                               equal_nan=True, msg=lambda m: f"{what} clip norms: {m}")
    assert offloaded["skipped"] == plain["skipped"], what
    for name, value in plain["params"].items():
        torch.testing.assert_close(offloaded["params"][name], value, atol=atol, rtol=0,
                                   msg=lambda m: f"{what} parameter {name}: {m}")


@pytest.mark.parametrize("case", PARITY, ids=_id)
def test_offload_matches_the_ordinary_path(outputs, case):
    """fp32, host step on fused CPU AdamW on both paths (a CPU engine steps on the host too): within 1e-6."""
    for rank, (off, plain) in enumerate(zip(_runs(outputs, case), _runs(outputs, case.plain()))):
        assert off["offloaded"] and not plain["offloaded"]
        # every bucket went through the host, every synchronizing backward (two per step when "sharded")
        assert off["pushed"] > 0
        # copies start as buckets complete, while backward still computes the other gradients
        assert off["early_pushes"] > 0
        assert off["device_grad_shard"] is (case.stage < 2 and plain["device_grad_shard"])
        assert off["fused"] == [True, True]
        expected = {"master_shard", "optim_state", "grad_bucket", "grad_shard" if case.stage >= 2 else "grad_fp32"}
        assert set(off["host_roles"]) == expected
        _assert_same(off, plain, 1e-6, f"rank {rank}")


def test_several_backward_passes_accumulate_on_the_host(outputs):
    """With two sharded micro-batches every bucket is pushed twice per step and ADDed on the host; with
    "local" once. Losing one micro-batch's gradients (DeepSpeed PR #7981) would break the parity above;
    here the push counts show the host received both."""
    sharded = _runs(outputs, OffloadCase(2, 2, "sharded", offload=True))[0]["pushed"]
    local = _runs(outputs, OffloadCase(2, 2, "local", offload=True))[0]["pushed"]
    assert sharded == 2 * local > 0


@pytest.mark.parametrize("case", EXACT, ids=_id)
def test_offload_with_foreach_is_exact(outputs, case):
    """fused=False keeps the host step on foreach on both paths: the offload path (copies, host
    accumulation, uploads) adds no rounding of its own in fp32."""
    for rank, (off, plain) in enumerate(zip(_runs(outputs, case), _runs(outputs, case.plain()))):
        assert off["fused"] == [False, False]
        _assert_same(off, plain, 0.0, f"rank {rank}")


def test_fp16_overflow_skips_the_offloaded_step_on_every_rank(outputs):
    for rank, (off, plain) in enumerate(zip(_runs(outputs, FP16), _runs(outputs, FP16.plain()))):
        assert off["skipped"] == [False, True, False] == plain["skipped"], f"rank {rank}"
        _assert_same(off, plain, 1e-3, f"rank {rank}")  # fp16 parameters: a few ulps of fp16 at most


def test_cpu_device_says_once_that_there_is_nothing_to_offload(outputs):
    first, second = (rank["nothing"] for rank in outputs["ranks"])
    assert len(first["messages"]) == 1 and "already live in host memory" in first["messages"][0]
    assert second["messages"] == []  # rank 0 only
    for rank in (first, second):
        assert rank["offloaded"] == [False, False]
        assert rank["separate_master"] == [False, False]  # fp32: the parameters are their own master
        assert rank["host_roles"] == [0, 0]


def test_profile_counts_host_resident_states_and_meets_the_estimate(outputs):
    run = load_run(outputs["run_dir"])
    header = run.header
    assert header["placement"] == {"offloaded": True, "pinned": False, "pinned_roles": [],
                                   "host_roles": ["master_shard", "optim_state", "grad_shard", "grad_bucket"]}
    # a CPU device pins nothing; the field is there in every record and the summary reads it
    assert all(r["pinned_bytes"] == 0 for log in run.ranks.values() for r in log.records)
    assert {rank["pinned_bytes"] for rank in summarize(run)["ranks"]} == {0}
    prediction = header["prediction"]
    model, n = header["model"], header["world_size"]
    padding = (model["num_params_padded"] - model["num_params"]) / n
    # fp32 + AdamW offloaded at stage 2: host 16Ψ/N (master 4, moments 8, fp32 gradients 4), device 4Ψ
    assert prediction["host_model_state_bytes"] == pytest.approx(16 * model["num_params"] / n)
    assert prediction["device_model_state_bytes"] == pytest.approx(4 * model["num_params"])
    assert prediction["model_state_bytes"] == prediction["device_model_state_bytes"] + prediction["host_model_state_bytes"]
    for log in run.ranks.values():
        steps = log.of_kind("step")
        assert len(steps) == 2
        for step in steps:
            host = step["host_model_state_bytes"]
            assert set(step["host_roles"]) == set(header["placement"]["host_roles"])
            # measured = predicted + padding (and Adam's step counters, one scalar per bucket and state)
            assert 0 <= host - prediction["host_model_state_bytes"] <= 16 * padding + 256
            device = step["model_state_bytes"] - host
            assert 0 <= device - prediction["device_model_state_bytes"] <= 4 * padding * n
            assert "grad_shard" not in {r for r, b in step["roles"].items() if b > step["host_roles"].get(r, 0)}


def test_offloaded_checkpoint_resumes_exactly(outputs):
    """Master weights and optimizer states saved from host memory and loaded back into a fresh offloaded
    engine (its uploads ordered before the next gather) continue the run bit for bit."""
    for rank in outputs["ranks"]:
        straight, resumed = rank["resumed"]
        for name, value in straight.items():
            torch.testing.assert_close(resumed[name], value, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")
