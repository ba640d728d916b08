"""Stage 3 takes gradients at rank-independent points, not in a Python hook per parameter (issue 34; [Note: gradients
collected at rank-independent points] in hfzero/runtime/reducer.py), 2 gloo ranks, fp32:

- a backward that reaches no stage-3 unit (a penalty on the persistent parameters alone: the scheduler sees none of
  it) before the model's backward, after it, or as the step's only backward, trains exactly like a single-process
  reference on both ranks' data; its gradients are taken as a reducer pass of their own at the next backward's
  start or at the step;
- nothing is left behind: no ``.grad`` set after the step, no parameter waiting to be collected;
- ``zero_grad`` after such a backward forgets its gradients like any others; after clipping, the step refuses it
  (the step's gradients were final), as it refuses any backward there; a model backward after clipping is refused
  inside the backward, and ``zero_grad`` then leaves no gradient behind.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import hfzero
from hfzero.testing.spawn import run_distributed
from test_stage3_grads_in_place import UNITS, _batch, _loss, _Reused

STEPS = 3


def _penalty(model: nn.Module) -> torch.Tensor:
    """A term on the blocks' biases only (persistent: 8 elements, under the threshold): its backward passes through no
    unit's output."""
    return 0.3 * sum((block.bias ** 2).sum() for block in model.blocks)


def _step(model: nn.Module, rank: int, world: int, step: int, mode: str, reference: bool) -> None:
    """One step's backward passes; the reference sums every rank's batch loss / world in one process."""
    ranks = range(world) if reference else [rank]
    if mode in ("penalty_first", "penalty_only"):
        _penalty(model).backward()
    if mode != "penalty_only":
        for r in ranks:
            (_loss(model, *_batch(r, step)) / (world if reference else 1)).backward()
    if mode == "penalty_last":
        _penalty(model).backward()


def _worker(rank: int, world: int) -> dict:
    out = {}
    for mode in ("penalty_first", "penalty_last", "penalty_only"):
        base = _Reused()
        reference = copy.deepcopy(base)
        config = hfzero.ZeroConfig(stage=3, dtype="fp32", param_persistence_threshold=20, reduce_bucket_size=64)
        model, optimizer = hfzero.prepare(base, torch.optim.AdamW(base.parameters(), lr=1e-2), config, units=UNITS)
        engine = hfzero.get_engine(model)
        ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        left = 0
        for step in range(STEPS):
            _step(model, rank, world, step, mode, reference=False)
            optimizer.step()
            optimizer.zero_grad()
            left += sum(p.grad is not None for p in model.parameters()) + len(engine.reducer._arrived)
            _step(reference, rank, world, step, mode, reference=True)
            for param in reference.parameters():  # the engine steps every parameter (zeros where none reached it)
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
            ref_optimizer.step()
            ref_optimizer.zero_grad()
        # a backward that reaches no unit, then zero_grad: its gradients are forgotten, nothing is reduced
        _penalty(model).backward()
        optimizer.zero_grad()
        left += sum(p.grad is not None for p in model.parameters()) + len(engine.reducer._arrived)
        got = hfzero.full_state_dict(model, rank0_only=False)
        out[mode] = {"left": left, "params": {k: v.detach().clone() for k, v in got.items()},
                     "want": {k: v.detach().clone() for k, v in reference.state_dict().items()}}
    # such a backward after clipping (the step's gradients are final): refused at the step, as any backward is
    _loss(model, *_batch(rank, 0)).backward()
    optimizer.clip_grad_norm_(1.0)
    _penalty(model).backward()
    try:
        optimizer.step()
        refused = ""
    except RuntimeError as error:
        refused = str(error)
    optimizer.zero_grad()
    # a model backward after clipping is refused inside the backward, at the first collect; zero_grad then leaves no
    # gradient behind, of that collect's batch either (a stale .grad would be added into the next step's)
    _loss(model, *_batch(rank, 0)).backward()
    optimizer.clip_grad_norm_(1.0)
    try:
        _loss(model, *_batch(rank, 1)).backward()
        refused_in_backward = ""
    except RuntimeError as error:
        refused_in_backward = str(error)
    optimizer.zero_grad()
    left_after_refusal = sum(p.grad is not None for p in model.parameters()) + len(engine.reducer._arrived)
    return {"modes": out, "refused": refused, "refused_in_backward": refused_in_backward,
            "left_after_refusal": left_after_refusal}


def test_backward_reaching_no_unit_trains_like_reference():
    for rank, result in enumerate(run_distributed(_worker, 2)):
        assert "backward after clip_grad_norm_()" in result["refused"], (rank, result["refused"])
        assert "backward after clip_grad_norm_()" in result["refused_in_backward"], (rank, result["refused_in_backward"])
        assert result["left_after_refusal"] == 0, (rank, result["left_after_refusal"])
        for mode, got in result["modes"].items():
            assert got["left"] == 0, (rank, mode)
            for name, value in got["want"].items():
                torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, n=name, mo=mode: f"rank {rank} {mo} {n}: {m}")
