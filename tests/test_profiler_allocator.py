"""Allocator statistics: fragmentation from known allocation patterns, a recorded CUDA snapshot and the counters
of the first GPU run's profile."""

from __future__ import annotations

import ctypes
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from hfzero.profiler.allocator import (
    AllocatorProbe,
    MallInfo,
    load_mallinfo2,
    cpu_fields,
    cuda_fields,
    cuda_snapshot_summary,
    heap_fragmentation,
)

MiB = 1 << 20
KiB = 1 << 10


def _block(size: int, state: str) -> dict:
    return {"address": 0, "size": size, "requested_size": size if state != "inactive" else 0, "state": state,
            "frames": []}


# A recorded-shape snapshot (torch.cuda.memory_snapshot(): a list of segments). Device 0 has a 20 MiB
# large-pool segment (8 MiB used, 4 MiB free, 2 MiB used, 6 MiB free) and a 2 MiB small-pool segment
# (512 KiB used, 512 KiB freed but pending a stream event, 1 MiB free); device 1 has one 2 MiB segment.
SNAPSHOT = [
    {"device": 0, "address": 139_637_976_000_000, "total_size": 20 * MiB, "allocated_size": 10 * MiB,
     "active_size": 10 * MiB, "requested_size": 10 * MiB - 4096, "stream": 0, "segment_type": "large",
     "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
     "blocks": [_block(8 * MiB, "active_allocated"), _block(4 * MiB, "inactive"),
                _block(2 * MiB, "active_allocated"), _block(6 * MiB, "inactive")]},
    {"device": 0, "address": 139_637_998_000_000, "total_size": 2 * MiB, "allocated_size": 512 * KiB,
     "active_size": 1 * MiB, "requested_size": 500 * KiB, "stream": 0, "segment_type": "small",
     "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
     "blocks": [_block(512 * KiB, "active_allocated"), _block(512 * KiB, "active_pending_free"),
                _block(1 * MiB, "inactive")]},
    {"device": 1, "address": 139_638_100_000_000, "total_size": 2 * MiB, "allocated_size": 0,
     "active_size": 0, "requested_size": 0, "stream": 0, "segment_type": "large",
     "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
     "blocks": [_block(2 * MiB, "inactive")]},
]


def test_cuda_snapshot_fragmentation_on_recorded_snapshot() -> None:
    summary = cuda_snapshot_summary(SNAPSHOT, device_index=0)
    assert summary["reserved"] == 22 * MiB
    assert summary["allocated"] == 10 * MiB + 512 * KiB
    assert summary["total_free"] == 11 * MiB  # 4 + 6 + 1; the pending-free block is not allocatable yet
    assert summary["largest_free_block"] == 6 * MiB
    assert summary["fragmentation"] == pytest.approx(1 - 6 / 11)
    assert summary["reserved_unallocated"] == 22 * MiB - (10 * MiB + 512 * KiB)
    assert summary["segments"] == [
        {"total": 20 * MiB, "allocated": 10 * MiB, "free": 10 * MiB, "largest_free": 6 * MiB},
        {"total": 2 * MiB, "allocated": 512 * KiB, "free": 1 * MiB, "largest_free": 1 * MiB},
    ]
    everything = cuda_snapshot_summary({"segments": SNAPSHOT, "device_traces": []})
    assert everything["reserved"] == 24 * MiB and everything["total_free"] == 13 * MiB
    assert everything["fragmentation"] == pytest.approx(1 - 6 / 13)


def test_cuda_snapshot_without_free_memory_is_not_fragmented() -> None:
    full = [{"device": 0, "total_size": 4 * MiB, "allocated_size": 4 * MiB,
             "blocks": [_block(4 * MiB, "active_allocated")]}]
    assert cuda_snapshot_summary(full)["fragmentation"] == 0.0
    assert cuda_snapshot_summary([])["fragmentation"] == 0.0


def _pools(current: int, peak: int) -> dict:
    entry = {"current": current, "peak": peak, "allocated": 10 * peak, "freed": 10 * peak - current}
    return {"all": entry, "small_pool": dict(entry, current=0), "large_pool": entry}


