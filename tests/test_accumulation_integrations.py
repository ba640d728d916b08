"""Gradient accumulation as the integrations run it, accumulation 4, stages 2 and 3, both policies:

- ZeroAccelerator's ``accumulate()`` (worlds 2 and 4) and ZeroTrainer (world 2), inside spawned groups;
- "sharded": the peak model-state bytes, sampled after every micro-batch's backward, are the stage's
  formula (no full gradient is ever held); "local": the formula plus the full accumulator, reported as
  a model state; communication per step n_micro x Ψ + Ψ ("sharded") or 2Ψ ("local") at stage 2;
- accelerate losses within the rounding bounds of a float64 run of the same global batches
  (hfzero/testing/parity.py; a fixed 1e-5 against an fp32 run holds for one CPU's reduction order and not
  another's); ZeroTrainer losses within 1e-5 of transformers' own single-process Trainer (its sampler
  shuffles the rows, so not the float64 run's batches);
- fp16 in an accelerate loop: a step skipped for overflow does not advance the LR scheduler.
"""

from __future__ import annotations

import functools

import pytest
import torch

import hfzero
from hfzero.testing import run_distributed
from hfzero.testing.models import micro_batches, tiny_causal_lm, token_batches
from hfzero.testing.parity import ParityReference, float64_reference
from hfzero.testing.workloads import param_groups

ACCUM, STEPS, GLOBAL_BATCH, SEQ = 4, 3, 16, 16
CASES = [(stage, policy) for stage in (2, 3) for policy in ("sharded", "local")]


def _config(stage: int, policy: str, **extra) -> hfzero.ZeroConfig:
    return hfzero.ZeroConfig(stage=stage, accumulation=policy, reduce_bucket_size=4096, param_persistence_threshold=0,
                             **extra)


def _expected_state_bytes(stage: int, policy: str, padded: int, world: int, buckets: int) -> int:
    """fp32 + AdamW: the parameters are their own master copy (4 B), gradients 4 B, Adam 8 B per element."""
    params = 4 * padded if stage < 3 else 4 * padded // world
    grads, adam = 4 * padded // world, 8 * padded // world
    accumulator = 4 * padded if policy == "local" else 0
    return params + grads + adam + accumulator + 4 * buckets  # + Adam's fp32 `step` per master slice


def _expected_comm(stage: int, policy: str, padded: int) -> dict[str, int]:
    reductions = 1 if policy == "local" else ACCUM
    gathers = padded if stage == 2 else 2 * padded * ACCUM
    return {"reduce_scatter": padded * reductions, "all_gather": gathers, "all_reduce": 2}


@functools.lru_cache(maxsize=None)
def _reference64() -> ParityReference:
    """Single-process AdamW (lr 1e-3, clipping at 1, constant LR) on the same global batches in float64, with the
    bounds of the accelerate runs: worlds 2 and 4 x accumulation 4 (the finest split, 16, one row each)."""
    return float64_reference(tiny_causal_lm("gpt2"), lambda model: torch.optim.AdamW(param_groups(model), lr=1e-3),
                             token_batches(STEPS, GLOBAL_BATCH, SEQ), 1.0, run_splits=(2 * ACCUM, 4 * ACCUM))


def _accelerate_run(rank: int, world: int, stage: int, policy: str) -> dict:
    from hfzero.integrations.accelerate import ZeroAccelerator

    accelerator = ZeroAccelerator(zero_config=_config(stage, policy), gradient_accumulation_steps=ACCUM,
                                  cpu=True)  # CPU models on gloo, also on a GPU host
    model = tiny_causal_lm("gpt2")
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(param_groups(model), lr=1e-3))
    engine = hfzero.get_engine(model)
    losses, peak, comm = [], 0, []
    for batch in token_batches(STEPS, GLOBAL_BATCH, SEQ):
        before, total = engine.comm.stats(), 0.0
        for ids in micro_batches(batch, rank, world, ACCUM):
            with accelerator.accumulate(model):
                loss = model(input_ids=ids, labels=ids).loss
                total += loss.item() / ACCUM
                accelerator.backward(loss)
                peak = max(peak, engine.model_state_bytes())
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
        after = engine.comm.stats()
        comm.append({k: after[k].elements - (before[k].elements if k in before else 0) for k in after
                     if after[k].elements != (before[k].elements if k in before else 0)})
        losses.append(accelerator.reduce(torch.tensor([total]), reduction="mean").item())
    accelerator.free_memory()
    return {"losses": losses, "peak": peak, "comm": comm, "padded": engine.num_params_padded,
            "buckets": len(engine.layout.buckets), "policy": engine.accumulation}


