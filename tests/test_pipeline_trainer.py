"""An unmodified Trainer script (examples/train_clm.py, tiny 2-block GPT-2) under
`hfzero run --nproc_per_node 4 ... --zero_stage S --zero_pp_size 2` (pp=2 x dp=2), S = 1, 2, 3, against the
same script under plain torchrun DDP on 2 ranks with the same --per_device_train_batch_size (per data-parallel
replica under PP: equal global batches) and --gradient_accumulation_steps 2 (the pipeline's micro-batches):
equal per-step training and evaluation losses, saved models (final = best, every checkpoint) that
from_pretrained loads and that equal DDP's, and a PP checkpoint resumed at pp=1 (2 ranks, ZeRO-2) with the
next losses equal. Stage 1 runs the GPipe schedule, stages 2 and 3 1F1B (the default). The stage-2 run is
profiled (--zero_profile_dir): every record carries its (pp, dp) coordinates, and the per-stage memory,
communication and bubble figures hold against the cost model; it logs the global batch over dp replicas.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_integration_common import STEPS, assert_losses_match, clm_args, hfzero_run, losses, run_variants

pytestmark = pytest.mark.slow

VARIANTS = {
    "pp_zero1": ["--zero_stage", "1", "--zero_pp_schedule", "GPipe"],
    "pp_zero2": ["--zero_stage", "2"],
    "pp_zero3": ["--zero_stage", "3", "--zero_param_persistence_threshold", "0"],
}


PROFILED = "pp_zero2"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pp_trainer")
    variants = {**VARIANTS, PROFILED: [*VARIANTS[PROFILED], "--zero_profile_dir", str(root / "profile"),
                                       "--log_level", "info"]}
    return {**run_variants(root, variants, 4, ["--zero_pp_size", "2"]), "profile": root / "profile",
            "profiled_log": root / f"{PROFILED}.log"}


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory).state_dict()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_losses_match_ddp(runs: dict[str, Path], variant: str) -> None:
    ddp = losses(runs["ddp"])
    assert sorted(ddp) == list(range(1, STEPS + 1)) and ddp[STEPS] != ddp[1]
    # 1e-5 relative is ample: measured at most 8.1e-8 (124x under); the weight elements whose rounding Adam
    # amplifies have gradients near 0, so they barely move a loss
    assert_losses_match(losses(runs[variant]), ddp, rel=1e-5)
    assert sorted(losses(runs["ddp"], "eval_loss")) == [2, STEPS]
    assert_losses_match(losses(runs[variant], "eval_loss"), losses(runs["ddp"], "eval_loss"), rel=1e-5)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_saved_models_load_and_match_ddp(runs: dict[str, Path], variant: str) -> None:
    """The final model (the best checkpoint, loaded at the end from the PP shards) and each checkpoint's
    weights are whole HF models equal to DDP's; each checkpoint's shards span the 4 ranks of pp=2 x dp=2."""
    for sub in ("", "checkpoint-2", f"checkpoint-{STEPS}"):
        got, want = _weights(runs[variant] / sub), _weights(runs["ddp"] / sub)
        assert got.keys() == want.keys()
        # Not derived yet (issue 19 item 0): measured worst 0.30 of this (7.3e-7 on a c_fc weight; 0.30 on wte
        # at GPipe): micro-batch gradients summed in another association than DDP's, noise Adam amplifies; a
        # float64 run of the Trainer's (shuffled) batches would bound it per element.
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    manifest = json.loads((runs[variant] / "checkpoint-2" / "zero_optimizer" / "manifest.json").read_text())
    assert manifest["world_size"] == 4 and manifest["pipeline"]["pp_size"] == 2
    assert manifest["pipeline"]["stages_of_rank"] == [[0], [0], [1], [1]]


def test_pp_checkpoint_resumes_at_pp1(runs: dict[str, Path], tmp_path: Path) -> None:
    """The pp=2 x dp=2 ZeRO-3 checkpoint resumed by plain ZeRO-2 on 2 ranks (pp=1, same global batch)."""
    out = tmp_path / "resumed"
    hfzero_run(2, [*clm_args(out), "--zero_stage", "2", "--resume_from_checkpoint",
                   str(runs["pp_zero3"] / "checkpoint-2")])
    original, resumed = losses(runs["pp_zero3"]), losses(out)
    assert_losses_match({s: resumed[s] for s in resumed if s > 2}, {s: original[s] for s in (3, 4)})


def test_profile_under_pp_has_coordinates_and_per_stage_figures(runs: dict[str, Path]) -> None:
    """The profiled pp=2 x dp=2 ZeRO-2 Trainer run: 4 rank files, (pp, dp) on every record, the header's mesh;
    per stage, model states by role equal to the cost model within padding, the dp collectives and P2P bytes of
    every step after the first equal to it, and busy + idle = the schedule's wall time."""
    from hfzero.profiler.reader import load_run, summarize

    run = load_run(runs["profile"])
    assert not run.warnings and sorted(run.ranks) == [0, 1, 2, 3]
    mesh = run.header["pipeline"]
    assert (mesh["pp"], mesh["dp"], mesh["schedule"], mesh["n_micro"], mesh["accumulation"]) == (2, 2, "1F1B", 2,
                                                                                                   "sharded")
    assert run.header["prediction"] is None and mesh["bubble_estimate"] == 0.5
    for rank, log in run.ranks.items():
        assert {(r["pp_rank"], r["dp_rank"]) for r in log.records} == {(rank // 2, rank % 2)}
        assert log.stopped and len(log.of_kind("step")) == STEPS
    table = summarize(run)["pipeline"]
    assert [row["ranks"] for row in table] == [[0, 1], [2, 3]]
    for rank, log in run.ranks.items():
        row = table[rank // 2]
        predicted = mesh["ranks"][row["pp_rank"]]
        pad = 4 * 16  # padding to a multiple of dp per bucket, Adam's step scalars
        for role, value in predicted["model_states_by_role"].items():
            assert abs(row["roles_peak"][role] - value) <= pad, (row["pp_rank"], role, row["roles_peak"], predicted)
        for step in log.of_kind("step")[1:]:
            elements = {kind: stats["elements"] for kind, stats in step["comm"].items()}
            for kind, value in predicted["comm_elements_per_step"].items():
                assert abs(elements.get(kind, 0) - value) <= 4 * 16, (rank, kind, elements, predicted)
            clock = step["pipeline"]
            assert {w: clock["p2p"][w]["bytes"] for w in ("send", "recv")} == clock["p2p_estimate"]
            assert clock["p2p_estimate"]["send"] > 0 and clock["n_micro"] == 2
            assert abs(clock["busy_seconds"] + clock["idle_seconds"] - clock["wall_seconds"]) <= 3e-6
            assert clock["actions"]["forward"] == clock["actions"]["backward"] == 2
            assert clock["actions"].get("loss", 0) == (2 if rank >= 2 else 0)


def test_batch_size_log_counts_data_parallel_replicas(runs: dict[str, Path]) -> None:
    """pp=2 x dp=2: per-device 2 x accumulation 2 x 2 replicas = 8 (the world of 4 would say 16), DDP's figure."""
    assert "Total train batch size (w. parallel, distributed & accumulation) = 8" in runs["profiled_log"].read_text()
