"""`hfzero run` on scripts that never import hfzero: an accelerate loop trains with ZeRO (its Accelerator is
a ZeroAccelerator, its optimizer sharded, its memory the stage's) with DDP's losses; a plain torch script,
to which the --zero_* options cannot apply, makes the run fail with "ZeRO was NOT applied"."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_integration_common import ROOT, assert_losses_match, hfzero_run, launch_env, torchrun

from hfzero.planning.estimate import model_states_bytes
from hfzero.integrations.launch import NOT_APPLIED_EXIT
from hfzero.roles import MODEL_STATE_ROLES

pytestmark = pytest.mark.slow

SCRIPTS = ROOT / "tests" / "scripts"


def _read(out: Path) -> tuple[dict[int, float], list[dict]]:
    losses = json.loads((out / "losses.json").read_text())
    return {i + 1: v for i, v in enumerate(losses)}, [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_unmodified_accelerate_script_trains_with_zero(tmp_path: Path) -> None:
    script = str(SCRIPTS / "accelerate_plain.py")
    torchrun(2, [script, "--output_dir", str(tmp_path / "ddp")])
    hfzero_run(2, [script, "--output_dir", str(tmp_path / "zero"), "--zero_stage", "2"])
    ddp, ddp_info = _read(tmp_path / "ddp")
    zero, zero_info = _read(tmp_path / "zero")
    assert ddp_info[0]["accelerator"] == "Accelerator" and ddp_info[0]["memory"] is None
    assert ddp[4] != ddp[1]
    assert_losses_match(zero, ddp)
    psi = zero_info[0]["num_params"]
    want = model_states_bytes(psi, 2, 2, param_bytes=4, grad_bytes=4, optimizer_k=8)  # fp32 + AdamW
    for info in zero_info:
        assert (info["accelerator"], info["optimizer"]) == ("ZeroAccelerator", "ZeroOptimizer")
        states = sum(v for k, v in info["memory"].items() if k in {r.value for r in MODEL_STATE_ROLES})
        assert want <= states <= want * 1.01, (states, want, info["memory"])


def test_zero_stage_auto_picks_the_tables_stage(tmp_path: Path) -> None:
    """`--zero_stage auto` with a budget where the estimator's table (model states + the decoder activation
    model's figure for the loader's batch 2 at the model's 32 positions) fits stage 2 but not 0 or 1."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from hfzero.planning import estimate as est
    from hfzero.planning.autostage import activation_reserve, resolve_auto_stage
    from hfzero.config import ZeroConfig

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=32, vocab_size=128,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))  # as the script's
    psi = sum(p.numel() for p in model.parameters())
    activations, source = activation_reserve(model, ZeroConfig(), (2, 32), 4, torch.device("cpu"))
    assert source == "decoder activation model"
    rows = est.stage_table(psi, 2, 0, activation_bytes=activations, param_bytes=4, grad_bytes=4, optimizer_k=8,
                           persistent_params=psi)
    budget = int(rows[2].total) + 1
    assert rows[1].total > budget
    config = ZeroConfig(stage="auto", memory_budget_bytes=budget)
    assert resolve_auto_stage(config, model, torch.optim.AdamW(model.parameters()), world_size=2,
                              batch=(2, 32)).stage == 2
    script = str(SCRIPTS / "accelerate_plain.py")
    hfzero_run(2, [script, "--output_dir", str(tmp_path), "--steps", "1", "--zero_stage", "auto",
                   "--zero_memory_budget_bytes", str(budget)])
    _, infos = _read(tmp_path)
    assert [info["stage"] for info in infos] == [2, 2]


def test_script_without_trainer_or_accelerator_reports_zero_not_applied(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "hfzero", "run", "--standalone", "--nproc_per_node", "2",
           str(SCRIPTS / "torch_plain.py"), "--zero_stage", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=launch_env())
    assert proc.returncode == NOT_APPLIED_EXIT, proc.stderr[-3000:]
    assert "ZeRO was NOT applied: --zero_stage 2 had no effect" in proc.stderr
