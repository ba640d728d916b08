"""Edge cases of the engine, each checked against torch DDP in the same process group:
frozen parameters, a module used on one rank only, a module no rank uses after step 0
(find_unused_parameters, stages 0-3), SGD with momentum, the non-default
communication paths (no overlap, native reduce-scatter on gloo), and a state_dict round trip."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hfzero
from hfzero.testing import run_distributed
from hfzero.testing.models import micro_batches, tiny_causal_lm, token_batches

STEPS = 6


class UsedOnce(nn.Module):
    """A causal LM plus a head that every rank uses at step 0 only (unused by all ranks afterwards)."""

    def __init__(self):
        super().__init__()
        self.lm = tiny_causal_lm("gpt2")
        self.head = nn.Linear(32, 4)
        self.calls = 0

    def forward(self, input_ids, rank):
        out = self.lm(input_ids=input_ids, labels=input_ids, output_hidden_states=True)
        self.calls += 1
        if self.calls == 1:
            return out.loss + self.head(out.hidden_states[-1]).pow(2).mean()
        return out.loss


class WithAuxHead(nn.Module):
    """A causal LM plus a head that only rank 0 uses (its parameters get no gradient on rank 1)."""

    def __init__(self):
        super().__init__()
        self.lm = tiny_causal_lm("gpt2")
        self.aux = nn.Linear(32, 4)

    def forward(self, input_ids, rank):
        out = self.lm(input_ids=input_ids, labels=input_ids, output_hidden_states=True)
        loss = out.loss
        if rank == 0:
            loss = loss + self.aux(out.hidden_states[-1]).pow(2).mean()
        return loss


def _model(case: str) -> nn.Module:
    if case == "once":
        torch.manual_seed(0)
        return UsedOnce()
    if case == "aux":
        torch.manual_seed(0)
        return WithAuxHead()
    model = tiny_causal_lm("gpt2")
    if case == "frozen":
        model.transformer.wpe.weight.requires_grad_(False)
        model.transformer.h[0].ln_1.requires_grad_(False)
    return model


def _optimizer(case: str, params) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    # fused=True on both sides: hfzero's CPU host step uses torch's fused kernel (runtime/host_step.py); the
    # for-loop kernel differs from it by up to an ulp per step, by how much depending on the CPU's vector
    # instructions, so the DDP side uses the same kernel and the comparison does not depend on the machine.
    if case == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01, fused=True)
    return torch.optim.AdamW(params, lr=1e-3, fused=True)


def _loss(model, case, ids, rank):
    return model(ids, rank) if case in ("aux", "once") else model(input_ids=ids, labels=ids).loss


def _train(model, optimizer, case, rank, world, steps, clip, zero: bool):
    losses = []
    for batch in steps:
        (ids,) = micro_batches(batch, rank, world, 1)
        loss = _loss(model, case, ids, rank)
        loss.backward()
        if zero:
            optimizer.clip_grad_norm_(clip)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _params(model):
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return {n: p.detach().clone() for n, p in model.module.named_parameters()}
    if hfzero.get_engine(model).stage == 3:
        full = hfzero.full_state_dict(model, rank0_only=False)
        return {n: full[n] for n, _ in model.named_parameters()}
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def run_cases(rank: int, world: int, cases: list[tuple[str, int, dict]]) -> dict:
    batches = token_batches(STEPS, 8, 16)
    out = {}
    for case, stage, extra in cases:
        ddp_model = nn.parallel.DistributedDataParallel(_model(case), find_unused_parameters=case in ("aux", "once"))
        ddp_opt = _optimizer(case, ddp_model.parameters())
        ddp_losses = _train(ddp_model, ddp_opt, case, rank, world, batches, 1.0, zero=False)
        model = _model(case)
        model, opt = hfzero.prepare(model, _optimizer(case, model.parameters()),
                                    hfzero.ZeroConfig(stage=stage, reduce_bucket_size=2048, **extra))
        losses = _train(model, opt, case, rank, world, batches, 1.0, zero=True)
        out[(case, stage, tuple(sorted(extra.items())))] = (ddp_losses, _params(ddp_model), losses, _params(model))
    return out


def round_trip(rank: int, world: int, stage: int) -> tuple[list[float], list[float]]:
    """Train 6 steps straight, or 3 steps + state_dict + a fresh engine loaded + 3 steps."""
    batches = token_batches(STEPS, 8, 16)

    def fresh():
        m = tiny_causal_lm("gpt2")
        return hfzero.prepare(m, torch.optim.AdamW(m.parameters(), lr=1e-3),
                              hfzero.ZeroConfig(stage=stage, dtype="bf16", reduce_bucket_size=2048))

    model, opt = fresh()
    straight = _train(model, opt, "plain", rank, world, batches, 1.0, zero=True)
    model, opt = fresh()
    first = _train(model, opt, "plain", rank, world, batches[:3], 1.0, zero=True)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = opt.state_dict()
    model, opt = fresh()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n])
    opt.load_state_dict(state)
    resumed = first + _train(model, opt, "plain", rank, world, batches[3:], 1.0, zero=True)
    dist.barrier()
    return straight, resumed


CASES = [("frozen", s, {}) for s in (0, 1, 2)] + [("aux", s, {}) for s in (0, 1, 2)] + \
        [("sgd", s, {}) for s in (1, 2)] + \
        [("once", s, {"find_unused_parameters": True}) for s in (0, 1, 2)] + \
        [("once", 3, {"find_unused_parameters": True, "param_persistence_threshold": 0})] + \
        [("plain", 2, {"overlap_comm": False}), ("plain", 1, {"reduce_scatter_impl": "native"}),
         ("plain", 2, {"reduce_scatter_impl": "native", "max_inflight_buckets": 1})]


@functools.lru_cache(maxsize=None)
def _results():
    return run_distributed(run_cases, 2, CASES, timeout=600)


@pytest.mark.parametrize("case,stage,extra", CASES, ids=[f"{c}-stage{s}-{'-'.join(e) or 'default'}" for c, s, e in CASES])
def test_matches_ddp(case, stage, extra):
    for rank, results in enumerate(_results()):
        ddp_losses, ddp_params, losses, params = results[(case, stage, tuple(sorted(extra.items())))]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ddp_losses), atol=1e-5, rtol=0)
        assert params.keys() == ddp_params.keys()
        for name, value in ddp_params.items():
            torch.testing.assert_close(params[name], value, atol=1e-5, rtol=0, msg=lambda m: f"{rank} {name}: {m}")


def test_frozen_parameters_stay_frozen_and_outside_the_layout():
    for results in _results():
        _, _, _, params = results[("frozen", 2, ())]
        torch.testing.assert_close(params["transformer.wpe.weight"], tiny_causal_lm("gpt2").transformer.wpe.weight)


@pytest.mark.parametrize("stage", [1, 2])
def test_state_dict_round_trip_resumes_exactly(stage):
    for straight, resumed in run_distributed(round_trip, 2, stage, timeout=300):
        assert straight == resumed
