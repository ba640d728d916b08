"""Micro-batches when the user asks for a pipeline and nothing else: the accumulated batches when they are
enough for the schedule's stages, else each step's batch split into equal parts (the global batch kept), or
one clear error naming the option to change. Pure arithmetic, plus one unmodified Trainer script under
`hfzero run --nproc_per_node 4 ... --zero_pp_size 2` without --gradient_accumulation_steps, against DDP on
the same global batch (it died in every rank with torch's "Number of microbatches (1) must be greater than
or equal to the number of stages (2)" before)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_integration_common import STEPS, assert_losses_match, clm_args, hfzero_run, losses, torchrun

from hfzero.config import ConfigError
from hfzero.parallel.pipeline.microbatches import check_explicit, default_microbatches
from hfzero.parallel.pipeline.schedule import resolve_schedule

ONE_F_ONE_B, ZBV, INTERLEAVED = (resolve_schedule(n) for n in ("1F1B", "ZBVZeroBubble", "Interleaved1F1B"))


def test_accumulated_batches_are_kept_when_enough() -> None:
    assert default_microbatches(8, 4, ONE_F_ONE_B, 2) == 4
    assert default_microbatches(8, 2, ONE_F_ONE_B, 2) == 2


def test_a_batch_is_split_into_enough_micro_batches() -> None:
    assert default_microbatches(4, 1, ONE_F_ONE_B, 2) == 2
    assert default_microbatches(6, 1, ONE_F_ONE_B, 4) == 6  # the smallest divisor of 6 that is >= 4
    assert default_microbatches(8, 1, ZBV, 2) == 4  # two stages per rank: 2 x pp_size
    assert default_microbatches(6, 1, INTERLEAVED, 2) == 2  # whole rounds of pp_size


def test_no_split_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"needs at least 2 micro-batches.*--gradient_accumulation_steps to 2"):
        default_microbatches(1, 1, ONE_F_ONE_B, 2)
    with pytest.raises(ConfigError, match="--zero_pp_n_microbatches 1 is fewer than the 2"):
        check_explicit(1, ONE_F_ONE_B, 2)
    check_explicit(1, INTERLEAVED, 2)  # a looped schedule runs one round of fewer micro-batches


@pytest.mark.slow
def test_trainer_pipeline_without_accumulation_matches_ddp(tmp_path: Path) -> None:
    """4 rows per replica in one batch (split into 2 micro-batches) vs DDP's 2 rows x 2 accumulated."""
    torchrun(2, clm_args(tmp_path / "ddp"))
    log = hfzero_run(4, [*clm_args(tmp_path / "pp"), "--zero_stage", "2", "--zero_pp_size", "2",
                         "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
                         "--log_level", "info"])
    assert "is split into 2 (the global batch is unchanged)" in log
    ddp = losses(tmp_path / "ddp")
    assert sorted(ddp) == list(range(1, STEPS + 1))
    assert_losses_match(losses(tmp_path / "pp"), ddp)
    assert_losses_match(losses(tmp_path / "pp", "eval_loss"), losses(tmp_path / "ddp", "eval_loss"))
