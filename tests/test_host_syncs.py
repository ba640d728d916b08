"""Host synchronizations per optimizer step (issue 19, item 3): at most one, none per micro-batch.

Counted on CPU by the proxy of ``hfzero.testing.host_syncs`` (hfzero's own calls of the APIs that
synchronize on an accelerator; see [Note: host-sync budget]), world 2, stages 0-3, 1 and 4
micro-batches per step, fp32 and fp16 (whose overflow flag is read with the step's checks), in one spawn.
The checks whose reads moved to the step still raise there: a rank whose stage-3 gathers departed from the
others' raises GatherOrderError at ``optimizer.step()``, on every rank, before anything is applied.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hfzero
from hfzero.runtime.stage3.scheduler import GatherOrderError, Phase
from hfzero.testing.host_syncs import measure
from hfzero.testing.spawn import run_distributed

CASES = [(stage, accumulation, dtype) for dtype in ("fp32", "fp16") for stage in (0, 1, 2, 3)
         for accumulation in (1, 4)]
"""fp16 reads its overflow flag with the step's checks (the agreement counts at stages 0-2, the packed
stage-3 check): no read of its own."""


def _worker(rank: int, world: int) -> list[dict]:
    return [measure(rank, world, stage, accumulation, steps=2, warmup=1, dtype=dtype)
            for stage, accumulation, dtype in CASES]


@pytest.fixture(scope="module")
def counts() -> list[list[dict]]:
    return run_distributed(_worker, 2, timeout=600)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{d}-stage{s}-acc{a}" for s, a, d in CASES])
def test_at_most_one_host_sync_per_step(counts, case: int) -> None:
    for rank_counts in counts:
        result = rank_counts[case]
        assert result["per_step"] <= 1, (CASES[case], result["sites"])


class _Blocks(nn.Module):
    """Four identical blocks (so mismatched gathers still pair up) and a head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


def _order_worker(rank: int, world: int) -> dict:
    model = _Blocks()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = hfzero.prepare(model, optimizer, hfzero.ZeroConfig(stage=3, param_persistence_threshold=0))
    engine = hfzero.get_engine(model)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    for step in range(3):
        if step == 2 and rank == 1:  # this rank's recorded forward order departs: it prefetches another block
            order = engine.scheduler.orders[Phase.FORWARD]
            order[2], order[3] = order[3], order[2]
        optimizer.backward(model(x))  # no error at the pass ends: the check waits for the step
        before = [p.detach().clone() for p in engine.master_views]
        try:
            optimizer.step()
        except GatherOrderError as error:
            unchanged = all(torch.equal(a, b) for a, b in zip(before, engine.master_views))
            optimizer.zero_grad()
            return {"step": step, "error": str(error), "unchanged": unchanged}
        optimizer.zero_grad()
    return {"step": None}


def test_gather_order_error_is_raised_at_the_step_on_every_rank() -> None:
    for result in run_distributed(_order_worker, 2, timeout=300):
        assert result["step"] == 2, result
        assert "found at the optimizer step" in result["error"] and "training pass 1 since the last step" in result["error"]
        assert result["unchanged"]  # nothing applied


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: counts hfzero's host syncs on CUDA "
                    "(and torch's own under torch.cuda.set_sync_debug_mode); the CPU proxy runs above")
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_at_most_one_host_sync_per_step_on_cuda(stage: int) -> None:
    from hfzero.testing.host_syncs import host_syncs

    worlds = [1] + ([2] if torch.cuda.device_count() >= 2 else [])  # NCCL: one rank per GPU
    for world in worlds:
        for accumulation in (1, 4):
            result = host_syncs(stage, accumulation, world_size=world, device="cuda", backend="nccl", steps=2,
                                warmup=1, timeout=600)
            assert result["cuda_per_step"] is not None  # torch's own count, reported (not bounded: torch's included)
            assert max(result["per_step_by_rank"]) <= 1, (world, accumulation, result["sites"])
