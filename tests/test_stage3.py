"""ZeRO stage 3: parity with single-process AdamW, memory and communication volumes, prefetch order,
generate()/no_grad, full state dicts, and a rank that skips a unit. One spawn per world size."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hfzero
from hfzero.planning.estimate import model_states_bytes
from hfzero.roles import MODEL_STATE_ROLES, MemoryRole
from hfzero.runtime.stage3 import GatherOrderError, full_state_dict
from hfzero.testing import run_distributed
from hfzero.testing.models import micro_batches, tiny_causal_lm, token_batches
from hfzero.testing.spawn import WorkerFailure

STEPS = 10
LR = 1e-3


def _batches() -> list[torch.Tensor]:
    return token_batches(STEPS, 16, 16)


def _reference(kind: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process full-batch AdamW with clipping: the ground truth."""
    model = tiny_causal_lm(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses = []
    for batch in _batches():
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _prepared(kind: str, dtype: str = "fp32", threshold: int = 0, prefetch: int = 10**9, **kw):
    model = tiny_causal_lm(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    config = hfzero.ZeroConfig(stage=3, dtype=dtype, reduce_bucket_size=4000, param_persistence_threshold=threshold,
                               allgather_bucket_size=prefetch)
    return hfzero.prepare(model, opt, config, **kw)


def _train_step(model, opt, batch, rank, world, accum) -> float:
    total = torch.zeros(())
    for mb in micro_batches(batch, rank, world, accum):
        loss = model(input_ids=mb, labels=mb).loss / accum
        opt.backward(loss)
        total += loss.detach().float()
    opt.clip_grad_norm_(1.0)
    opt.step()
    if world > 1:
        dist.all_reduce(total)
        total /= world
    return total.item()


def _parity_case(rank, world, kind, accum, dtype, threshold):
    model, opt = _prepared(kind, dtype, threshold)
    engine = hfzero.get_engine(model)
    losses = [_train_step(model, opt, b, rank, world, accum) for b in _batches()]
    sharded_after_step = all(p.numel() == 0 for u in engine.units for p in u.params)
    gathered_after_step = engine.memory_by_role().get(MemoryRole.PARAM_GATHERED, 0)
    state = {k: v.float() for k, v in full_state_dict(model, rank0_only=False).items()}
    # generate() of the sharded model equals that of an unsharded model holding the same weights.
    prompt = torch.tensor([[1, 2, 3, 4]])
    plain = tiny_causal_lm(kind)
    plain.load_state_dict({k: v.to(next(plain.parameters()).dtype) for k, v in state.items()})
    if dtype != "fp32":
        plain.to(engine.config.torch_dtype)
    with torch.no_grad():
        ours = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        theirs = plain.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    released = engine.memory_by_role().get(MemoryRole.PARAM_GATHERED, 0) == 0
    return {"losses": losses, "state": state, "sharded_after_step": sharded_after_step,
            "gathered_after_step": gathered_after_step, "generate_equal": torch.equal(ours, theirs),
            "released_after_generate": released}


def _measure_case(rank, world, threshold):
    """bf16 + AdamW: model-state bytes, comm volume of one step, gathered peak, prefetch event order."""
    block_numel = None
    model, opt = _prepared("gpt2", "bf16", threshold, prefetch=1)
    engine = hfzero.get_engine(model)
    block_numel = max(u.numel for u in engine.units[1:])
    engine.scheduler.prefetch_numel = block_numel  # prefetch exactly one block ahead
    batches = _batches()
    events_first = list(engine.trace(True) or [])
    _train_step(model, opt, batches[0], rank, world, 1)
    events_first = list(engine.scheduler.events)
    engine.trace(True)
    peak = [0]

    def sample(*_):
        peak[0] = max(peak[0], engine.memory_by_role().get(MemoryRole.PARAM_GATHERED, 0))

    hooks = [u.module.register_forward_pre_hook(sample) for u in engine.units]
    hooks += [p.register_hook(lambda g: sample() or g) for u in engine.units for p in u.params]
    before = engine.comm.stats()
    _train_step(model, opt, batches[1], rank, world, 1)
    after = engine.comm.stats()
    for h in hooks:
        h.remove()
    events = list(engine.scheduler.events)
    mem = engine.memory_by_role()
    volume = {k: after[k].elements - (before[k].elements if k in before else 0) for k in after}
    element = 2
    root = engine.units[0].numel
    return {
        "model_states": sum(v for k, v in mem.items() if k in MODEL_STATE_ROLES),
        "num_params": engine.num_params, "padded": engine.num_params_padded,
        "persistent": engine.num_persistent_params, "buckets": len(engine.layout.buckets),
        "gathered_numel": sum(u.numel for u in engine.units),
        "persistent_padded": engine.persistent_flat.numel(),
        "volume": volume, "peak_gathered": peak[0],
        "gathered_bound": (root + 2 * block_numel + engine.scheduler.prefetch_numel) * element,
        "events": events, "events_first": events_first,
    }


def _world_worker(rank, world, cases):
    out = []
    for case in cases:
        if case[0] == "parity":
            out.append(_parity_case(rank, world, *case[1:]))
        else:
            out.append(_measure_case(rank, world, *case[1:]))
    return out


def _check_parity(result, ref, fp32: bool, label: str):
    ref_losses, ref_state = ref
    loss_tol, param_tol = (1e-5, 1e-5) if fp32 else (3e-2, 3e-2)
    loss_diff = max(abs(a - b) for a, b in zip(result["losses"], ref_losses))
    param_diff = max((result["state"][k] - ref_state[k]).abs().max().item() for k in ref_state)
    assert loss_diff <= loss_tol, (label, loss_diff)
    assert param_diff <= param_tol, (label, param_diff)
    assert result["sharded_after_step"], label
    assert result["gathered_after_step"] == 0, label
    assert result["generate_equal"], label
    assert result["released_after_generate"], label


PARITY = [("parity", kind, accum, "fp32", 0) for kind in ("gpt2", "llama") for accum in (1, 4)]


@pytest.fixture(scope="module")
def refs():
    return {kind: _reference(kind) for kind in ("gpt2", "llama")}


def test_parity_world1_in_process(refs):
    # World 1 runs in this process; the accumulation x model grid runs in full at worlds 2 and 4.
    for case in [("parity", "gpt2", 1, "fp32", 0), ("parity", "llama", 4, "fp32", 0), ("parity", "gpt2", 1, "bf16", 0)]:
        _check_parity(_parity_case(0, 1, *case[1:]), refs[case[1]], case[3] == "fp32", f"world 1 {case}")


def test_world2_parity_memory_comm_prefetch(refs):
    cases = PARITY + [("parity", "gpt2", 4, "fp32", 100), ("parity", "llama", 1, "bf16", 0),
                      ("measure", 0), ("measure", 100)]
    results = run_distributed(_world_worker, 2, cases, timeout=120)
    for rank_results in results:
        for case, result in zip(cases, rank_results):
            if case[0] == "parity":
                _check_parity(result, refs[case[1]], case[3] == "fp32", f"world 2 {case}")
    for case, m in zip(cases, results[0]):
        if case[0] == "measure":
            _check_measure(m, world=2, threshold=case[1])


def test_world4_parity(refs):
    cases = PARITY + [("measure", 0)]
    results = run_distributed(_world_worker, 4, cases, timeout=150)
    for rank_results in results:
        for case, result in zip(cases, rank_results):
            if case[0] == "parity":
                _check_parity(result, refs[case[1]], True, f"world 4 {case}")
    _check_measure(results[1][-1], world=4, threshold=0)


def _check_measure(m, world: int, threshold: int):
    # Model states: 16Ψ/N (bf16 params and grads, fp32 master, Adam's two states) + 2 bytes per
    # persistent parameter in full, within padding (and Adam's per-tensor step counters).
    expected = model_states_bytes(m["num_params"], world, 3, persistent_params=m["persistent"])
    slack = 16 * (m["padded"] - m["num_params"]) + 16 * m["buckets"]
    assert expected <= m["model_states"] <= expected + slack, (m["model_states"], expected, slack)
    if threshold == 0:
        assert m["persistent"] == 0
    else:
        assert m["persistent"] > 0
    # Communication per step and rank: 2 all-gathers of the partitioned parameters (forward and
    # backward) + 1 reduce-scatter of all gradients = 3Ψ within padding; persistent parameters add one
    # all-gather after the step (and no forward/backward gathers).
    v = m["volume"]
    assert v["reduce_scatter"] == m["padded"]
    assert v["all_gather"] == 2 * m["gathered_numel"] + m["persistent_padded"]
    psi = m["num_params"]
    if threshold == 0:
        assert abs(v["all_gather"] + v["reduce_scatter"] - 3 * psi) <= 3 * (m["padded"] - psi)
    # Gathered parameters stay bounded by root + current + one released-late unit + the prefetch budget.
    assert 0 < m["peak_gathered"] <= m["gathered_bound"], (m["peak_gathered"], m["gathered_bound"])
    # Prefetch: on the second step the gather of block 1 is issued before block 0's forward ends, and
    # the backward gather of block 0 is issued while block 1's backward runs. On the first step (no
    # recorded order) block 1 is gathered only on demand.
    ev = m["events"]
    assert ev.index(("gather", "transformer.h.1")) < ev.index(("forward_end", "transformer.h.0")), ev
    back = ev.index(("backward", "transformer.h.1"))
    assert back < ev.index(("gather", "transformer.h.0"), back) < ev.index(("backward", "transformer.h.0")), ev
    first = m["events_first"]
    assert first.index(("gather", "transformer.h.1")) > first.index(("forward_end", "transformer.h.0")), first


class _Branchy(nn.Module):
    """Blocks of Linear layers; ``skip`` names blocks this rank's forward leaves out."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(16, 1)
        self.skip: set[int] = set()

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            if i not in self.skip:
                x = block(x)
        return self.head(x).pow(2).mean()


def _skip_worker(rank, world, skip_step):
    model = _Branchy()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = hfzero.prepare(model, opt, hfzero.ZeroConfig(stage=3, param_persistence_threshold=0))
    for step in range(3):
        model.skip = {1} if (rank == 1 and step == skip_step) else set()
        loss = model(torch.randn(4, 16, generator=torch.Generator().manual_seed(step)))
        opt.backward(loss)
        opt.step()
    return full_state_dict(model, rank0_only=False)


def test_rank_skipping_a_unit_fails_clearly_or_works():
    """Skipping a unit on one rank before any order is recorded raises GatherOrderError on the ranks
    (no hang, no mixed shards); after the order is recorded, prefetch makes both ranks gather the same
    units, so the step completes and every rank ends with the same parameters."""
    with pytest.raises(WorkerFailure) as info:
        run_distributed(_skip_worker, 2, 0, timeout=60)
    message = str(info.value)
    assert "GatherOrderError" in message and "ranks reached different parameter gathers" in message, message
    states = run_distributed(_skip_worker, 2, 2, timeout=60)
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_stage3_state_dict_semantics_and_options():
    model, opt = _prepared("llama")
    engine = hfzero.get_engine(model)
    assert engine.stage == 3 and engine.world_size == 1 and [u.name for u in engine.units] == [
        "", "model.layers.0", "model.layers.1"]
    # Between uses partitioned parameters are empty, so model.state_dict() is refused (a saved model
    # must never come out empty); full_state_dict gathers them.
    assert all(p.numel() == 0 for n, p in model.named_parameters() if "layers" in n and "weight" in n)
    with pytest.raises(RuntimeError, match="full_state_dict"):
        model.state_dict()
    full = full_state_dict(model)
    ref = tiny_causal_lm("llama").state_dict()
    assert full.keys() == ref.keys() and all(torch.equal(full[k], ref[k]) for k in ref)
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]))
    assert engine.memory_by_role().get(MemoryRole.PARAM_GATHERED, 0) == 0
    with pytest.raises(hfzero.ConfigError, match="not submodules"):
        _prepared("gpt2", units=["transformer.nope"])
    # Below stage 3, units only keep each named module's parameters in buckets of their own.
    m = tiny_causal_lm("gpt2")
    m, _ = hfzero.prepare(m, torch.optim.AdamW(m.parameters()), hfzero.ZeroConfig(stage=2), units=["transformer.h.0"])
    layout = hfzero.get_engine(m).layout
    buckets = [{slot.name.startswith("transformer.h.0.") for slot in b.slots} for b in layout.buckets]
    assert all(len(kinds) == 1 for kinds in buckets) and {True} in buckets and {False} in buckets, buckets
    # Custom units: one unit for the whole decoder stack.
    model, _ = _prepared("gpt2", units=["transformer.h"])
    assert [u.name for u in hfzero.get_engine(model).units] == ["", "transformer.h"]
    assert GatherOrderError.__mro__[1] is RuntimeError
