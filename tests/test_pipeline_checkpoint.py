"""Checkpoints under pipeline parallelism: saved at pp=2 x dp=1 (ZeRO-2), resumed at pp=1 on one rank
(ZeRO-3) and on two (ZeRO-1, dp=2), saved there and resumed back at pp=2 (ZeRO-3): every resume's next
losses and final parameters, like the uninterrupted pp=2 run's, are the training's within the rounding
bounds of its float64 run (hfzero/testing/parity.py: each resume splits the batch its own way, so they are
not bitwise equal, and a fixed 1e-5 holds for one CPU's reduction order); ``consolidate`` of the pp=2
checkpoint is a ``from_pretrained`` directory equal to the trained weights. GPT-2 with tied embeddings
(both end stages hold the weight).

One spawn of 2 ranks runs everything (spawning is the expensive part).
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import hfzero
from hfzero.checkpoint import consolidate, load_checkpoint, save_checkpoint
from hfzero.parallel.pipeline import PipelineConfig
from hfzero.testing import run_distributed
from hfzero.testing.models import tiny_causal_lm, token_batches
from hfzero.testing.parity import ParityReference, float64_reference
from hfzero.testing.pipeline import stage_params
from hfzero.testing.workloads import param_groups

STEPS, K, BATCH, SEQ = 5, 2, 8, 16
NO_PERSIST = {"param_persistence_threshold": 0}


def _optimizer(model):
    return torch.optim.AdamW(param_groups(model), lr=1e-2)


def _pipeline(stage: int, seed: int):
    model = tiny_causal_lm("gpt2", seed=seed)
    config = hfzero.ZeroConfig(stage=stage, reduce_bucket_size=3000, **(NO_PERSIST if stage == 3 else {}))
    return hfzero.pipeline(model, _optimizer(model), config, PipelineConfig(pp_size=2, n_microbatches=2))


def _flat(stage: int, seed: int, group):
    model = tiny_causal_lm("gpt2", seed=seed)
    config = hfzero.ZeroConfig(stage=stage, reduce_bucket_size=2000, **(NO_PERSIST if stage == 3 else {}))
    return hfzero.prepare(model, _optimizer(model), config, process_group=group)


def _flat_params(model) -> dict[str, torch.Tensor]:
    """Every parameter whole, fp32 (a collective at stage 3)."""
    state = hfzero.full_state_dict(model, rank0_only=False)
    return {n: state[n].float().clone() for n, _ in model.named_parameters()}


def _train_flat(model, optimizer, batches, group) -> list[float]:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    losses = []
    for batch in batches:
        rows = batch.chunk(world)[rank]  # (B / world, T)
        loss = model(input_ids=rows, labels=rows).loss
        optimizer.backward(loss)
        optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone().reshape(1)
        dist.all_reduce(total, group=group)
        losses.append(float(total) / world)
    return losses


def _run(rank: int, world_size: int, root: str) -> dict:
    root_dir = Path(root)
    batches = token_batches(STEPS, BATCH, SEQ)
    out: dict = {}
    pipe = _pipeline(2, seed=0)
    for batch in batches[:K]:
        pipe.train_step(batch, max_grad_norm=1.0)
    out["at_k"] = stage_params(pipe)
    save_checkpoint(root_dir / "pp2", pipe, pipe.optimizer, extra={"step": K})
    out["reference"] = [pipe.train_step(b, max_grad_norm=1.0) for b in batches[K:]]
    out["final_reference"] = stage_params(pipe)
    del pipe

    solo = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
    model, optimizer = _flat(3, seed=1, group=solo[rank])
    assert load_checkpoint(root_dir / "pp2", model, optimizer) == {"step": K}
    out["pp1_world1"] = _train_flat(model, optimizer, batches[K:], solo[rank])
    out["final_pp1_world1"] = _flat_params(model)
    del model, optimizer

    model, optimizer = _flat(1, seed=2, group=dist.group.WORLD)
    load_checkpoint(root_dir / "pp2", model, optimizer)
    save_checkpoint(root_dir / "dp2", model, optimizer)
    out["pp1_world2"] = _train_flat(model, optimizer, batches[K:], dist.group.WORLD)
    out["final_pp1_world2"] = _flat_params(model)
    del model, optimizer

    pipe = _pipeline(3, seed=3)
    load_checkpoint(root_dir / "dp2", pipe, pipe.optimizer)
    out["back_at_pp2"] = [pipe.train_step(b, max_grad_norm=1.0) for b in batches[K:]]
    out["final_back_at_pp2"] = stage_params(pipe)
    if rank == 0:
        consolidate(root_dir / "pp2", root_dir / "export")
    dist.barrier()
    return out


@functools.lru_cache(maxsize=None)
def _results() -> tuple[list[dict], Path]:
    root = Path(tempfile.mkdtemp(prefix="hfzero-pp-ckpt-"))
    return run_distributed(_run, 2, str(root), timeout=900), root


@functools.lru_cache(maxsize=None)
def _reference64() -> ParityReference:
    """The training (seed 0, AdamW lr 1e-2, clipping at 1) in float64, with the bounds of its fp32 runs: the
    whole batch (pp=1 on one rank) or 2 micro-batches of 4 rows (pp=2's micro-batches, or dp=2's ranks), sampled
    there and at one row per chunk (BATCH = 8)."""
    return float64_reference(tiny_causal_lm("gpt2", seed=0), _optimizer, token_batches(STEPS, BATCH, SEQ), 1.0,
                             splits=BATCH, run_splits=(1, 2))


RUNS = ("reference", "pp1_world1", "pp1_world2", "back_at_pp2")
"""The uninterrupted pp=2 run and the resumes; pipeline runs hold their stage's parameters on each rank."""


def _final(outs: list[dict], run: str) -> dict[str, torch.Tensor]:
    return {**outs[0][f"final_{run}"], **outs[1][f"final_{run}"]}


def test_pp2_checkpoint_resumes_at_pp1_and_back() -> None:
    outs, _ = _results()
    reference = outs[0]["reference"]
    assert outs[1]["reference"] == reference and reference[0] != reference[-1]
    for rank, out in enumerate(outs):
        for run in RUNS:
            _reference64().check_losses(out[run], f"rank {rank} {run}: loss", first=K)
    for run in RUNS:
        _reference64().check_params(_final(outs, run), f"{run}: final ")


def test_pp2_checkpoint_consolidates_to_the_trained_weights() -> None:
    from transformers import AutoModelForCausalLM

    outs, root = _results()
    trained = {**outs[0]["at_k"], **outs[1]["at_k"]}
    exported = AutoModelForCausalLM.from_pretrained(root / "export").state_dict()
    assert set(trained) <= set(exported)
    for name, value in trained.items():
        torch.testing.assert_close(exported[name], value, atol=0, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
