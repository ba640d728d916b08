"""The issue-12 Trainer acceptance: an unmodified Trainer script (tests/scripts/llama_trainer.py, a tiny Llama
from config) under `hfzero run --nproc_per_node 4 ... --zero_stage 2 --zero_tp_size 2 --gradient_checkpointing
--zero_partition_activations true` (dp=2 x tp=2) against the same script under plain torchrun DDP on 2 ranks with
the same --per_device_train_batch_size (per data-parallel replica under TP: equal global batches): per-step losses
within 2e-4, the data sharded over dp (the Trainer counts dp = world / tp replicas: same epochs per step), and a
saved model that from_pretrained loads, whole (unsharded) and equal to DDP's. Its checkpoint-2 (weights and the
dp x tp ZeRO shards, see [Note: tensor-parallel checkpoints]) resumes at tp=1 on 2 ranks (ZeRO-2) with the next
losses equal.

That TP really ran follows from the run succeeding: `hfzero run` fails a worker that prepared no model
([Note: ZeRO not applied]) and hfzero.prepare refuses tp_size=2 without a 2-rank TP group. The TP run is also
profiled (--zero_profile_dir): per rank, P_a's checkpoints are measured at exactly half the unpartitioned layer
inputs the header's activation_prediction gives, all saved activations within 10% of its `saved`, and every
record carries the rank's (dp_rank, tp_rank).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_integration_common import hfzero_run, log_history, torchrun

pytestmark = pytest.mark.slow

SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "llama_trainer.py")
STEPS = 4


def _args(out: Path) -> list[str]:
    return [SCRIPT, "--output_dir", str(out), "--max_steps", str(STEPS), "--per_device_train_batch_size", "2",
            "--gradient_accumulation_steps", "2", "--learning_rate", "1e-3", "--max_grad_norm", "0.5",
            "--logging_steps", "1", "--save_steps", "2", "--report_to", "none", "--disable_tqdm", "true",
            "--seed", "0", "--gradient_checkpointing", "--eval_strategy", "steps", "--eval_steps", "2",
            "--per_device_eval_batch_size", "4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    root = tmp_path_factory.mktemp("tp_trainer")
    torchrun(2, _args(root / "ddp"))
    log = hfzero_run(4, [*_args(root / "tp"), "--zero_stage", "2", "--zero_tp_size", "2",
                         "--zero_partition_activations", "true", "--zero_profile_dir", str(root / "profile")])
    return root / "ddp", root / "tp", log


def test_profile_measures_partitioned_checkpoints(runs: tuple[Path, Path, str]) -> None:
    from hfzero.profiler.reader import load_run

    _, tp, _ = runs
    run = load_run(tp.parent / "profile")
    assert not run.warnings and sorted(run.ranks) == [0, 1, 2, 3]
    predicted = run.header["activation_prediction"]
    inputs, shape = predicted["inputs"], predicted["inputs"]["shape"]
    assert (inputs["tp"], inputs["partition"], inputs["checkpointing"], inputs["cpu"]) == (2, True, True, False)
    # the layer inputs unpartitioned: L checkpoints of (b, s, h) elements of e bytes; P_a keeps half on each rank
    whole = (shape["num_layers"] * inputs["batch_size"] * inputs["seq_len"] * shape["hidden_size"]
             * inputs["dtype_bytes"])
    assert 0 < whole // 2 <= predicted["checkpoints"]  # the prediction's adds the shared inputs (rotary tables)
    for rank, log in run.ranks.items():
        assert log.stopped and len(log.of_kind("step")) == STEPS
        # rank = dp_rank * tp + tp_rank (TP ranks are neighbours), on every record
        assert {(r["pp_rank"], r["dp_rank"], r["tp_rank"]) for r in log.records} == {(0, rank // 2, rank % 2)}
        for step in log.of_kind("step"):
            roles = step["roles"]
            assert roles["act_checkpoint"] == whole // 2, (rank, roles)
            saved = roles["activations"] + roles["act_checkpoint"]
            assert saved == pytest.approx(predicted["saved"], rel=0.10), (rank, roles, predicted)


def _steps(out: Path, key: str = "loss") -> dict[int, tuple[float, float]]:
    return {h["step"]: (h[key], h["epoch"]) for h in log_history(out) if key in h}


def test_losses_match_ddp_on_the_dp_replicas(runs: tuple[Path, Path, str]) -> None:
    ddp, tp, _ = runs
    want, got = _steps(ddp), _steps(tp)
    assert sorted(want) == list(range(1, STEPS + 1)) and want[STEPS][0] != want[1][0]
    assert sorted(got) == sorted(want)
    for step, (loss, epoch) in want.items():
        assert abs(got[step][0] - loss) <= 2e-4, (step, got, want)
        assert got[step][1] == epoch  # 64 examples / (2 per replica x 2 accumulation x dp 2) = 8 steps an epoch
    # evaluation: 12 sequences over dp=2 in batches of 4 (the last one short: the remainder is dropped at
    # the right place only when gather_for_metrics keeps one TP rank per replica)
    want, got = _steps(ddp, "eval_loss"), _steps(tp, "eval_loss")
    assert sorted(want) == sorted(got) == [2, STEPS]
    for step, (loss, _) in want.items():
        assert abs(got[step][0] - loss) <= 2e-4, (step, got, want)


@pytest.mark.parametrize("sub", ["", "checkpoint-2"])
def test_saved_model_is_whole_and_equals_ddp(runs: tuple[Path, Path, str], sub: str) -> None:
    from transformers import AutoModelForCausalLM

    ddp, tp, _ = runs
    want = AutoModelForCausalLM.from_pretrained(ddp / sub).state_dict()
    got = AutoModelForCausalLM.from_pretrained(tp / sub).state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].shape == want[name].shape  # full tensors, not TP shards
        # TP splits matmul sums over 2 ranks, so elements carry reduction noise Adam can amplify (issue 19,
        # parity.py); measured worst 0.073 of this tolerance (9.4e-7, a down_proj weight), so another order's
        # noise up to ~8x this one's (parity.py's K) still holds. Losses were equal to DDP's bit for bit.
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_tp_checkpoint_resumes_at_tp1(runs: tuple[Path, Path, str], tmp_path: Path) -> None:
    _, tp, _ = runs
    manifest = json.loads((tp / "checkpoint-2" / "zero_optimizer" / "manifest.json").read_text())
    assert manifest["world_size"] == 4 and manifest["tensor_parallel"] == {"tp_size": 2, "dp_size": 2}
    out = tmp_path / "resumed"
    hfzero_run(2, [*_args(out), "--zero_stage", "2", "--resume_from_checkpoint", str(tp / "checkpoint-2")])
    resumed, original = _steps(out), _steps(tp)  # the resumed log repeats steps 1-2 from checkpoint-2's state
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):
        assert abs(resumed[step][0] - original[step][0]) <= 2e-4, (step, resumed, original)
