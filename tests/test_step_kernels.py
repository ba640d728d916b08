"""The device work and host work of a step (issue 34): the fp32 gradient in one pass, the inner optimizer fused on
an accelerator, the passes a steady-state step makes over flat buffers (counted by hfzero.testing.census), and the
collectives' profiler labels entered only while torch's profiler collects."""

from __future__ import annotations

import functools

import pytest
import torch

import hfzero
from hfzero.comm import collectives
from hfzero.runtime.host_step import device_step_overrides
from hfzero.testing import run_fake_rank
from hfzero.testing.census import Census, by_site
from hfzero.testing.models import tiny_causal_lm
from hfzero.testing.workloads import param_groups


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("factor", [1 / 3, 1 / (6 * 1024.0), 1 / (8 * 65536.0)])
def test_one_pass_fp32_gradient_is_bitwise_copy_then_scale(dtype, factor):
    """See [Note: one pass to the fp32 gradient] in runtime/engine.py."""
    g = (torch.randn(4099, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    two_passes = torch.empty(4099).copy_(g).mul_(factor)
    one_pass = torch.mul(g, torch.full((1,), factor), out=torch.empty(4099))
    assert torch.equal(one_pass, two_passes)
    if factor == 1 / 3:  # not a power of two: with a Python scalar the product rounds in 16 bits
        assert not torch.equal(torch.mul(g, factor, out=torch.empty(4099)), two_passes)


def test_device_step_is_fused_unless_the_user_chose():
    assert device_step_overrides(torch.optim.AdamW, {"fused": None, "foreach": None}) == {"fused": True}
    assert device_step_overrides(torch.optim.Adam, {"fused": None, "foreach": None}) == {"fused": True}
    assert device_step_overrides(torch.optim.AdamW, {"fused": None, "foreach": True}) == {}
    assert device_step_overrides(torch.optim.AdamW, {"fused": False, "foreach": None}) == {}
    assert device_step_overrides(torch.optim.AdamW, {"fused": None, "foreach": None, "differentiable": True}) == {}
    assert device_step_overrides(torch.optim.SGD, {"fused": None, "foreach": None}) == {}


def _censuses(rank: int, world: int) -> dict[int, list]:
    return {stage: _census(rank, stage) for stage in (0, 1, 2)}


def _census(rank: int, stage: int) -> list:
    """One steady-state bf16 step's census (after two warm-up steps)."""
    model = tiny_causal_lm("gpt2", hidden=64, layers=2, vocab=256)
    model, optimizer = hfzero.prepare(model, torch.optim.AdamW(param_groups(model), lr=1e-4),
                                      hfzero.ZeroConfig(stage=stage, dtype="bf16", reduce_bucket_size=8192))
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))  # (B, T)

    def step():
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    step()
    mode = Census()
    with mode:
        step()
    engine = hfzero.get_engine(model)
    return [mode.table(), engine.num_params_padded, engine.layout.shard_numel, len(engine.layout.buckets),
            engine.num_params]


@functools.lru_cache(maxsize=None)
def _results(world: int) -> dict[int, list]:
    return run_fake_rank(_censuses, world, timeout=1800)


@pytest.mark.parametrize("world", [1, 4])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_steady_state_step_makes_only_the_named_passes(world, stage):
    """bf16 over fp32 masters, one steady-state step: the hooks copy each gradient once into its bucket (the store
    is not zeroed per step: no add), the fp32 gradient is one pass per bucket, the fused AdamW one over the shard,
    the cast back one per bucket; at world > 1 stage 2 zeroes each staging buffer when it is taken (stage 1 zeroes
    the slices it does not own only before a second backward adds to them); no other
    engine site moves more than bookkeeping bytes. See docs/engine.md, "Device-work proxy"."""
    rows, padded, shard, buckets, numel = _results(world)[stage]
    moved = {site: s["read"] + s["written"] for site, s in by_site(rows).items()}
    expected = {
        "runtime/reducer.py:_on_grad": (2 + 2) * numel,  # read each bf16 gradient, write it into its bucket
        "runtime/engine.py:materialize_grads": (2 + 4) * shard,  # bf16 sum in, fp32 gradient (x 1/world) out
        "optimizer": (16 + 12) * shard,  # fused AdamW: parameter, gradient, two moments in; three out
        "runtime/engine.py:publish_params": (4 + 2) * shard,  # fp32 master in, bf16 parameter out
    }
    if stage == 2 and world > 1:
        expected["runtime/reducer.py:_take_buffer"] = 2 * padded  # each staging buffer zeroed when taken
    engine = {site: b for site, b in moved.items() if site != "model" and b >= 1024}  # past bookkeeping scalars
    assert engine.keys() == expected.keys(), engine
    for site, value in expected.items():
        assert value <= engine[site] <= value + 64 * buckets, (site, engine[site], value)  # + per-bucket scalars
    kernels = [r for r in rows if r["site"] == "runtime/engine.py:materialize_grads" and r["read"] + r["written"]]
    # one conversion kernel for the whole shard store (stages 2-3), one per bucket of the full store (stages 0-1)
    assert sum(r["ops"] for r in kernels) == (1 if stage >= 2 else buckets)


def _labels(rank: int, world: int) -> list[list[str]]:
    comm = collectives.Communicator(device=torch.device("cpu"))
    tensor = torch.ones(8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        comm.all_reduce(tensor)
    inside = [e.name for e in prof.events() if e.name.startswith("hfzero::")]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pass
    comm.all_reduce(tensor)  # outside any profiler: no label entered
    return [inside, [collectives.label("x").__class__.__name__]]


def test_collective_labels_while_profiling():
    inside, outside = run_fake_rank(_labels, 2, timeout=1200)
    assert inside == ["hfzero::all_reduce"]
    assert outside == ["nullcontext"]


def test_collective_labels_fall_back_to_always(monkeypatch):
    monkeypatch.delattr(torch._C._autograd, "_profiler_enabled")
    check = collectives._profiler_check()
    assert check() is True
