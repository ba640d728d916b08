"""Section: rank 0 of a fake world of 8 (torch's fake process group: collectives move nothing, sizes are
real), stages 1-3 bf16 + AdamW on a ~350M-parameter GPT-2 (hidden 1024, 24 layers, vocab 50257; --quick: a
tiny one on the CPU), **each stage in a process of its own** (``run_fake_rank``; concurrently on CUDA, where
every figure is the process's own allocator's), so no stage's figures carry another's memory.

Checks, per stage: the engine's model-state bytes equal the paper's formula on the padded count
(hfzero/testing/fake_world.py); the engine is garbage-collected once the model and optimizer are dropped
(a weak reference: [Note: engine lifetime]); stage 3: every step gathers units (not vacuous) and after each
step the unit buffers hold nothing ("resized" storages at 0 bytes; on CUDA the caching allocator is their
pool; See [Note: stage-3 gather buffers]). Across stages:
model states fall with the stage. On CUDA also: after a step the allocator holds at least the model states
and at most all the engine's roles plus 256 MiB; the peak reserved is flat from step 2 (no allocator churn
from the gathers); each stage's peak allocated is below the stage before's; once the engine is freed,
allocated is back within 128 MiB of the process's baseline; peaks are reported against the formula."""

from __future__ import annotations

import concurrent.futures
from typing import Any

from hfzero.testing import WorkerFailure, run_fake_rank
from hfzero.testing.fake_world import FakeMemorySpec, measure_rank
from hfzero.testing.gpu_check.common import Checks, Options

WORLD = 8
SLACK = 256 << 20
"""Allocated bytes after a step beyond the engine's roles: model buffers, the allocator's rounding (512 B
blocks), cuBLAS workspaces and what the loss / optimizer leave cached."""
FREED_SLACK = 128 << 20
"""Allocated bytes left once the engine is freed, over the process's baseline: cuBLAS workspaces and
the last batch (the smallest stage's model states here are ~700 MB)."""


def _one(spec: FakeMemorySpec, timeout: float) -> dict[str, Any]:
    try:
        return run_fake_rank(measure_rank, WORLD, [spec], timeout=timeout)[0]
    except WorkerFailure as error:  # this stage's process failed: its row says why, the others stand
        return {"stage": spec.stage, "error": str(error)[-3000:]}


def run(options: Options, checks: Checks) -> dict[str, Any]:
    cuda = options.device == "cuda"
    size = {"hidden": 64, "layers": 2, "vocab": 256} if options.quick else {"hidden": 1024, "layers": 24, "vocab": 50257}
    specs = [FakeMemorySpec(stage, "bf16", steps=3, seq_len=16 if options.quick else 512, batch=1,
                            device=options.device, **size) for stage in (1, 2, 3)]
    timeout = 500 if options.quick else 80
    with concurrent.futures.ThreadPoolExecutor(max_workers=3 if cuda else 1) as pool:
        results = list(pool.map(lambda spec: _one(spec, timeout), specs))
    summary: dict[str, Any] = {}
    for r in results:
        name = f"stage {r['stage']}"
        if not checks.add(f"{name}: ran in its own process", "error" not in r, r.get("error", "")):
            continue
        checks.figure(name, {k: v for k, v in r.items() if not isinstance(v, dict)})
        states = r["model_state_bytes"]
        checks.add(f"{name}: model states == formula on the padded count",
                   all(s == r["formula_padded_bytes"] for s in states),
                   f"measured {states}, formula {r['formula_padded_bytes']:.0f} (on Psi {r['formula_bytes']:.0f})")
        checks.add(f"{name}: the engine is freed once the model and optimizer are dropped", r["engine_freed"],
                   "weakref.ref(engine)() is None after del + gc.collect()")
        row: dict[str, Any] = {"num_params": r["num_params"], "model_state_bytes": states[-1],
                               "formula_bytes": r["formula_bytes"], "engine_freed": r["engine_freed"]}
        if r["stage"] == 3:
            gathers, held = r["gathers"], r["unit_bytes_after_step"]
            checks.add(f"{name}: every step gathers and the unit buffers ({r['gather_kind']}) hold nothing after it",
                       all(g > 0 for g in gathers) and held == [0] * len(held) and r["gathered_after_step"][-1] == 0,
                       f"per step: gathers {gathers}, unit bytes held after {held}")
            row.update(gathers_per_step=gathers[-1], gather_kind=r["gather_kind"])
        if cuda:
            roles = sum(r["roles_after_step"].values())
            allocated = r["cuda_allocated_after_step"][-1] - r["cuda_allocated_before_model"]
            checks.add(f"{name}: CUDA allocated after a step within [model states, roles + 256 MiB]",
                       r["model_state_roles_after_step"] <= allocated <= roles + SLACK,
                       f"allocated {allocated}, model states {r['model_state_roles_after_step']}, all roles {roles}")
            reserved = r["cuda_peak_reserved"]
            checks.add(f"{name}: CUDA peak reserved flat from step 2", reserved[-1] == reserved[1], reserved)
            left = r["cuda_allocated_after_free"] - r["cuda_allocated_before_model"]
            checks.add(f"{name}: CUDA allocated back to the baseline (+128 MiB) once the engine is freed",
                       left <= FREED_SLACK, f"{left} bytes left")
            peak = r["cuda_peak_allocated"][-1] - r["cuda_allocated_before_model"]
            row.update(peak_allocated=peak, peak_reserved=reserved[-1], allocated_after_free=left,
                       peak_allocated_over_formula=round(peak / r["formula_bytes"], 3),
                       peak_reserved_over_formula=round(reserved[-1] / r["formula_bytes"], 3))
        summary[name] = row
    done = [summary[f"stage {s}"] for s in (1, 2, 3) if f"stage {s}" in summary]
    if len(done) == 3:
        states = [row["model_state_bytes"] for row in done]
        checks.add("model states fall with the stage", states[0] > states[1] > states[2], states)
        if cuda:
            peaks = [row["peak_allocated"] for row in done]
            checks.add("CUDA peak allocated falls with the stage", peaks[0] > peaks[1] > peaks[2], peaks)
    not_run = [] if cuda else ["CUDA allocator checks (peaks, reserved, after-step and after-free bytes)"]
    return {"summary": summary, "not_run": not_run, "runs": results}
