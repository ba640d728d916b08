"""Per-rank memory at world sizes this machine cannot spawn (issue 19, item 13): one process acts as rank 0
of a world of 8 and of 64 on torch's fake process group (collectives return at once and move nothing:
losses are meaningless, every tensor's size is real). bf16 + AdamW, stages 1-3, a 120k-parameter GPT-2.

- the model-state bytes the engine holds equal the paper's formula (hfzero.planning.estimate) evaluated on the
  padded parameter count plus Adam's fp32 ``step`` scalar per bucket, and lie within that padding of
  the formula on Ψ: 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N;
- stage 3's unit buffers are the default "resized" ones (See [Note: stage-3 gather buffers]) and hold no
  memory between steps: every unit's storage at 0 bytes, nothing gathered.
One spawn per world size.
"""

from __future__ import annotations

import functools

import pytest

from hfzero.testing import run_fake_rank
from hfzero.testing.fake_world import FakeMemorySpec, measure_rank

STAGES = (1, 2, 3)
WORLDS = (8, 64)


@functools.lru_cache(maxsize=None)
def _results(world: int) -> dict[int, dict]:
    out = run_fake_rank(measure_rank, world, [FakeMemorySpec(stage, steps=3) for stage in STAGES], timeout=600)
    return {r["stage"]: r for r in out}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", STAGES)
def test_model_state_bytes_match_the_formula(world, stage):
    r = _results(world)[stage]
    assert r["world"] == world and r["rank"] == 0
    psi, padded = r["num_params"], r["num_params_padded"]
    for step, measured in enumerate(r["model_state_bytes"]):
        assert measured == r["formula_padded_bytes"], (step, measured, r["formula_padded_bytes"], r["roles_after_step"])
        allowance = 16 * (padded - psi) + 4 * r["buckets"]  # bf16 + Adam: 16 bytes per padding element
        assert 0 <= measured - r["formula_bytes"] <= allowance, (step, measured, r["formula_bytes"])


@pytest.mark.parametrize("world", WORLDS)
def test_stage3_gather_buffers_hold_nothing_between_steps(world):
    r = _results(world)[3]
    assert r["gather_kind"] == "resized"  # the default backing, on the host as on CUDA
    assert r["unit_bytes_after_step"] == [0] * len(r["unit_bytes_after_step"])  # storages at 0 bytes
    assert r["gathered_after_step"] == [0] * len(r["gathered_after_step"])  # every unit released by the step


def test_fake_rank_bad_input_is_named() -> None:
    from hfzero.testing import run_distributed

    with pytest.raises(ValueError, match="outside a world of 8"):
        run_fake_rank(measure_rank, 8, [], rank=8)
    with pytest.raises(ValueError, match="use run_fake_rank"):
        run_distributed(measure_rank, 8, [], backend="fake")
