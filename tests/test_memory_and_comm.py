"""Per-rank model-state bytes against the paper's formula, and communication volume per step.

bf16 + Adam: stage 0 = 16Ψ, stage 1 = 4Ψ + 12Ψ/N, stage 2 = 2Ψ + 14Ψ/N, stage 3 = 16Ψ/N. Measured from the live
tensors the engine holds (by role), exactly equal to the formula evaluated on the padded parameter
count plus Adam's scalar ``step`` tensors, and within the padding of the formula on Ψ.
Communication (paper's volume): 2Ψ elements per step per rank for stages 0-2, 3Ψ for stage 3.
"""

from __future__ import annotations

import pytest

from distributed_results import FP32_CASES, MEMORY_CASES, case_id, results
from hfzero.estimate import model_states_bytes

WORLDS = [1, 2, 4]


def _expected_exact(stage: int, padded: int, world: int, buckets: int) -> int:
    shard = world if stage > 0 else 1
    params = 2 * padded if stage < 3 else 2 * padded // shard
    grads = 2 * padded if stage < 2 else 2 * padded // shard
    master, adam = 4 * padded // shard, 8 * padded // shard
    return params + grads + master + adam + 4 * buckets  # + one fp32 `step` scalar per master slice


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("spec", MEMORY_CASES, ids=case_id)
def test_model_state_bytes_match_formula(world, spec):
    for rank, out in enumerate(results(world)[spec]):
        measured = out["peak_model_state_bytes"]
        padded, psi = out["num_params_padded"], out["num_params"]
        assert measured == _expected_exact(spec.stage, padded, world, out["buckets"]), (rank, out["roles"])
        formula = model_states_bytes(psi, world, spec.stage)
        padding_bytes = 16 * (padded - psi) + 4 * out["buckets"]
        assert 0 <= measured - formula <= padding_bytes, (rank, measured, formula)


def test_memory_falls_with_stage_and_world():
    by = {(w, s.stage): results(w)[s][0]["peak_model_state_bytes"] for w in WORLDS for s in MEMORY_CASES}
    for w in (2, 4):
        assert by[(w, 0)] > by[(w, 1)] > by[(w, 2)] > by[(w, 3)]
    assert by[(4, 2)] < by[(2, 2)] < by[(1, 2)]
    assert by[(4, 3)] < by[(2, 3)] < by[(1, 3)]


def _comm_cases():
    # stage 3 gathers parameters for every micro-batch, so its per-step volume is checked at accumulation 1
    return [s for s in FP32_CASES if s.accumulation == 1 or (s.no_sync and s.stage < 3)]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("spec", _comm_cases(), ids=case_id)
def test_elements_moved_per_step_is_two_psi(world, spec):
    out = results(world)[spec][0]
    padded = out["num_params_padded"]
    for step in out["comm_per_step"]:
        if world == 1:
            assert step == {}  # a single rank moves nothing
            continue
        if spec.stage == 0:
            assert step == {"all_reduce": 2 * padded}
        elif spec.stage == 3:
            # all-gather for forward and again for backward (2Ψ) + reduce-scatter Ψ + the clip norm (2)
            assert step == {"reduce_scatter": padded, "all_gather": 2 * padded, "all_reduce": 2}
            assert abs(sum(step.values()) - 3 * out["num_params"]) <= 3 * (padded - out["num_params"]) + 2
            continue
        else:
            # reduce-scatter Ψ + all-gather Ψ, plus the clip norm's one-element all-reduce (counted 2)
            assert step == {"reduce_scatter": padded, "all_gather": padded, "all_reduce": 2}
        assert abs(sum(step.values()) - 2 * out["num_params"]) <= 2 * (padded - out["num_params"]) + 2