def test_cuda_fields_from_recorded_memory_stats() -> None:
    """On the structure of torch.cuda.memory_stats_as_nested_dict() (what memory_stats() flattens)."""
    stats = {"allocated_bytes": _pools(3 * MiB, 6 * MiB), "reserved_bytes": _pools(8 * MiB, 8 * MiB),
             "active_bytes": _pools(4 * MiB, 6 * MiB), "inactive_split_bytes": _pools(1 * MiB, 2 * MiB),
             "requested_bytes": _pools(3 * MiB - 100, 6 * MiB), "allocation": _pools(17, 20),
             "num_alloc_retries": 2, "num_ooms": 0, "num_sync_all_streams": 0, "max_split_size": -1}
    fields = cuda_fields(stats, rss=123)
    assert fields == {"rss": 123, "allocated": 3 * MiB, "reserved": 8 * MiB, "active": 4 * MiB,
                      "inactive_split": 1 * MiB, "reserved_unallocated": 5 * MiB, "num_alloc_retries": 2,
                      "num_ooms": 0, "peak_allocated": 6 * MiB, "peak_reserved": 8 * MiB,
                      "fragmentation": 1 / 8}  # 1 MiB of free split blocks in 8 MiB reserved (issue 33 item 7)


def test_heap_fragmentation_on_a_synthetic_pattern() -> None:
    # A 1 MiB arena carved into 16 chunks of 64 KiB, every other one freed: half the heap is free.
    info = MallInfo(arena=16 * 64 * KiB, hblkhd=3 * MiB, uordblks=8 * 64 * KiB, fordblks=8 * 64 * KiB, keepcost=0)
    fields = cpu_fields(rss=50 * MiB, info=info)
    assert fields["fragmentation"] == 0.5
    assert fields["allocated"] == 512 * KiB + 3 * MiB and fields["reserved"] == 1 * MiB + 3 * MiB
    assert heap_fragmentation(0, 0) is None
    nulls = cpu_fields(rss=7, info=None)
    assert nulls["rss"] == 7 and nulls["fragmentation"] is None and nulls["heap_free"] is None


@pytest.mark.skipif(load_mallinfo2() is None, reason="glibc mallinfo2 is not available")
def test_mallinfo_sees_freed_heap_chunks() -> None:
    """Allocate 2000 x 4 KiB from the heap (below the mmap threshold), free every other one: the
    free-but-held bytes grow by about the freed total, which cannot coalesce with its neighbours."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    probe = AllocatorProbe(torch.device("cpu"))
    chunk, count = 4 * KiB, 2000
    pointers = [libc.malloc(chunk) for _ in range(count)]
    before = probe.sample()
    for pointer in pointers[::2]:
        libc.free(pointer)
    after = probe.sample()
    try:
        freed = chunk * count // 2
        assert after["heap_free"] - before["heap_free"] >= 0.95 * freed
        assert before["heap_in_use"] - after["heap_in_use"] >= 0.95 * freed
        assert after["fragmentation"] == pytest.approx(after["heap_free"] / after["heap_arena"])
        assert after["fragmentation"] > before["fragmentation"]
    finally:
        for pointer in pointers[1::2]:
            libc.free(pointer)


def test_cpu_probe_sample_reads_without_side_effects(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the profiler must not reset or empty the allocator")

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", forbidden)
    monkeypatch.setattr(torch.cuda, "empty_cache", forbidden)
    probe = AllocatorProbe(torch.device("cpu"))
    sample = probe.sample()
    assert sample["device"] == "cpu" and sample["rss"] > 0
    assert set(sample) == {"device", "rss", "rss_peak", "allocated", "reserved", "heap_arena", "heap_in_use", "heap_free",
                           "heap_keepcost", "heap_mmapped", "fragmentation"}
    assert probe.snapshot() is None
    probe.close()
    fallback = probe.sample()["rss"]  # psutil once the /proc fd is closed; null without psutil
    if importlib.util.find_spec("psutil") is None:
        assert fallback is None
    else:
        assert fallback == pytest.approx(sample["rss"], rel=0.5)


def test_cuda_probe_reads_stats_and_snapshot_for_its_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path on recorded data: the probe passes its device and picks that device's segments."""
    seen: list[object] = []

    def memory_stats(device: object) -> dict:
        seen.append(device)
        return {"allocated_bytes": _pools(5, 5), "reserved_bytes": _pools(9, 9)}

    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", memory_stats)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda include_traces=True: SNAPSHOT)
    probe = AllocatorProbe(torch.device("cuda", 1))
    sample = probe.sample()
    assert seen == [torch.device("cuda", 1)]
    assert sample["device"] == "cuda:1" and sample["allocated"] == 5 and sample["reserved_unallocated"] == 4
    assert sample["fragmentation"] == 0.0  # no inactive split block: the 4 free bytes are a whole free segment
    snapshot = probe.snapshot()
    assert snapshot is not None and snapshot["reserved"] == 2 * MiB and snapshot["fragmentation"] == 0.0


