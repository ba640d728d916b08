"""Models a script loads beside the one its Trainer trains, under `hfzero run` (issue 32): an unmodified Trainer
script (tests/scripts/teacher_trainer.py, no hfzero import) loads a causal-LM teacher and a sequence-
classification reward model with ``from_pretrained`` and only runs them in inference inside ``compute_loss``
(hfzero never prepares them); with ``--sample_first`` it also runs the trained model (a forward and
``generate`` on ``model.device``) before its Trainer is built. Under sharded loading each of those models is
pending until its first forward, which loads it whole, once, with a log line (see [Note: pending weights] in
hfzero/runtime/pending.py). Against the same script under plain torchrun DDP (fp32, 2 ranks): the teacher's
and the reward model's outputs, the sample and the per-step losses are equal (within 1e-6 for the outputs,
1e-5 for the losses), at stage 2 (the trained model never loaded whole before prepare: two loads per rank,
the teacher and the reward model) and at stage 3 with the sample first (three loads per rank). Before the fix
each of these refused the first forward ("cannot run Embedding.forward before hfzero.prepare").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_integration_common import assert_losses_match, hfzero_run, losses, torchrun

pytestmark = pytest.mark.slow

SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "teacher_trainer.py")
STEPS = 3
LOADED = "before hfzero prepared it: read its"
"""The log line of a model loaded whole on first use (PendingWeights.load)."""
RUNS = {"zero2": (["--zero_stage", "2"], False), "zero3": (["--zero_stage", "3"], True)}
"""name -> (hfzero options, sample first). Stage 3 with the default persistence threshold keeps this tiny model's
tensors whole, so the threshold is 0 there: the trained model (read whole before its Trainer) is partitioned."""


def _save_models(root: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from hfzero.testing.models import tiny_causal_lm

    tiny_causal_lm("llama", seed=3).save_pretrained(root / "student")
    tiny_causal_lm("llama", seed=5).save_pretrained(root / "teacher")
    torch.manual_seed(6)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_labels=1,
                         pad_token_id=0)
    LlamaForSequenceClassification(config).save_pretrained(root / "reward")


def _args(root: Path, out: Path, sample_first: bool) -> list[str]:
    return [SCRIPT, "--model_name_or_path", str(root / "student"), "--teacher_name_or_path", str(root / "teacher"),
            "--reward_name_or_path", str(root / "reward"), "--sample_first", str(sample_first).lower(),
            "--output_dir", str(out), "--max_steps", str(STEPS), "--per_device_train_batch_size", "2",
            "--learning_rate", "1e-3", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
            "--disable_tqdm", "true", "--seed", "0", "--use_cpu", "true"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("scripts")
    _save_models(root)
    torchrun(2, _args(root, root / "ddp", sample_first=True))
    for name, (options, sample_first) in RUNS.items():
        threshold = ["--zero_param_persistence_threshold", "0"] if "3" in options else []
        log = hfzero_run(2, [*_args(root, root / name, sample_first), *options, *threshold])
        (root / f"{name}.log").write_text(log)
    return {"ddp": root / "ddp", **{name: root / name for name in RUNS}}


def _outputs(out: Path, rank: int) -> dict:
    return json.loads((out / f"outputs-rank{rank}.json").read_text())


def _close(got: list[float], want: list[float], rel: float = 1e-6) -> bool:
    return len(got) == len(want) and all(abs(g - w) <= rel * max(abs(w), 1.0) for g, w in zip(got, want))


@pytest.mark.parametrize("run", list(RUNS))
def test_models_beside_the_trained_one_compute_what_they_compute_under_ddp(runs: dict[str, Path], run: str) -> None:
    for rank in range(2):
        got, want = _outputs(runs[run], rank), _outputs(runs["ddp"], rank)
        assert len(want["teacher"]) == STEPS and len(want["reward"]) == STEPS
        assert _close(got["teacher"], want["teacher"]), (got["teacher"], want["teacher"])
        assert _close(got["reward"], want["reward"]), (got["reward"], want["reward"])


def test_a_model_run_before_its_trainer_computes_what_it_computes_under_ddp(runs: dict[str, Path]) -> None:
    for rank in range(2):
        got, want = _outputs(runs["zero3"], rank)["sample"], _outputs(runs["ddp"], rank)["sample"]
        assert got["tokens"] == want["tokens"] and _close([got["logits"]], [want["logits"]])


@pytest.mark.parametrize("run", list(RUNS))
def test_training_beside_them_equals_ddp(runs: dict[str, Path], run: str) -> None:
    want = losses(runs["ddp"])
    assert sorted(want) == list(range(1, STEPS + 1))
    assert_losses_match(losses(runs[run]), want, rel=1e-5)


@pytest.mark.parametrize("run, loads", [("zero2", 2), ("zero3", 3)])
def test_each_unprepared_model_loads_once_with_a_log_line(runs: dict[str, Path], run: str, loads: int) -> None:
    """zero2: the teacher and the reward model (the trained model kept its weights in the files until prepare);
    zero3: those and the trained model, run before its Trainer."""
    log = (runs[run].parent / f"{run}.log").read_text()
    lines = [line for line in log.splitlines() if LOADED in line]
    assert len(lines) == 2 * loads, lines  # each rank loads each model itself
