"""A learning-rate scheduler built on the user's optimizer BEFORE ``hfzero.prepare`` (the usual order in
scripts) drives the shards: with warmup from 0, the weights stay put at step 0 and move from step 1,
exactly as in plain torch (single process, in this process: no group needed at world 1)."""

from __future__ import annotations

import warnings

import torch

import hfzero
from hfzero.testing.models import tiny_causal_lm, token_batches


def _train(zero_stage: int | None) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    model = tiny_causal_lm("gpt2")
    # The reference steps with the implementation a CPU engine's shards use (fused, runtime/host_step.py);
    # the for-loop one differs from it in the last bits.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, **({"fused": True} if zero_stage is None else {}))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, step / 2))  # warmup from 0
    if zero_stage is not None:
        model, optimizer = hfzero.prepare(model, optimizer, hfzero.ZeroConfig(stage=zero_stage))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    moved, lrs = [], []
    for batch in token_batches(4, 4, 8):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
        moved.append(max((p.detach() - before[n]).abs().max().item() for n, p in model.named_parameters()))
    assert start  # parameters captured before training
    return moved, lrs, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_scheduler_built_before_prepare_reaches_the_shards():
    ref_moved, ref_lrs, ref_params = _train(None)
    for stage in (1, 2, 3):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning either
            moved, lrs, params = _train(stage)
        assert moved[0] == 0.0 and ref_moved[0] == 0.0  # lr 0 during the first step
        assert moved[1] > 0.0  # the warmup reached the shards: weights move at step 1
        assert lrs == ref_lrs
        for name, value in ref_params.items():
            torch.testing.assert_close(params[name], value, atol=1e-6, rtol=0, msg=name)
