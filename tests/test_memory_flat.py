"""The per-rank peak stays flat over a long run (issues 14 and 21): stages 2 and 3, world 2, GPT-2 of
5.3M parameters, default config (glibc's allocator left alone), 12 steps of AdamW, beside DDP in the
same process. Peak RSS per rank (VmHWM, reset after ``prepare`` with /proc/self/clear_refs) after
step 12 within 5% of the peak after step 3; the reducer's staging buffers come from a pool (no
allocation after the first step) and stage 3's unit buffers keep one storage each, at 0 bytes between
steps (the default "resized" backing: glibc reuses a released unit's block, [Note: stage-3 gather
buffers]). One 2-rank spawn.

Issue 14: with fresh storage per gather the same run grew by 3-8% (stage 2) and 12-27% (stage 3).
Issue 21: with staging buffers reallocated per bucket, stage 3 with four micro-batches per step grew
5-9% over 12 steps under glibc's defaults: see [Note: host allocator] and [Note: staging pool].

With gradient accumulation (4 micro-batches under no_sync, 6 steps) the real peak is checked too: flat
over steps for both policies; and at stage 2, between two micro-batches, the "local" run's live heap bytes
stand above the "sharded" run's by what the engine's role bytes say (the full accumulator, GRAD_ACCUM, 4Ψ
bytes in fp32, less the sharded run's pooled staging), so the role bytes and the process's memory tell the
same story.
"""

from __future__ import annotations

import functools
import gc

import pytest
import torch

import hfzero
from hfzero.roles import MemoryRole
from hfzero.testing import run_distributed
from hfzero.testing.fake_world import unit_bytes
from hfzero.testing.models import tiny_causal_lm
from hfzero.testing.procmem import heap_in_use, status

STEPS = 12
VOCAB = 8192
WARM = 3
"""Growth is measured from the peak after this step: glibc's dynamic mmap threshold settles over the
first steps (it rises as mmapped blocks are freed), as it does for DDP ([Note: host allocator])."""


def _run(rank: int, stage: int | None, policy: str = "auto", micro: int = 1, steps: int = STEPS) -> dict:
    """``stage`` None: torch's DDP with fused AdamW, the baseline the allocator gives plain torch."""
    model = tiny_causal_lm("gpt2", hidden=256, layers=4, vocab=VOCAB, positions=128)  # 5.3M parameters
    if stage is None:
        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        opt.backward = lambda loss: loss.backward()
    else:
        config = hfzero.ZeroConfig(stage=stage, accumulation=policy)
        model, opt = hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config)
        engine = hfzero.get_engine(model)
    gc.collect()
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # VmHWM := VmRSS now
    g = torch.Generator().manual_seed(rank)
    peaks, held, staging, kind, accumulator, between = [], [], [], None, 0, None
    for step in range(steps):
        for index in range(micro):
            batch = torch.randint(0, VOCAB, (2, 64), generator=g)  # (B, T) per rank
            if index < micro - 1:
                with opt.no_sync():
                    opt.backward(model(input_ids=batch, labels=batch).loss / micro)
                roles = engine.memory_by_role()
                accumulator = max(accumulator, roles.get(MemoryRole.GRAD_ACCUM, 0))
                if step == steps - 1 and index == 0:  # between two micro-batches of the last step
                    gc.collect()
                    between = {"live": heap_in_use(), "roles": sum(roles.values())}
            else:
                opt.backward(model(input_ids=batch, labels=batch).loss / micro)
        opt.step()
        opt.zero_grad()
        peaks.append(status("VmHWM"))
        if stage is not None:
            staging.append(engine.reducer.allocations)
        if stage == 3:
            kind = engine.gather_buffers.kind
            held.append(sum(unit_bytes(u) for u in engine.units))
            assert engine.memory_by_role().get(MemoryRole.PARAM_GATHERED, 0) == 0
    return {"peaks": peaks, "held": held, "kind": kind, "staging": staging, "accumulator": accumulator,
            "between": between}


ACCUMULATION_CASES = [(2, "sharded"), (2, "local"), (3, "sharded")]


