"""The issue-24 Trainer acceptance: an unmodified Trainer script (tests/scripts/moe_trainer.py, a tiny Qwen3-MoE
from config) under `hfzero run --nproc_per_node 4 ... --zero_stage 2 --zero_ep_size 2` (ep2 x edp2, every rank
its own batch) against the same script under plain torchrun DDP on 4 ranks with the same
--per_device_train_batch_size: per-step losses within 2e-4 and the same epochs (the data is sharded over all
4 ranks), and a saved model that from_pretrained loads whole (all 8 experts of each layer) and equal to DDP's.

That EP really ran follows from the run succeeding: `hfzero run` fails a worker that prepared no model, and
hfzero.prepare refuses ep_size=2 without a 2-rank expert-parallel group.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_integration_common import hfzero_run, torchrun

pytestmark = pytest.mark.slow

SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "moe_trainer.py")
STEPS = 4


def _args(out: Path) -> list[str]:
    return [SCRIPT, "--output_dir", str(out), "--max_steps", str(STEPS), "--per_device_train_batch_size", "2",
            "--gradient_accumulation_steps", "2", "--learning_rate", "1e-3", "--max_grad_norm", "0.5",
            "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true",
            "--seed", "0"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ep_trainer")
    torchrun(4, _args(root / "ddp"))
    hfzero_run(4, [*_args(root / "ep"), "--zero_stage", "2", "--zero_ep_size", "2"])
    return root / "ddp", root / "ep"


def _steps(out: Path) -> dict[int, tuple[float, float]]:
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return {h["step"]: (h["loss"], h["epoch"]) for h in history if "loss" in h}


def test_losses_match_ddp(runs: tuple[Path, Path]) -> None:
    ddp, ep = runs
    want, got = _steps(ddp), _steps(ep)
    assert sorted(want) == list(range(1, STEPS + 1)) and want[STEPS][0] != want[1][0]
    assert sorted(got) == sorted(want)
    for step, (loss, epoch) in want.items():
        assert abs(got[step][0] - loss) <= 2e-4, (step, got, want)
        assert got[step][1] == epoch  # 64 examples / (2 per rank x 2 accumulation x 4 ranks) = 4 steps an epoch


def test_saved_model_is_whole_and_equals_ddp(runs: tuple[Path, Path]) -> None:
    from transformers import AutoModelForCausalLM

    ddp, ep = runs
    want = AutoModelForCausalLM.from_pretrained(ddp).state_dict()
    got = AutoModelForCausalLM.from_pretrained(ep).state_dict()
    assert got.keys() == want.keys()
    assert got["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 8  # every expert, gathered over EP
    for name in want:
        assert got[name].shape == want[name].shape
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
