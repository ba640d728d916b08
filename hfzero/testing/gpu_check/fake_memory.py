"""Section: rank 0 of a fake world of 8 (torch's fake process group, one process: collectives move
nothing, sizes are real), stages 1-3 bf16 + AdamW on a ~350M-parameter GPT-2 (hidden 1024, 24 layers,
vocab 50257; --quick: a tiny one on the CPU). Checks: the engine's model-state bytes equal the paper's
formula on the padded count (hfzero/testing/fake_world.py); stage 3's unit buffers hold no memory after a
step (CUDA: "resized" storages at 0 bytes; the caching allocator is their pool). On CUDA also: after a step the allocator holds at least the model states and at most them
plus the engine's transient roles plus 256 MiB; the peak reserved is flat from step 2; peak allocated and
reserved are reported against the formula."""

from __future__ import annotations

from typing import Any

from hfzero.testing.fake_world import FakeMemorySpec, measure_rank
from hfzero.testing.gpu_check.common import Checks, Options, in_process_group

WORLD = 8
SLACK = 256 << 20
"""Allocated bytes after a step beyond the engine's roles: model buffers, the allocator's rounding (512 B
blocks), cuBLAS workspaces and what the loss / optimizer leave cached."""


def run(options: Options, checks: Checks) -> dict[str, Any]:
    cuda = options.device == "cuda"
    size = {"hidden": 64, "layers": 2, "vocab": 256} if options.quick else {"hidden": 1024, "layers": 24, "vocab": 50257}
    specs = [FakeMemorySpec(stage, "bf16", steps=3, seq_len=16 if options.quick else 512, batch=1,
                            device=options.device, **size) for stage in (1, 2, 3)]
    results = in_process_group(measure_rank, WORLD, specs, backend="fake")
    summary = {}
    for r in results:
        name = f"stage {r['stage']}"
        states = r["model_state_bytes"]
        checks.add(f"{name}: model states == formula on the padded count", all(s == r["formula_padded_bytes"]
                                                                               for s in states),
                   f"measured {states}, formula {r['formula_padded_bytes']:.0f} (on Psi {r['formula_bytes']:.0f})")
        row = {"num_params": r["num_params"], "model_state_bytes": states[-1], "formula_bytes": r["formula_bytes"]}
        if r["stage"] == 3:
            held = r["unit_bytes_after_step"]
            checks.add(f"{name}: unit buffers ({r['gather_kind']}) hold nothing after a step",
                       held == [0] * len(held) and r["gathered_after_step"][-1] == 0, held)
        if cuda:
            roles = sum(r["roles_after_step"].values())
            allocated = r["cuda_allocated_after_step"][-1]
            checks.add(f"{name}: CUDA allocated after a step within [model states, roles + 256 MiB]",
                       r["model_state_roles_after_step"] <= allocated <= roles + SLACK,
                       f"allocated {allocated}, model states {r['model_state_roles_after_step']}, all roles {roles}")
            reserved = r["cuda_peak_reserved"]
            checks.add(f"{name}: CUDA peak reserved flat from step 2", reserved[-1] == reserved[1], reserved)
            row.update(peak_allocated=r["cuda_peak_allocated"][-1], peak_reserved=reserved[-1],
                       peak_allocated_over_formula=round(r["cuda_peak_allocated"][-1] / r["formula_bytes"], 3),
                       peak_reserved_over_formula=round(reserved[-1] / r["formula_bytes"], 3))
        summary[name] = row
    return {"summary": summary, "runs": results}