def _case(rank: int, world: int) -> dict:
    out = {"ddp": _run(rank, None)}  # first, in the fresh process, as a user's DDP run starts
    gc.collect()
    for stage in (2, 3):
        out[stage] = _run(rank, stage)
        gc.collect()
    for stage, policy in ACCUMULATION_CASES:
        out[(stage, policy)] = _run(rank, stage, policy, micro=4, steps=STEPS if stage == 3 else 6)
        gc.collect()
    return out


@functools.lru_cache(maxsize=None)
def _results() -> list[dict]:
    return run_distributed(_case, 2)


def _growth(peaks: list[int]) -> float:
    return peaks[-1] / peaks[WARM - 1]


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_getaffinity"), reason="needs Linux /proc")
def test_peak_flat_over_steps():
    """Within 5% from step 3 to 12, or within 2 points of DDP's own growth in the same process when the
    allocator moved DDP's peak more (both are torch's allocations under glibc's defaults: see [Note: host
    allocator]); and hfzero allocates nothing per step itself beyond the unit buffers' storages (staging
    buffers pooled), which hold nothing between steps."""
    for rank, result in enumerate(_results()):
        ddp = _growth(result["ddp"]["peaks"])
        for stage in (2, 3):
            peaks = result[stage]["peaks"]
            growth = _growth(peaks)
            assert growth <= max(1.05, ddp + 0.02), (
                f"rank {rank} stage {stage}: peak RSS grew {growth:.3f}x from step {WARM} to step {STEPS}, DDP "
                f"{ddp:.3f}x (MB: {[round(p / 1e6) for p in peaks]})")
        for key, run in result.items():
            if key != "ddp":  # no staging buffer allocated after the first step ([Note: staging pool])
                assert run["staging"][-1] == run["staging"][0], (key, run["staging"])
        assert result[3]["kind"] == "resized"  # the default backing ([Note: stage-3 gather buffers])
        assert result[3]["held"] == [0] * STEPS, result[3]["held"]  # every unit's storage at 0 bytes between steps


def _assert_flat(key: tuple[int, str]) -> None:
    for rank, result in enumerate(_results()):
        peaks = result[key]["peaks"]
        assert _growth(peaks) <= 1.05, (rank, key, [round(p / 1e6) for p in peaks])


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_getaffinity"), reason="needs Linux /proc")
def test_stage3_peak_with_accumulation_is_flat():
    """Stage 3 with four backward passes per step. Before ``host_trim`` the peak grew ~10 MB per step
    here (+13% after 8 steps) while the bytes in use stayed flat: heap fragmentation below the mmap
    threshold, not a leak (see [Note: host allocator])."""
    _assert_flat((3, "sharded"))


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_getaffinity"), reason="needs Linux /proc")
def test_real_memory_with_accumulation_follows_the_policy():
    """Both policies' peaks are flat; between two micro-batches of a step the C heap's live bytes of the "local"
    run exceed the "sharded" run's by what their role bytes say (within 2 MB), and that difference is real: the
    local accumulator (4Ψ) less what "sharded" holds instead (its pooled GRAD_BUCKET staging; both hold the
    GRAD_SHARD). The resident peaks alone cannot say this: glibc keeps freed pages, and CI once saw local's
    peak 8.5 MB above sharded's with a 21.2 MB accumulator (sharded holds 14.7 MB of staging here)."""
    for key in ACCUMULATION_CASES[:2]:
        _assert_flat(key)
    for rank, result in enumerate(_results()):
        sharded, local = result[(2, "sharded")], result[(2, "local")]
        assert sharded["accumulator"] == 0 and local["accumulator"] > 0
        if local["between"]["live"] is None:
            pytest.skip("glibc's mallinfo2 is missing: the heap's live bytes cannot be read")
        live = local["between"]["live"] - sharded["between"]["live"]
        roles = local["between"]["roles"] - sharded["between"]["roles"]
        assert roles > 0, (rank, roles)
        assert abs(live - roles) <= 2e6, (
            f"rank {rank}: between micro-batches the local run holds {live / 1e6:.1f} MB more than the sharded "
            f"run, its roles say {roles / 1e6:.1f} MB (accumulator {local['accumulator'] / 1e6:.1f} MB)")
