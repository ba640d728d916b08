"""ZeRO-R CB: transient communication memory is constant in model size at a fixed configuration.

Two GPT-2s of the same width, 2 and 9 layers deep (Ψ 4.1x apart), train 2 steps on 2 gloo ranks
at stages 2 and 3 with explicit bucket and prefetch sizes, under the profiler. The peaks of the
transient communication roles (gradient staging buckets ``grad_bucket``; at stage 3 the gathered
units ``param_gathered`` and the idle gather buffers ``comm_buffer``) must be equal within one bucket
for both models, while the model states grow with Ψ. Roles are sampled at phase boundaries; the
reducer's staging pool and the stage-3 gather pool keep their buffers for reuse (idle ones reported as
``comm_buffer``), so the sum at a boundary is the high-water mark of what the gathers and buckets
used. Depth, not width, is what grows here: a stage-3 unit is one layer, and a wider layer is a
larger unit, which the gathered bytes cannot go below.
One spawn for all four runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hfzero
from hfzero.profiler import ZeroProfiler, load_run
from hfzero.testing.models import micro_batches, tiny_causal_lm, token_batches
from hfzero.testing.spawn import run_distributed

pytestmark = pytest.mark.slow  # one spawn of 2 ranks: ~15 s on 2 cores

BUCKET = 8192  # elements per gradient bucket (fp32: 32 KiB)
PREFETCH = 16384  # stage 3: elements gathered ahead of use
DEPTHS = (2, 9)
STAGES = (2, 3)
COMM_ROLES = ("grad_bucket", "param_gathered", "comm_buffer")
STATE_ROLES = ("param_full", "param_shard", "grad_full", "grad_shard", "optim_state", "master_shard")


def _peaks(run_dir: Path) -> dict[str, int]:
    """Per role, the peak over every record of the run (rank 0)."""
    peaks: dict[str, int] = {}
    for record in load_run(run_dir).ranks[0].records:
        for role, nbytes in (record.get("roles") or {}).items():
            peaks[role] = max(peaks.get(role, 0), int(nbytes))
    return peaks


def _worker(rank: int, world: int, root: str) -> dict:
    out = {}
    for stage in STAGES:
        for layers in DEPTHS:
            model = tiny_causal_lm("gpt2", hidden=64, layers=layers)
            config = hfzero.ZeroConfig(stage=stage, reduce_bucket_size=BUCKET, allgather_bucket_size=PREFETCH,
                                       param_persistence_threshold=0)
            model, optimizer = hfzero.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
            run_dir = Path(root) / f"stage{stage}-layers{layers}"
            with ZeroProfiler(model, optimizer, run_dir, activations=False):
                for batch in token_batches(2, 2 * world, 16):
                    ids = micro_batches(batch, rank, world, 1)[0]
                    model(input_ids=ids, labels=ids).loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
            if rank == 0:
                out[(stage, layers)] = {"num_params": hfzero.get_engine(model).num_params, **_peaks(run_dir)}
    return out


@pytest.fixture(scope="module")
def peaks(tmp_path_factory) -> dict:
    return run_distributed(_worker, 2, str(tmp_path_factory.mktemp("cb")), timeout=300)[0]


@pytest.mark.parametrize("stage", STAGES)
def test_transient_comm_memory_is_constant_in_model_size(peaks, stage: int) -> None:
    small, large = peaks[(stage, DEPTHS[0])], peaks[(stage, DEPTHS[1])]
    assert large["num_params"] >= 3.9 * small["num_params"]  # about 4x
    states = [sum(run.get(r, 0) for r in STATE_ROLES) for run in (small, large)]
    assert states[1] > 3 * states[0]  # model states grow with the model ...
    comm = [sum(run.get(r, 0) for r in COMM_ROLES) for run in (small, large)]
    # ... the buffers do not: equal within one fp32 bucket
    assert comm[0] > 0 and abs(comm[1] - comm[0]) <= 4 * BUCKET, (stage, small, large)
    if stage == 3:
        assert small.get("param_gathered", 0) > 0 and large.get("param_gathered", 0) > 0
