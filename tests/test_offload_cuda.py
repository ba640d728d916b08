"""ZeRO-Offload on CUDA (NCCL): pinned host placement, copies on a dedicated stream ordered by events, and
parity with the non-offloaded run on one GPU (world 1) and, when present, two GPUs (world 2), at stages
1-3 with one and two ("sharded" and "local") micro-batches per step, fp32 and bf16. One spawn per world
size. Skipped without CUDA: the same code path runs on CPU in test_offload.py (forced, synchronous)."""

from __future__ import annotations

import functools

import pytest
import torch

from hfzero.testing import run_distributed
from hfzero.testing.offload import OffloadCase, train_cases

pytestmark = [
    pytest.mark.cuda,  # run by the GPU check's cuda_tests section (docs/gpu.md)
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device (pinned memory, copy streams, NCCL); the offload "
                              "path itself is tested on CPU in tests/test_offload.py"),
]

CASES = [OffloadCase(stage, accumulation, policy, offload=True)
         for stage in (1, 2, 3) for accumulation, policy in ((1, "sharded"), (2, "sharded"), (2, "local"))]
CASES.append(OffloadCase(2, 1, "sharded", dtype="bf16", offload=True))
RUNS = list(dict.fromkeys([c for case in CASES for c in (case, case.plain())]))
_id = lambda c: f"stage{c.stage}-{c.accumulation}x{c.policy}-{c.dtype}"


@functools.lru_cache(maxsize=None)
def _results(world: int) -> list[list[dict]]:
    return run_distributed(train_cases, world, RUNS, "cuda", backend="nccl", timeout=600)


def _pairs(world: int, case: OffloadCase):
    results = _results(world)
    off, plain = RUNS.index(case), RUNS.index(case.plain())
    return [(rank[off], rank[plain]) for rank in results]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_offload_on_cuda_matches_and_lives_in_pinned_memory(world, case):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices, {torch.cuda.device_count()} present")
    # fp32: the host's fused CPU AdamW against the device's AdamW, one ulp per step; bf16: a bf16 ulp
    atol = 1e-6 if case.dtype == "fp32" else 2e-2
    for rank, (off, plain) in enumerate(_pairs(world, case)):
        assert off["offloaded"] and not plain["offloaded"]
        # only what DMA touches is page-locked: staging, and the master when it is the upload's source (fp32)
        fp32 = case.dtype == "fp32"
        assert off["pinned"] == {"master": fp32, "grad": False, "staging": True, "states": False}, f"rank {rank}"
        # at exact sizes (page-rounded), not the caching host allocator's powers of two
        assert off["pinned_bytes"] == off["expected_pinned_bytes"] > 0, f"rank {rank}"
        # copies on their own stream, issued while backward still computes (non-blocking: they overlap it)
        assert off["copy_stream"] and off["pushed"] > 0 and off["early_pushes"] > 0
        # stages 2-3 keep no gradient shard on the GPU (the plain run does); stages 0-1 have none anyway
        assert off["device_grad_shard"] is False and plain["device_grad_shard"] is (case.stage >= 2)
        torch.testing.assert_close(torch.tensor(off["losses"]), torch.tensor(plain["losses"]), atol=atol, rtol=0)
        torch.testing.assert_close(torch.tensor(off["norms"]), torch.tensor(plain["norms"]), atol=atol, rtol=1e-5)
        for name, value in plain["params"].items():
            torch.testing.assert_close(off["params"][name], value, atol=atol, rtol=0,
                                       msg=lambda m: f"rank {rank} parameter {name}: {m}")
