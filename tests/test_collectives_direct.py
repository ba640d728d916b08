"""The communicator's direct asynchronous gather and reduce-scatter (See [Note: direct collectives] in
hfzero/comm/collectives.py) give what the ``torch.distributed`` functions give, and the fallback is taken where
the process group lacks the methods; under torch's profiler the direct calls carry their labels too."""

from __future__ import annotations

import torch

from hfzero.comm.collectives import Communicator
from hfzero.testing import run_distributed


def _gather_and_scatter(rank: int, world: int, direct: bool) -> tuple[list[float], list[float], bool]:
    comm = Communicator(device=torch.device("cpu"))
    comm.all_gather_impl = "all_gather"  # gloo's default is one broadcast per rank: take the gather path
    comm.reduce_scatter_via_all_reduce = False
    if not direct:
        comm._gather_async = comm._scatter_async = None
    took_direct = comm._gather_async is not None and comm._scatter_async is not None
    shard = torch.arange(4, dtype=torch.float32) + 10 * rank
    full = torch.full((4 * world,), -1.0)
    source = torch.arange(4 * world, dtype=torch.float32) * (rank + 1)
    mine = torch.zeros(4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        comm.all_gather(full, shard, async_op=True).wait()
        comm.reduce_scatter(mine, source, async_op=True).wait()
    labels = {event.name for event in profile.events()}
    assert {"hfzero::all_gather", "hfzero::reduce_scatter"} <= labels, sorted(labels)
    stats = comm.stats()
    assert stats["all_gather"].calls == 1 and stats["reduce_scatter"].calls == 1
    return full.tolist(), mine.tolist(), took_direct


def test_direct_and_fallback_collectives_agree():
    direct = run_distributed(_gather_and_scatter, 2, True)
    fallback = run_distributed(_gather_and_scatter, 2, False)
    expected_full = [0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0]
    for rank, ((full_d, mine_d, took), (full_f, mine_f, took_f)) in enumerate(zip(direct, fallback)):
        assert full_d == full_f == expected_full
        expected_mine = [3.0 * (4 * rank + i) for i in range(4)]  # (1 + 2) x this rank's chunk of arange
        assert mine_d == mine_f == expected_mine
        assert not took_f
        assert took == hasattr(torch.distributed.ProcessGroup, "all_gather_single")
