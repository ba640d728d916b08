"""Stage 3's collectives on one communicator per data-parallel group (issue 19, item 8).

See [Note: one communicator per data-parallel group] in hfzero/runtime/stage3/engine.py. Two checks in
one spawn of 2 gloo ranks:
- building a stage-3 engine creates no process group (so never one with ``use_local_synchronization``,
  which hangs once the default group is bound to a device and groups are split), and its gathers run
  on the data-parallel group itself;
- a stress run: many steps of stage 3 with prefetch of every next unit, several buckets reduced per
  unit and sharded accumulation over 4 micro-batches, equal to single-process AdamW (no hang, no mix)
  within the rounding bounds derived against a float64 run (hfzero/testing/parity.py): a fixed 1e-5
  against an fp32 run holds for one CPU's reduction order and not another's.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

import hfzero
from hfzero.testing.models import tiny_causal_lm
from hfzero.testing.spawn import run_distributed
from hfzero.testing.workloads import TrainSpec, train_reference64, train_zero

STRESS = TrainSpec(model="llama", stage=3, accumulation=4, steps=8, global_batch=8, seq_len=8, bucket_size=1024,
                   extra_config=(("accumulation", "sharded"), ("allgather_bucket_size", 1),
                                 ("param_persistence_threshold", 0)))


def _worker(rank: int, world: int) -> dict:
    created = []
    new_group = dist.new_group

    def recording(*args, **kwargs):
        created.append(sorted(kwargs))
        return new_group(*args, **kwargs)

    dist.new_group = recording
    try:
        model = tiny_causal_lm("llama")
        model, _ = hfzero.prepare(model, torch.optim.AdamW(model.parameters()), hfzero.ZeroConfig(stage=3))
    finally:
        dist.new_group = new_group
    engine = hfzero.get_engine(model)
    same_group = engine.gather_comm.group is engine.comm.group and engine.units[1].comm.group is engine.comm.group
    return {"created": created, "same_group": same_group, "stress": train_zero(rank, world, STRESS)}


def test_one_communicator_and_stress_parity():
    results = run_distributed(_worker, 2, timeout=300)
    ref = train_reference64(STRESS, (2 * STRESS.accumulation,))  # world 2 x 4 micro-batches
    for rank, out in enumerate(results):
        assert out["created"] == [], out["created"]  # no group of its own: nothing any rank could skip
        assert out["same_group"]
        ref.check_losses(out["stress"]["losses"], f"rank {rank} loss")
        ref.check_params(out["stress"]["params"], f"rank {rank} ")
    # and no group anywhere in the library is made with local synchronization
    sources = Path(hfzero.__file__).parent.rglob("*.py")
    assert not [p for p in sources if "use_local_synchronization=True" in p.read_text()]
