"""Checkpoints and optimizer state dicts written before parameter slots were aligned still load.

tests/data/checkpoint_v1/ was written by the unaligned layout (see tests/data/make_checkpoint_v1.py):
world 2, a tiny GPT-2 trained 2 steps, a hfzero checkpoint at stage 2 (fp32) and stage 3 (bf16), each
rank's ``optimizer.state_dict()`` (state format 1) at stages 0 (bf16), 2 and 3, and the master weights
and optimizer states every parameter had then (``expected.safetensors``, read from the engines'
memory). One spawn of 2 ranks loads them into the aligned layout and compares, bit for bit, the
per-parameter master weights and optimizer states (and the parameters) with what was saved:
1. each rank alone (world 1) loads both checkpoints: rank 0 the stage-2 one at stage 3 (bf16) and the
   stage-3 one at stage 0 (fp32), rank 1 the stage-3 one at stage 3 and the stage-2 one at stage 0;
2. both ranks (world 2) load the stage-2 checkpoint at stage 3, the stage-3 one at stage 1;
3. both ranks load their format-1 state dicts at the stage, dtype and bucket size they were saved with
   (stage 0: each rank moves its whole buckets; stages 2 and 3: the collective upgrade). In fp32 the
   state dict holds no weights (the master weights are the parameters): the model's come first from
   the saved masters, as a resuming user restores them with ``model.load_state_dict``. Ranks loading
   state dicts that hold different tensors get a ConfigError on every rank (no collective mismatch).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from hfzero import ZeroConfig, prepare
from hfzero.config import ConfigError
from hfzero.checkpoint import load_checkpoint
from hfzero.runtime.stage3 import full_state_dict
from hfzero.testing import run_distributed
from hfzero.testing.models import tiny_causal_lm
from hfzero.testing.states import held_states, merge_states

DATA = Path(__file__).parent / "data" / "checkpoint_v1"
MODEL = {"hidden": 4, "layers": 1, "vocab": 37, "positions": 9}  # as in tests/data/make_checkpoint_v1.py
SAVED_BUCKET = 60


def _build(stage: int, dtype: str, bucket: int, group=None):
    model = tiny_causal_lm("gpt2", seed=7, **MODEL)  # another seed: the load must overwrite everything
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-2)
    return prepare(model, opt, ZeroConfig(stage=stage, dtype=dtype, reduce_bucket_size=bucket), process_group=group)


def _report(model, opt, label: str, stage: int) -> dict:
    params = full_state_dict(model, rank0_only=False) if stage == 3 else {
        n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    return {"label": label, "held": held_states(opt.engine), "params": params,
            "numels": {s.name: s.numel for s in opt.engine.layout.slots.values()}}


def _worker(rank: int, world: int) -> list[dict]:
    out = []
    alone = [dist.new_group([r]) for r in range(world)][rank]
    plan = [("stage2", 3, "bf16"), ("stage3", 0, "fp32")] if rank == 0 else [("stage3", 3, "fp32"), ("stage2", 0, "bf16")]
    for source, stage, dtype in plan:  # each rank builds one stage-3 engine first, on its own group
        model, opt = _build(stage, dtype, 100, alone)
        load_checkpoint(DATA / source, model, opt)
        out.append(_report(model, opt, f"world1-{source}-to-stage{stage}", stage))
    for source, stage, dtype in [("stage2", 3, "bf16"), ("stage3", 1, "fp32")]:
        model, opt = _build(stage, dtype, 100)
        load_checkpoint(DATA / source, model, opt)
        out.append(_report(model, opt, f"world2-{source}-to-stage{stage}", stage))
    for source, stage, dtype in [("stage0", 0, "bf16"), ("stage2", 2, "fp32"), ("stage3", 3, "bf16")]:
        model, opt = _build(stage, dtype, SAVED_BUCKET)
        state = torch.load(DATA / source / f"optimizer-rank{rank}.pt", map_location="cpu", weights_only=True)
        assert state["hfzero"]["format"] == 1
        if dtype == "fp32":
            weights = {name: values["master"] for name, values in _expected(source).items()}
            model.load_state_dict({n: weights[n].view(p.shape) for n, p in model.named_parameters()}, strict=False)
        opt.load_state_dict(state)
        out.append(_report(model, opt, f"statedict-{source}", stage))
    model, opt = _build(2, "fp32", SAVED_BUCKET)  # ranks whose states differ are refused on every rank, no hang
    state = torch.load(DATA / "stage2" / f"optimizer-rank{rank}.pt", map_location="cpu", weights_only=True)
    if rank == 1:
        del state["inner"]["state"][0]["exp_avg"]
    with pytest.raises(ConfigError, match="hold different tensors"):
        opt.load_state_dict(state)
    return out


def _expected(source: str) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(DATA / source / "expected.safetensors")).items():
        kind, name = key.split("/", 1)
        out.setdefault(name, {})[kind] = tensor
    return out


def test_unaligned_checkpoints_and_state_dicts_load_into_the_aligned_layout():
    results = run_distributed(_worker, 2)
    world1 = [r for rank in results for r in rank if r["label"].startswith("world1")]
    shared = [[r for r in rank if not r["label"].startswith("world1")] for rank in results]
    reports = [(r["label"], [r["held"]], r) for r in world1]
    reports += [(a["label"], [a["held"], b["held"]], a) for a, b in zip(*shared)]
    assert len(reports) == 4 + 2 + 3
    for label, held, report in reports:
        source = label.split("-")[1]
        expected = _expected(source)
        got = merge_states(held, report["numels"])
        assert set(got) == set(expected), label
        for name, values in expected.items():
            assert set(got[name]) == set(values), (label, name)
            for key, value in values.items():
                assert torch.equal(got[name][key], value), f"{label}: {key} of {name} differs"
        if report["params"] is not None:
            for name, values in expected.items():
                param = report["params"][name]
                assert torch.equal(param.float().reshape(-1), values["master"].to(param.dtype).float()), (label, name)