def _fp16_scheduler_run(rank: int, world: int) -> dict:
    """fp16 with an overflow injected on rank 1 at step 1: the scheduler stays at its step on every rank."""
    from hfzero.integrations.accelerate import ZeroAccelerator

    accelerator = ZeroAccelerator(zero_config=hfzero.ZeroConfig(stage=2), mixed_precision="fp16", cpu=True)
    model = tiny_causal_lm("gpt2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    counts, skipped = [], []
    for step, batch in enumerate(token_batches(3, 4, 8)):
        (ids,) = micro_batches(batch, rank, world, 1)
        loss = model(input_ids=ids, labels=ids).loss
        if step == 1 and rank == 1:
            loss = loss * float("inf")
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        skipped.append(optimizer.step_was_skipped)
        counts.append(scheduler.scheduler.last_epoch)
    accelerator.free_memory()
    return {"last_epoch": counts, "skipped": skipped}


class _Sampler:
    """A TrainerCallback sampling the engine's model-state bytes after every micro-batch and step."""

    def __init__(self):
        from transformers import TrainerCallback

        sampler = self

        class Callback(TrainerCallback):
            def on_substep_end(self, args, state, control, model=None, **kwargs):
                sampler.sample(model)

            def on_step_end(self, args, state, control, model=None, **kwargs):
                sampler.sample(model)

        self.callback = Callback()
        self.peak = 0
        self.engine = None

    def sample(self, model) -> None:
        self.engine = hfzero.get_engine(model)
        self.peak = max(self.peak, self.engine.model_state_bytes())


def _rows(world: int) -> list[dict]:
    """Equal-length rows, so per-rank micro-batch means average to the global mean."""
    batches = token_batches(STEPS, GLOBAL_BATCH, SEQ)
    return [{"input_ids": row, "labels": row} for batch in batches for row in batch]


def _trainer_losses(stage: int | None, policy: str | None, world: int, out_dir: str) -> tuple[list[float], int, dict]:
    from transformers import Trainer, TrainingArguments

    per_device = GLOBAL_BATCH // (ACCUM * world)
    common = dict(output_dir=out_dir, max_steps=STEPS, per_device_train_batch_size=per_device,
                  gradient_accumulation_steps=ACCUM, learning_rate=1e-3, max_grad_norm=1.0, logging_steps=1,
                  report_to="none", disable_tqdm=True, save_strategy="no", seed=0, lr_scheduler_type="constant",
                  weight_decay=0.1, dataloader_drop_last=True, use_cpu=True)
    model = tiny_causal_lm("gpt2")
    if stage is None:
        trainer = Trainer(model=model, args=TrainingArguments(**common), train_dataset=_rows(world))
        sampler = None
    else:
        args = hfzero.ZeroTrainingArguments(**common, zero_stage=stage, zero_accumulation=policy,
                                            zero_reduce_bucket_size=4096, zero_param_persistence_threshold=0)
        sampler = _Sampler()
        trainer = hfzero.ZeroTrainer(model=model, args=args, train_dataset=_rows(world), callbacks=[sampler.callback])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if sampler is None:
        return losses, 0, {}
    engine = sampler.engine
    return losses, sampler.peak, {"padded": engine.num_params_padded, "buckets": len(engine.layout.buckets)}


def run_world(rank: int, world: int, with_trainer: bool, tmp: str) -> dict:
    out = {("accelerate", stage, policy): _accelerate_run(rank, world, stage, policy) for stage, policy in CASES}
    if with_trainer:
        out["fp16"] = _fp16_scheduler_run(rank, world)
        for stage, policy in CASES:
            out[("trainer", stage, policy)] = _trainer_losses(stage, policy, world, f"{tmp}/{stage}-{policy}")
    return out


@functools.lru_cache(maxsize=None)
def _results(world: int, tmp: str) -> list[dict]:
    return run_distributed(run_world, world, world == 2, tmp, timeout=900)


@pytest.fixture(scope="module")
def tmp_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("accumulation"))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage,policy", CASES)
def test_accelerate_accumulate(world, stage, policy, tmp_dir):
    for rank, out in enumerate(_results(world, tmp_dir)):
        got = out[("accelerate", stage, policy)]
        assert got["policy"] == policy
        assert got["peak"] == _expected_state_bytes(stage, policy, got["padded"], world, got["buckets"]), rank
        for step in got["comm"]:
            assert step == _expected_comm(stage, policy, got["padded"]), rank
        _reference64().check_losses(got["losses"], f"rank {rank} loss")


def _plain_trainer(rank: int, world: int, out_dir: str) -> list[float]:
    return _trainer_losses(None, None, world, out_dir)[0]


@functools.lru_cache(maxsize=None)
def _trainer_reference(tmp: str) -> list[float]:
    """transformers' own Trainer, one process, the same global batches (spawned: keeps accelerate's
    process-wide state out of the test process)."""
    return run_distributed(_plain_trainer, 1, f"{tmp}/reference", timeout=300)[0]


@pytest.mark.parametrize("stage,policy", CASES)
def test_trainer_accumulation(stage, policy, tmp_dir):
    reference = _trainer_reference(tmp_dir)
    for rank, out in enumerate(_results(2, tmp_dir)):
        losses, peak, layout = out[("trainer", stage, policy)]
        assert len(losses) == STEPS
        # Losses, not parameters: the elements whose rounding Adam amplifies (gradients summing to ~0) are
        # the ones that move a loss least; 3 steps of world 2 x 2 rows against world 1 x 4 rows differed by
        # at most 4.8e-7 (1 ulp; 1 and 2 threads per rank), the float64 run's loss bounds being ~7e-6.
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), atol=1e-5, rtol=0)
        assert peak == _expected_state_bytes(stage, policy, layout["padded"], 2, layout["buckets"]), rank


def test_fp16_overflow_does_not_advance_the_scheduler(tmp_dir):
    for out in _results(2, tmp_dir):
        assert out["fp16"]["skipped"] == [False, True, False]
        # accelerate steps a prepared scheduler once per process per optimizer step (split_batches=False)
        assert out["fp16"]["last_epoch"] == [2, 2, 4]
