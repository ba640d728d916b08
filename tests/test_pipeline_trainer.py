"""An unmodified Trainer script (examples/train_clm.py, tiny 2-block GPT-2) under
`hfzero run --nproc_per_node 4 ... --zero_stage S --zero_pp_size 2` (pp=2 x dp=2), S = 1, 2, 3, against the
same script under plain torchrun DDP on 2 ranks with the same --per_device_train_batch_size (per data-parallel
replica under PP: equal global batches) and --gradient_accumulation_steps 2 (the pipeline's micro-batches):
equal per-step training and evaluation losses, saved models (final = best, every checkpoint) that
from_pretrained loads and that equal DDP's, and a PP checkpoint resumed at pp=1 (2 ranks, ZeRO-2) with the
next losses equal. Stage 1 runs the GPipe schedule, stages 2 and 3 1F1B (the default). The stage-2 run is
profiled (--zero_profile_dir): every record carries its (pp, dp) coordinates, and the per-stage memory,
communication and bubble figures hold against the cost model; it logs the global batch over dp replicas.

train_clm.py's GPT-2 has no loss type transformers maps, so the Trainer counts every label (T per row of T
tokens) and DDP divides the shifted token-loss sum by T: a pipeline recounting labels the same way matched it.
The token-divisor cases (one spawn each for ZeroTrainer pp=2 x dp=1 and transformers' own Trainer in one
process) train a tiny Llama, whose loss is ForCausalLMLoss (the Trainer counts ``labels[..., 1:]``, T - 1 per
row), on rows whose labels are all valid and on rows with -100 labels: equal losses, gradient norms, evaluation
losses and trained weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_integration_common import STEPS, assert_losses_match, clm_args, hfzero_run, losses, run_variants

from hfzero.testing import run_distributed

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


# ---- the token divisor: a model whose loss shifts the labels, rows with and without -100 labels -------------
DIVISOR_CASES = ("all_valid", "ignored")
SEQ, TRAIN_ROWS, EVAL_ROWS = 16, 24, 8


def _divisor_rows(case: str) -> list[dict[str, torch.Tensor]]:
    """Random token rows; "ignored": a prefix and a suffix of each row's labels -100, of lengths varying by row
    (so the micro-batches of a step hold different numbers of targets), the attention whole (PP's condition)."""
    from hfzero.testing.models import VOCAB

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (TRAIN_ROWS + EVAL_ROWS, SEQ), generator=g)
    rows = []
    for i, row in enumerate(ids):
        labels = row.clone()
        if case == "ignored":
            labels[: i % 5] = -100
            labels[SEQ - (3 * i) % 7:] = -100
        rows.append({"input_ids": row, "labels": labels})
    return rows


def _divisor_trainer(rank: int, world: int, case: str, out_dir: str) -> dict:
    """Three steps of 8 rows (per-device 4 x accumulation 2: the pipeline's 2 micro-batches), an evaluation at
    the end; ZeroTrainer at pp=2 x dp=1 (ZeRO-2, 1F1B) on 2 ranks, transformers' Trainer on 1."""
    from transformers import Trainer, TrainingArguments

    import hfzero
    from hfzero.testing.models import tiny_causal_lm

    common = dict(output_dir=out_dir, max_steps=3, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                  per_device_eval_batch_size=4, eval_strategy="steps", eval_steps=3, learning_rate=1e-3,
                  max_grad_norm=1.0, logging_steps=1, report_to="none", disable_tqdm=True, save_strategy="no",
                  seed=0, lr_scheduler_type="constant", use_cpu=True)
    model = tiny_causal_lm("llama")
    rows = _divisor_rows(case)
    data = dict(train_dataset=rows[:TRAIN_ROWS], eval_dataset=rows[TRAIN_ROWS:])
    if world == 1:
        trainer = Trainer(model=model, args=TrainingArguments(**common), **data)
    else:
        args = hfzero.ZeroTrainingArguments(**common, zero_stage=2, zero_pp_size=2)
        trainer = hfzero.ZeroTrainer(model=model, args=args, **data)
    trainer.train()
    history = trainer.state.log_history
    weights = (trainer.pipeline.full_state_dict() if world > 1
               else {n: t.detach().clone() for n, t in trainer.model.state_dict().items()})
    return {key: {h["step"]: h[key] for h in history if key in h} for key in ("loss", "grad_norm", "eval_loss")} | {
        "weights": weights}


def _divisor_runs(rank: int, world: int, out_dir: str) -> dict[str, dict]:
    return {case: _divisor_trainer(rank, world, case, f"{out_dir}/{case}") for case in DIVISOR_CASES}


@pytest.fixture(scope="module")
def divisor_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    root = tmp_path_factory.mktemp("pp_divisor")
    reference = run_distributed(_divisor_runs, 1, str(root / "reference"), timeout=600)[0]
    pipelined = run_distributed(_divisor_runs, 2, str(root / "pp"), timeout=600)[0]
    return pipelined, reference


@pytest.mark.parametrize("case", DIVISOR_CASES)
def test_token_divisor_is_the_trainers_count(divisor_runs: tuple[dict, dict], case: str) -> None:
    """The Trainer counts T - 1 targets per all-valid row of this Llama (and fewer with -100 labels); the
    pipeline divided its shifted token-loss sum by T per row before (losses and gradient norms 15/16 of DDP's
    on these 16-token rows). Its per-step losses, gradient norms (before clipping) and evaluation loss equal the
    one-process Trainer's, and so do the trained weights (the saved models' bound above)."""
    got, want = divisor_runs[0][case], divisor_runs[1][case]
    assert sorted(want["loss"]) == [1, 2, 3] and sorted(want["eval_loss"]) == [3]
    for key in ("loss", "grad_norm", "eval_loss"):
        assert_losses_match(got[key], want[key], rel=1e-5)
    assert got["weights"].keys() == want["weights"].keys() - {"lm_head.weight"}  # the tied embedding once
    for name, tensor in got["weights"].items():
        torch.testing.assert_close(tensor, want["weights"][name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
