"""Stage-3 prefetch of units larger than the prefetch budget (issue 19, item 2).

Every decoder block of a model of about 1B parameters or more is larger than the default prefetch budget
(at most 25M elements). The scheduler must still prefetch the next unit of the recorded order, whatever
its size, in forward and in backward; the budget only governs units further ahead. Checked on one
process with the scheduler's event trace: a unit whose gather is issued before the pass reaches it was
prefetched.
"""

from __future__ import annotations

import torch

import hfzero
from hfzero.planning import estimate
from hfzero.profiler.header import predict
from hfzero.roles import MemoryRole
from hfzero.testing.models import tiny_causal_lm, token_batches

LAYERS = 4


def _passes(events: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """The trace of one training step split into its forward and its backward pass."""
    first_backward = next(i for i, (kind, _) in enumerate(events) if kind == "backward")
    return [events[:first_backward], events[first_backward:]]


def _gathered_ahead(events: list[tuple[str, str]], kind: str) -> set[str]:
    """Units whose gather was issued before the pass reached them (``kind``: "forward" or "backward")."""
    ahead, issued = set(), set()
    for event, name in events:
        if event == "gather":
            issued.add(name)
        elif event == kind and name in issued:
            ahead.add(name)
    return ahead


def test_next_unit_is_prefetched_whatever_its_size():
    model = tiny_causal_lm("llama", layers=LAYERS)
    root, blocks = estimate.stage3_unit_numels(model.config, persistence_threshold=0)
    config = hfzero.ZeroConfig(stage=3, allgather_bucket_size=1, param_persistence_threshold=0)
    model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    engine = hfzero.get_engine(model)
    assert all(unit.numel > engine.prefetch_numel for unit in engine.units)  # budget below every unit
    peak = [0]

    def sample(*_):
        peak[0] = max(peak[0], engine.memory_by_role().get(MemoryRole.PARAM_GATHERED, 0))

    hooks = [u.module.register_forward_pre_hook(sample) for u in engine.units]
    hooks += [p.register_hook(lambda g: sample() or g) for u in engine.units for p in u.params]
    for step, ids in enumerate(token_batches(3, 2, 8)):
        engine.trace(step == 2)  # steps 0-1 record the orders; step 2 runs on them
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    forward, backward = _passes(engine.scheduler.events)
    units = len(engine.units)
    assert len(_gathered_ahead(forward, "forward")) >= units - 1, forward
    assert len(_gathered_ahead(backward, "backward")) >= units - 1, backward
    # at most the root, the unit in use and the next one: the two largest units beside the root
    two_largest = sorted((u.numel for u in engine.units[1:]), reverse=True)[:2]
    bound = (engine.units[0].numel + sum(two_largest)) * 4  # fp32
    assert 0 < peak[0] <= bound, (peak[0], bound)
    # the estimator and the profile header count the same transient (the estimator without padding)
    predicted = estimate.stage3_gathered_bytes(root, blocks, 1, param_bytes=4, prefetch_numel=1)
    assert peak[0] - 4 * 8 * len(engine.units) <= predicted <= bound, (peak[0], predicted, bound)
    assert predict(engine, optimizer)["stage3_gathered_bytes"] == bound
    for h in hooks:
        h.remove()
