"""examples/accelerate_loop.py (ZeroAccelerator custom loop: accumulate, clip, scheduler, save_state):
ZeRO-2 losses equal accelerate's own DDP loop's, and save_state/load_state resumes exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_integration_common import ROOT, assert_losses_match, hfzero_run, torchrun

pytestmark = pytest.mark.slow

LOOP = str(ROOT / "examples" / "accelerate_loop.py")
ARGS = ["--steps", "4", "--batch_size", "2", "--grad_accum", "2", "--max_grad_norm", "0.5", "--n_embd", "32"]


def _losses(out: Path) -> dict[int, float]:
    return {i + 1: v for i, v in enumerate(json.loads((out / "losses.json").read_text()))}


def test_zero_loop_matches_ddp_and_resumes(tmp_path: Path) -> None:
    torchrun(2, [LOOP, "--output_dir", str(tmp_path / "ddp"), "--plain", *ARGS])
    hfzero_run(2, [LOOP, "--output_dir", str(tmp_path / "zero"), "--save_at", "2", *ARGS, "--zero_stage", "2"])
    ddp, zero = _losses(tmp_path / "ddp"), _losses(tmp_path / "zero")
    assert ddp[4] != ddp[1]
    assert_losses_match(zero, ddp)
    state = tmp_path / "zero" / "state-2"
    assert (state / "zero_optimizer_0" / "manifest.json").is_file()
    hfzero_run(2, [LOOP, "--output_dir", str(tmp_path / "resumed"), "--resume_from", str(state), *ARGS,
                   "--zero_stage", "2"])
    assert_losses_match(_losses(tmp_path / "resumed"), zero)

    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(tmp_path / "zero" / "model").num_parameters() > 0
