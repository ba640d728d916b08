"""An unmodified Trainer script (examples/train_clm.py, tiny 2-block GPT-2) under
`hfzero run --nproc_per_node 4 ... --zero_stage S --zero_pp_size 2` (pp=2 x dp=2), S = 1, 2, 3, against the
same script under plain torchrun DDP on 2 ranks with the same --per_device_train_batch_size (per data-parallel
replica under PP: equal global batches) and --gradient_accumulation_steps 2 (the pipeline's micro-batches):
equal per-step training and evaluation losses, saved models (final = best, every checkpoint) that
from_pretrained loads and that equal DDP's, and a PP checkpoint resumed at pp=1 (2 ranks, ZeRO-2) with the
next losses equal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_integration_common import STEPS, assert_losses_match, clm_args, hfzero_run, losses, run_variants

pytestmark = pytest.mark.slow

VARIANTS = {
    "pp_zero1": ["--zero_stage", "1"],
    "pp_zero2": ["--zero_stage", "2"],
    "pp_zero3": ["--zero_stage", "3", "--zero_param_persistence_threshold", "0"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return run_variants(tmp_path_factory.mktemp("pp_trainer"), VARIANTS, 4, ["--zero_pp_size", "2"])


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory).state_dict()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_losses_match_ddp(runs: dict[str, Path], variant: str) -> None:
    ddp = losses(runs["ddp"])
    assert sorted(ddp) == list(range(1, STEPS + 1)) and ddp[STEPS] != ddp[1]
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
