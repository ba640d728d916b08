"""train_clm.py (unmodified Trainer script) under `hfzero run --zero_stage 0|1`: losses equal plain DDP's."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_integration_common import assert_losses_match, clm_args, hfzero_run, losses, torchrun

pytestmark = pytest.mark.slow


def test_stages_0_and_1_match_ddp(tmp_path: Path) -> None:
    torchrun(2, clm_args(tmp_path / "ddp"))
    ddp = losses(tmp_path / "ddp")
    for stage in (0, 1):
        out = tmp_path / f"zero{stage}"
        hfzero_run(2, [*clm_args(out), "--zero_stage", str(stage)])
        assert_losses_match(losses(out), ddp)
