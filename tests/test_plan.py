"""``hfzero plan``: the paper's Table 1 per stage, ranking and rejection reasons (analytical, in-process),
and one small ``--verify`` run on 2 CPU ranks (the only spawned run here)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from hfzero.planning import estimate as est
from hfzero.planning import plan as planner
from hfzero.cli import main


def _cli_json(*argv: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", *argv, "--json"]) == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize("dp,cells", [(1, (120, 120, 120)), (4, (52.5, 41.3, 30)), (16, (35.6, 21.6, 7.5)),
                                      (64, (31.4, 16.6, 1.88)), (256, (30.4, 15.4, 0.47)), (1024, (30.1, 15.1, 0.12))])
def test_table1_per_stage_for_the_7_5b_model(dp: int, cells: tuple[float, ...]) -> None:
    rows = planner.stage_memory_table(7.5e9, dp, 32e9)
    assert rows[0]["model_states_bytes"] / 1e9 == pytest.approx(120)
    for row, cell in zip(rows[1:], cells):  # the paper prints 3 significant digits (rounded or truncated)
        assert row["model_states_bytes"] / 1e9 == pytest.approx(cell, rel=0.01, abs=0.006)


def test_plan_cli_at_n_d_64_says_which_stages_fit_32gb() -> None:
    result = _cli_json("--params", "7.5e9", "--gpus", "64x32GB", "--seq-len", "1024", "--global-batch", "64")
    stages = {row["stage"]: row for row in result["stages"]}
    assert [round(stages[s]["model_states_bytes"] / 1e9, 2) for s in est.STAGES] == [120.0, 31.41, 16.64, 1.88]
    assert [stages[s]["fits"] for s in est.STAGES] == [False, True, True, True]
    rows = result["configurations"]
    fitting = [r for r in rows if r["fits"]]
    assert fitting and result["best"] == fitting[0]
    assert [r["tokens_per_s"] for r in fitting] == sorted((r["tokens_per_s"] for r in fitting), reverse=True)
    assert all(r["peak_bytes"] <= result["budget_bytes"] for r in fitting)
    rejected = [r for r in rows if not r["fits"]]
    assert rejected and all(r["reason"].startswith("needs ") and "budget" in r["reason"] for r in rejected)
    # without a pipeline the baseline never fits 32 GB at 7.5B, and stage 1 fits its model states alone but
    # not with 20% headroom; split over pp stages they do (stage 0 from pp 8: 120 / 8 = 15 GB)
    assert not any(r["config"]["stage"] <= 1 and r["config"]["pp"] == 1 for r in fitting)
    assert {r["config"]["pp"] for r in fitting if r["config"]["stage"] == 0} == {8}


def test_plan_ranks_the_scale_benchmark_setup_first_for_91m_gpt2(tmp_path) -> None:
    """docs/scale.md's 91M GPT-2 (768 wide, 12 layers, vocab 8192), 4 CPU ranks sharing 24 GiB, 2 x 64 tokens
    per rank, fp32 AdamW: every data-parallel stage fits; stage 0 at the benchmark's micro-batch is first
    (stages 0-2 move 2Ψ, stage 3 3Ψ; ties go to the lower stage and the larger micro-batch)."""
    from transformers import GPT2Config

    GPT2Config(vocab_size=8192, n_positions=128, n_embd=768, n_layer=12, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
               attn_pdrop=0.0).save_pretrained(tmp_path)
    result = _cli_json("--config", str(tmp_path), "--cpu-ranks", "4", "--memory", "24GiB", "--seq-len", "64",
                       "--global-batch", "8", "--dtype", "fp32", "--optimizer", "adamw", "--runtime-bytes", "3e8")
    assert 91e6 < result["workload"]["params"] < 92e6
    best = result["best"]["config"]
    assert (best["stage"], best["dp"], best["tp"], best["pp"], best["micro_batch"]) == (0, 4, 1, 1, 2)
    stage_peaks = {}
    for row in result["configurations"]:
        c = row["config"]
        if (c["dp"], c["micro_batch"], c["checkpointing"]) == (4, 2, False):
            stage_peaks[c["stage"]] = row["memory"]["model_states"]
    assert stage_peaks[0] > stage_peaks[1] > stage_peaks[2] > stage_peaks[3]


def test_plan_rejects_bad_input(capsys) -> None:
    assert main(["plan", "--params", "7.5e9"]) == 2
    assert "--gpus" in capsys.readouterr().err
    assert main(["plan", "--params", "1e9", "--gpus", "8xlots"]) == 2
    assert main(["plan", "--params", "1e9", "--gpus", "8x80GB", "--intra", "carrier-pigeon"]) == 2


def test_verify_measures_what_the_plan_predicts(tmp_path) -> None:
    """One small spawned run (2 gloo ranks, a 0.7M GPT-2): the measured engine peak (model states +
    transient + activations held at once) is within 10% of the prediction, model states exactly."""
    from transformers import GPT2Config

    GPT2Config(vocab_size=2048, n_positions=64, n_embd=128, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
               attn_pdrop=0.0, bos_token_id=0, eos_token_id=0).save_pretrained(tmp_path)
    result = _cli_json("--config", str(tmp_path), "--cpu-ranks", "2", "--memory", "8GiB", "--seq-len", "32",
                       "--global-batch", "4", "--dtype", "fp32", "--optimizer", "adamw", "--verify",
                       "--verify-steps", "2")
    verify = result["verify"]
    predicted, measured = verify["predicted"], verify["measured"]
    assert measured["model_states"] == pytest.approx(predicted["model_states"], rel=1e-3)
    assert measured["activations"] == pytest.approx(predicted["activations"], rel=0.10)
    assert verify["ratio"] == pytest.approx(1.0, abs=0.10)


def _measured_file(tmp_path, **workload) -> str:
    """A benchmarks/scale.py result for the 91M workload (the step times are made up: this checks the reader)."""
    shape = {"world": 4, "batch_per_rank": 2, "seq_len": 64, "dtype": "fp32", "optimizer": "adamw", "rounds": 2,
             **workload}
    rows = [{"system": s, "size": "91M", "num_params": 91_578_624, "median_step_s": t}
            for s, t in (("ddp", 3.0), ("zero0", 3.3), ("zero1", 3.1), ("zero2", 3.2), ("zero3", 3.9))]
    path = tmp_path / "measured.json"
    path.write_text(json.dumps({"workload": shape, "rows": rows}))
    return str(path)


def test_plan_names_the_fastest_measured_configuration_that_fits(tmp_path, capsys) -> None:
    from transformers import GPT2Config

    GPT2Config(vocab_size=8192, n_positions=128, n_embd=768, n_layer=12, n_head=4).save_pretrained(tmp_path)
    argv = ["--config", str(tmp_path), "--cpu-ranks", "4", "--memory", "24GiB", "--seq-len", "64",
            "--global-batch", "8", "--dtype", "fp32", "--optimizer", "adamw", "--runtime-bytes", "3e8"]
    result = _cli_json(*argv, "--measured", _measured_file(tmp_path))
    measured = result["measured"]
    assert measured["ddp_s"] == 3.0 and len(measured["by_label"]) == 4
    assert measured["fastest"]["label"] == "stage 1, dp 4, mb 2 x 1" and measured["fastest"]["step_s"] == 3.1
    assert measured["fastest"]["plan_rank"] > 1  # the estimate ranks stage 0 first; the measurement disagrees
    assert main(["plan", *argv, "--measured", _measured_file(tmp_path)]) == 0
    assert "measured fastest that fits: stage 1, dp 4, mb 2 x 1 (3.100 s/step" in capsys.readouterr().out
    # a measurement of another workload is refused with what to change, not matched by label
    assert main(["plan", *argv, "--measured", _measured_file(tmp_path, world=2)]) == 2
    assert "--cpu-ranks 2" in capsys.readouterr().err
    assert main(["plan", *argv, "--measured", _measured_file(tmp_path, seq_len=128)]) == 2
    assert "--seq-len 128" in capsys.readouterr().err
    assert main(["plan", *argv[:1], str(tmp_path), "--cpu-ranks", "4", "--memory", "24GiB", "--seq-len", "64",
                 "--global-batch", "8", "--dtype", "bf16", "--measured", _measured_file(tmp_path)]) == 2
    assert "--dtype fp32" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{not json")
    assert main(["plan", *argv, "--measured", str(tmp_path / "bad.json")]) == 2
    assert "cannot read it as JSON" in capsys.readouterr().err
