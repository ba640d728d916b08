"""Every multi-process training case of the engine suite, run once per world size and cached.

Spawning and importing torch dominate the cost on 2 cores, so all cases for a world size share one
spawned process group (see hfzero.testing.workloads.train_many).
"""

from __future__ import annotations

import functools

from hfzero.testing import run_distributed
from hfzero.testing.workloads import TrainSpec, train_many, train_reference, train_reference64

MODELS = ("gpt2", "llama")
STAGES = (0, 1, 2, 3)
ACCUMULATION = ((1, False), (4, False), (4, True))
# The tiny test models are below the default persistence threshold: 0 makes stage 3 partition them all.
STAGE3 = (("param_persistence_threshold", 0),)


# The accumulation policy each stage does not pick by default (see ZeroConfig.accumulation).
OTHER_POLICY = {0: "sharded", 1: "sharded", 2: "local", 3: "local"}


def _spec(stage: int, policy: str = "auto", **kwargs) -> TrainSpec:
    extra = (STAGE3 if stage == 3 else ()) + ((("accumulation", policy),) if policy != "auto" else ())
    return TrainSpec(stage=stage, extra_config=extra, **kwargs)


FP32_CASES = ([_spec(s, model=m, accumulation=a, no_sync=ns) for m in MODELS for s in STAGES for a, ns in ACCUMULATION]
              + [_spec(s, OTHER_POLICY[s], model=m, accumulation=4, no_sync=True) for m in MODELS for s in STAGES])
BF16_CASES = [_spec(s, model="gpt2", dtype="bf16") for s in STAGES]
FP16_CASES = [_spec(s, model="gpt2", dtype="fp16", overflow_step=3, steps=6) for s in STAGES]
MEMORY_CASES = [_spec(s, model="gpt2", dtype="bf16", steps=2, max_grad_norm=None) for s in STAGES]
ACCUMULATION_MEMORY_CASES = [_spec(s, p, model="gpt2", dtype="bf16", steps=2, max_grad_norm=None, accumulation=4,
                                   no_sync=True) for s in (2, 3) for p in ("sharded", "local")]


def cases(world: int) -> list[TrainSpec]:
    extra = BF16_CASES + FP16_CASES if world == 2 else []
    return FP32_CASES + extra + [s for s in MEMORY_CASES + ACCUMULATION_MEMORY_CASES if s not in extra]


@functools.lru_cache(maxsize=None)
def results(world: int) -> dict[TrainSpec, list[dict]]:
    """spec -> per-rank result dicts of train_zero."""
    specs = cases(world)
    per_rank = run_distributed(train_many, world, specs, timeout=900)
    return {spec: [rank_results[i] for rank_results in per_rank] for i, spec in enumerate(specs)}


WORLDS = (1, 2, 4)
RUN_SPLITS = tuple(sorted({world * accumulation for world in WORLDS for accumulation, _ in ACCUMULATION}))
"""Worlds 1, 2, 4 x accumulation 1 and 4: the micro-batch splits of the fp32 cases (the finest, 16, one row each)."""


@functools.lru_cache(maxsize=None)
def reference64(model: str):
    """The float64 run of the fp32 cases with the rounding bounds of every one of them (hfzero.testing.parity)."""
    return train_reference64(TrainSpec(model=model), RUN_SPLITS)


@functools.lru_cache(maxsize=None)
def reference(model: str, steps: int = 10):
    return train_reference(TrainSpec(model=model, steps=steps))


def policy_of(spec: TrainSpec) -> str:
    """The accumulation policy ``spec`` runs with ("auto" resolved by stage)."""
    chosen = dict(spec.extra_config).get("accumulation", "auto")
    return chosen if chosen != "auto" else ("sharded" if spec.stage >= 2 else "local")


def case_id(spec: TrainSpec) -> str:
    policy = dict(spec.extra_config).get("accumulation")
    return (f"{spec.model}-{spec.dtype}-stage{spec.stage}-accum{spec.accumulation}"
            f"{'-nosync' if spec.no_sync else ''}{'-' + policy if policy else ''}")
