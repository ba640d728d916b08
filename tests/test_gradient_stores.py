"""The gradient stores are not zeroed between steps ([Note: gradient stores] in runtime/reducer.py): a parameter's
first gradient of a step is copied in, what no gradient reached is zeroed before it is read. Checked against
DDP at world 1 (stages 2-3 write the shard in place, no staging) and world 2, stages 0-3: a head every rank uses
on some steps only (its slots hold the previous step's gradient until they are settled), two backward passes per
step without and with no_sync, and a step with no backward at all (every gradient zero)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import hfzero
from hfzero.testing import run_distributed
from hfzero.testing.models import micro_batches, tiny_causal_lm, token_batches

STEPS = 4


class SometimesHead(nn.Module):
    """A causal LM plus a head that every rank uses on even steps only."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lm = tiny_causal_lm("gpt2")
        self.head = nn.Linear(32, 4)

    def forward(self, input_ids, step):
        out = self.lm(input_ids=input_ids, labels=input_ids, output_hidden_states=True)
        if step % 2 == 0:
            return out.loss + self.head(out.hidden_states[-1]).pow(2).mean()
        return out.loss


def _train(model, optimizer, rank, world, accumulation, no_sync, zero: bool) -> list[float]:
    losses = []
    for step, batch in enumerate(token_batches(STEPS, 8, 16)):
        micro = micro_batches(batch, rank, world, accumulation)
        for index, ids in enumerate(micro):
            loss = model(ids, step) / accumulation
            if no_sync and index < len(micro) - 1:
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
        if not zero:  # DDP leaves the head's .grad None on odd steps; hfzero steps it with a zero gradient
            for p in model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def run_cases(rank: int, world: int, cases: list[tuple[int, int, bool]]) -> dict:
    out = {}
    for stage, accumulation, no_sync in cases:
        ddp = nn.parallel.DistributedDataParallel(SometimesHead(), find_unused_parameters=True)
        ddp_losses = _train(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3, fused=True), rank, world,
                            accumulation, no_sync, zero=False)
        model = SometimesHead()
        extra = {"param_persistence_threshold": 0} if stage == 3 else {}
        model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
                                          hfzero.ZeroConfig(stage=stage, reduce_bucket_size=2048, **extra))
        losses = _train(model, optimizer, rank, world, accumulation, no_sync, zero=True)
        if stage == 3:
            full = hfzero.full_state_dict(model, rank0_only=False)
            params = {n: full[n] for n, _ in model.named_parameters()}
        else:
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        out[(stage, accumulation, no_sync)] = (ddp_losses, {n: p.detach().clone() for n, p in
                                                            ddp.module.named_parameters()}, losses, params)
    return out


def step_without_backward(rank: int, world: int, stage: int) -> list[float]:
    """After a trained step and zero_grad, the next step's gradients (read at the step) are all zero."""
    model = tiny_causal_lm("gpt2")
    extra = {"param_persistence_threshold": 0} if stage == 3 else {}
    model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      hfzero.ZeroConfig(stage=stage, reduce_bucket_size=2048, **extra))
    ids = token_batches(1, 8, 16)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    engine = hfzero.get_engine(model)
    engine.materialize_grads()
    return [float(m.grad.abs().max()) for m in engine.master_views]


CASES = {  # (stage, micro-batches, no_sync): world 1 where stages 2-3 write the shard in place, world 2 staged
    1: [(0, 1, False), (1, 2, True), (2, 1, False), (2, 2, False), (2, 2, True), (3, 2, False)],
    2: [(0, 2, False), (1, 1, False), (1, 2, True), (2, 2, False), (2, 2, True), (3, 1, False)],
}


@functools.lru_cache(maxsize=None)
def _results(world: int):
    return run_distributed(run_cases, world, CASES[world], timeout=1800)


@pytest.mark.parametrize("world,case", [(w, c) for w, cases in CASES.items() for c in cases],
                         ids=[f"world{w}-stage{s}-acc{a}{'-no_sync' if n else ''}"
                              for w, cases in CASES.items() for s, a, n in cases])
def test_sometimes_used_head_matches_ddp(world, case):
    for rank, results in enumerate(_results(world)):
        ddp_losses, ddp_params, losses, params = results[case]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ddp_losses), atol=1e-5, rtol=0)
        for name, value in ddp_params.items():
            torch.testing.assert_close(params[name], value, atol=1e-5, rtol=0, msg=lambda m: f"{rank} {name}: {m}")


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_step_without_backward_sees_zero_gradients(world, stage):
    for rank, maxima in enumerate(run_distributed(step_without_backward, world, stage, timeout=300)):
        assert maxima and all(m == 0.0 for m in maxima), (rank, maxima)
