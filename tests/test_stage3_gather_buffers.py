"""Stage 3's unit buffers on public torch API only (issue 33), on every torch in the tested range (torch 2.11,
the floor the GPU machine runs, and the newest): the default "resized" backing (a CUDA rank's, and a CPU
rank's since wave 4) and the opt-in allocator-free "mapped" one (``ZeroConfig.stage3_buffers``, CPU ranks on
Linux) train identically, each keeping one storage per unit and holding nothing between steps. See [Note:
stage-3 gather buffers].

Two gloo ranks, GPT-2 with every parameter partitioned (``param_persistence_threshold=0``, as in the issue:
torch 2.11 raised an AttributeError at the first gather when the buffers swapped storages privately), 3
steps of AdamW, first with "mapped", then with the default. One spawn of 2 ranks.
"""

from __future__ import annotations

import functools
import mmap

import pytest
import torch

import hfzero
from hfzero.runtime.stage3 import buffers
from hfzero.testing import run_distributed
from hfzero.testing.fake_world import unit_bytes
from hfzero.testing.models import micro_batches, tiny_causal_lm, token_batches

STEPS = 3


def _train(rank: int, world: int, **buffers_option: str) -> dict:
    model = tiny_causal_lm("gpt2", hidden=64, layers=2)
    config = hfzero.ZeroConfig(stage=3, param_persistence_threshold=0, **buffers_option)
    model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    engine = hfzero.get_engine(model)
    block = engine.units[1]
    held: dict[str, list[int]] = {"in_forward": [], "after_forward": []}
    # registered after prepare's hooks: the pre-hook runs once the unit is gathered, the post-hook once released
    hooks = [block.module.register_forward_pre_hook(lambda *_: held["in_forward"].append(unit_bytes(block))),
             block.module.register_forward_hook(lambda *_: held["after_forward"].append(unit_bytes(block)))]
    addresses = [u.full.data_ptr() for u in engine.units]
    losses = []
    for batch in token_batches(STEPS, 2 * world, 16):
        ids = micro_batches(batch, rank, world, 1)[0]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    for h in hooks:
        h.remove()
    return {"kind": engine.gather_buffers.kind, "losses": losses, "shard": engine.param_shard.clone(),
            "nbytes": block.buffer.nbytes, "held": held, "after_step": [unit_bytes(u) for u in engine.units],
            "same_storage": addresses == [u.full.data_ptr() for u in engine.units]}


def _worker(rank: int, world: int) -> dict:
    mapped = _train(rank, world, stage3_buffers="mapped") if buffers.mapped_supported(torch.device("cpu")) else None
    return {"mapped": mapped, "resized": _train(rank, world)}


@functools.lru_cache(maxsize=None)
def _results() -> list[dict]:
    return run_distributed(_worker, 2, timeout=600)


@pytest.mark.skipif(not buffers.mapped_supported(torch.device("cpu")), reason="mapped unit buffers need Linux")
def test_the_allocator_free_backing_is_taken_and_hands_memory_back():
    for result in _results():
        run = result["mapped"]
        assert run["kind"] == "mapped", run["kind"]  # fails if the option is not honoured
        assert run["same_storage"]  # one storage per unit for the engine's lifetime
        pages = -(-run["nbytes"] // mmap.PAGESIZE) * mmap.PAGESIZE
        assert run["held"]["in_forward"] == [pages] * STEPS  # gathered: every page written
        assert run["held"]["after_forward"] == [0] * STEPS  # released inside the step: the pages went back
        assert run["after_step"] == [0] * len(run["after_step"])


@pytest.mark.skipif(not buffers.mapped_supported(torch.device("cpu")), reason="mapped unit buffers need Linux")
def test_the_default_backing_trains_identically():
    for result in _results():
        mapped, resized = result["mapped"], result["resized"]
        assert resized["kind"] == "resized"  # the default, on the host as on CUDA
        assert resized["same_storage"]
        assert resized["held"]["in_forward"] == [resized["nbytes"]] * STEPS  # gathered: the storage has its bytes
        assert resized["held"]["after_forward"] == [0] * STEPS and resized["after_step"] == [0] * len(resized["after_step"])
        assert mapped["losses"] == resized["losses"]
        torch.testing.assert_close(mapped["shard"], resized["shard"], rtol=0, atol=0)


def test_bad_backing_is_a_clear_error(monkeypatch):
    with pytest.raises(hfzero.ConfigError, match='stage3_buffers.*"resized" or "mapped"'):
        hfzero.ZeroConfig(stage=3, stage3_buffers="pool")
    monkeypatch.setattr(buffers, "mapped_supported", lambda device: False)  # as on macOS, or a CUDA device
    with pytest.raises(hfzero.ConfigError, match='needs a CPU device on Linux.*use stage3_buffers="resized"'):
        buffers.GatherBuffers(torch.float32, torch.device("cpu"), "mapped")