def test_peak_decomposition_parts_add_up() -> None:
    """[Note: peak decomposition]: CPU record -> model states, transient, activations, other, remainder."""
    from hfzero.profiler.decompose import PARTS, decompose, legacy_parts

    roles = {"param_full": 40 * MiB, "grad_full": 40 * MiB, "grad_bucket": 5 * MiB, "activations": 20 * MiB,
             "act_checkpoint": 5 * MiB}
    cpu = cpu_fields(rss=300 * MiB, info=MallInfo(arena=100 * MiB, hblkhd=150 * MiB, uordblks=60 * MiB,
                                                   fordblks=40 * MiB, keepcost=0), rss_peak=320 * MiB)
    split = decompose(roles, cpu, {"param_full", "grad_full"})
    assert split == {"total": 300 * MiB, "model_states": 80 * MiB, "transient": 5 * MiB,
                     "activations": 25 * MiB, "other": 100 * MiB, "remainder": 90 * MiB}
    old = {"total": 10, "model_states": 4, "transient": 1, "activations": 3, "remainder": 2}  # before "other"
    assert legacy_parts(old) == {**old, "activations": 0, "other": 3} and legacy_parts(split) == split
    assert sum(split[p] for p in PARTS) == split["total"]
    cuda = {"reserved": 100, "allocated": 70, "reserved_unallocated": 30}
    assert decompose({"param_full": 50}, cuda, {"param_full"})["remainder"] == 30
    assert decompose({}, cpu_fields(rss=None, info=None), set()) is None


def test_cuda_fragmentation_from_the_counters_of_the_first_gpu_run() -> None:
    """Issue 33 item 7: the first GPU run's profile (tests/data/cuda_profile, one H200) recorded CUDA counters
    but ``fragmentation: null``. Its counters, fed back through ``cuda_fields`` in memory_stats' nested form,
    give the figure every sample now carries; the reader fills the same figure into that old profile."""
    from hfzero.profiler.fragmentation import split_fragmentation
    from hfzero.profiler.reader import load_run

    path = Path(__file__).parent / "data" / "cuda_profile"
    raw = [json.loads(line) for line in (path / "rank-0.jsonl").read_text().splitlines()]
    assert all(r["allocator"]["fragmentation"] is None for r in raw if "allocator" in r)  # as written
    run = load_run(path)
    samples = [r["allocator"] for r in run.ranks[0].records if "allocator" in r]
    assert len(samples) == len([r for r in raw if "allocator" in r]) > 20
    for sample in samples:
        stats = {"allocated_bytes": _pools(sample["allocated"], sample["peak_allocated"]),
                 "reserved_bytes": _pools(sample["reserved"], sample["peak_reserved"]),
                 "active_bytes": _pools(sample["active"], sample["active"]),
                 "inactive_split_bytes": _pools(sample["inactive_split"], sample["inactive_split"]),
                 "num_alloc_retries": 0, "num_ooms": 0}
        fields = cuda_fields(stats, rss=sample["rss"])
        assert fields == {k: v for k, v in sample.items() if k != "device"}
        assert fields["fragmentation"] == sample["inactive_split"] / sample["reserved"]
    start = samples[0]  # 212 KiB allocated in one 2 MiB segment: most of it free, in one split block
    assert start["fragmentation"] == pytest.approx(1880576 / 2097152)
    later = [s["fragmentation"] for s in samples if s["reserved"] > 32 * MiB]  # from the first forward on
    assert len(later) > 20 and max(later) < 0.05  # ~1.6 MiB split of 34-66 MiB reserved
    assert split_fragmentation(0, 0) == 0.0 and split_fragmentation(None, 8) is None
