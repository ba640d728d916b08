"""The CPU host-allocator policy (issue 21, [Note: host allocator] in runtime/hostmem.py): with
``host_trim_slack`` the heap is trimmed only when the resident memory grew past its settled level, and
a CPU engine's steady-state step, by default and with that opt-in trim, costs the allocator no more
than plain torch's (page faults counted, not timed: the machine is shared). The flat-peak side of the
default is tests/test_memory_flat.py."""

from __future__ import annotations

import resource

import pytest
import torch

import hfzero
import hfzero.runtime.hostmem as hostmem
from hfzero.testing import run_distributed
from hfzero.testing.models import tiny_causal_lm


def _trimmer(monkeypatch, slack: float, rss: list[int]) -> tuple[hostmem.HeapTrimmer, list[int]]:
    levels, trimmed = iter(rss), []
    monkeypatch.setattr(hostmem, "resident_bytes", lambda: next(levels))
    monkeypatch.setattr(hostmem, "trim_host_heap", lambda: trimmed.append(1) or True)
    return hostmem.HeapTrimmer(slack), trimmed


def test_trims_only_past_the_slack_and_settles_upward_only(monkeypatch):
    mb = 1 << 20
    rss = [100, 104, 105, 106, 90, 94, 105, 106, 110, 111, 116]
    trimmer, trimmed = _trimmer(monkeypatch, 0.05, [r * mb for r in rss])
    decisions = [trimmer.after_step() for _ in rss]
    # settles at 100; 104, 105 within 5%; 106 trims; 90 after the trim keeps 100 (the next steps fault the
    # handed-back pages in again); 94, 105 within; 106 trims; 110 after it raises the level (the working set
    # grew); 111 within 115.5; 116 trims
    assert decisions == [False, False, False, True, False, False, False, True, False, False, True]
    assert trimmer.trims == len(trimmed) == 3


def test_slack_zero_trims_after_every_step(monkeypatch):
    trimmer, trimmed = _trimmer(monkeypatch, 0.0, [])  # the resident memory is not even read
    assert all(trimmer.after_step() for _ in range(3)) and len(trimmed) == 3


def test_bad_slack_is_refused_with_what_to_do():
    with pytest.raises(hfzero.ConfigError, match="host_trim_slack"):
        hfzero.ZeroConfig(stage=1, host_trim_slack=-0.1)


VOCAB = 4096


def _faults_per_step(model, optimizer, steps: int = 6) -> float:
    """Median minor page faults of the steps after two warm-up steps."""
    g = torch.Generator().manual_seed(0)
    faults = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (4, 128), generator=g)  # (B, T)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return sorted(faults[2:])[len(faults[2:]) // 2]


def _plain_then_zero(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = tiny_causal_lm("gpt2", hidden=128, layers=2, vocab=VOCAB, positions=128)
    out = {"plain": _faults_per_step(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))}
    # glibc left alone first (mallopt is process-wide), then the opt-in growth-triggered trim (32 MiB, no top
    # trim), then the control: the pre-issue-21 default (1 MiB threshold, trim after every step)
    for name, config in (("default", hfzero.ZeroConfig(stage=1)),
                         ("fast", hfzero.ZeroConfig(stage=1, host_mmap_threshold=1 << 25, host_trim=True,
                                                    host_trim_slack=0.02)),
                         ("old", hfzero.ZeroConfig(stage=1, host_mmap_threshold=1 << 20, host_trim=True))):
        model = tiny_causal_lm("gpt2", hidden=128, layers=2, vocab=VOCAB, positions=128)
        model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config)
        heap = getattr(optimizer, "heap", None)
        out[name] = _faults_per_step(model, optimizer)
        out[name + "_trims"] = heap.trims if heap is not None else None
    return out


@pytest.mark.skipif(not hasattr(resource, "getrusage"), reason="needs getrusage (POSIX)")
def test_steady_step_faults_far_below_the_old_per_step_mapping():
    """Plain torch steps first (glibc's defaults), then the same model under hfzero stage 1 with the
    default config, with the opt-in growth-triggered trim, and with the old default (1 MiB mmap threshold,
    trim after every step), in one process. The old default mapped and zero-filled every activation block
    of 1 MiB or more again each step: here 13-21k page faults per step, x1.5 step time on the bars shape.
    Whether glibc's own heap-top trim hands back the 8 MiB logits blocks in a step depends on the heap's
    layout, which varies from run to run (plain torch: 0 to 8.8k faults per step, the default 0 to 9.5k in 22
    runs), so plain torch is no fixed yardstick; the old policy, measured in the same process, is: the
    default and the opt-in trim fault at most 0.43 and 0.73 of its pages in those runs, bounded at 0.6 / 0.8."""
    (result,) = run_distributed(_plain_then_zero, 1)
    assert result["old"] >= 8000, result  # the control re-maps every 1 MiB+ block: if not, nothing is measured
    assert result["old_trims"] == 6, result  # and trims after every step
    assert result["default"] <= 0.6 * result["old"], result
    assert result["fast"] <= 0.8 * result["old"], result
    assert result["default_trims"] is None, result  # no trimmer unless asked for
    # the opt-in trim settles instead of trimming after every step as the old policy does (6 of 6): 0-1 trims in
    # 6 steps in standalone runs, once 3 in a full suite (the heap after the earlier models of this process)
    assert result["fast_trims"] <= result["old_trims"] // 2, result
