"""``hfzero plan --verify``: run the plan's top configuration here, on CPU ranks (gloo), for a few
steps under the profiler, and compare each rank's measured peak with the plan's prediction.

Measured, per rank, from the profile (worst rank reported):
- model_states: the profile's ``model_state_bytes`` (peak of the model-state roles);
- transient: the peak over the records of the transient roles (buckets, gathered units; not activations);
- activations: the peak of the measured activation roles (``activations`` + ``act_checkpoint``);
- total: the peak over the records of model states + transient + activations held at once;
- runtime: the rank's RSS once torch, transformers and the process group are up, before the model;
- rss: the process's lifetime peak (VmHWM), beside the prediction plus the runtime bytes.
Pipeline and tensor-parallel configurations are not run here (a single ZeRO group).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from typing import Any

from hfzero.planning.plan import PlanRow, Workload


def verify(config_path: str, row: PlanRow, work: Workload, *, steps: int = 3, timeout: float = 600.0) -> dict[str, Any]:
    """Run ``row``'s configuration on ``dp`` gloo ranks for ``steps`` steps; return predicted and measured."""
    from hfzero.testing.spawn import run_distributed

    c = row.candidate
    if c.tp > 1 or c.pp > 1 or c.offload:
        raise ValueError("--verify runs data-parallel ZeRO configurations only (no tp, pp or offload)")
    with tempfile.TemporaryDirectory(prefix="hfzero-plan-") as root:
        results = run_distributed(_worker, c.dp, os.path.abspath(config_path), dataclasses.asdict(c), work.seq_len,
                                  work.dtype, steps, root, timeout=timeout)
        measured = _measured(root, c.dp)
    for rank, result in enumerate(results):
        measured[rank]["runtime"] = result["runtime"]
    worst = max(range(c.dp), key=lambda r: measured[r]["total"])
    return {"label": c.label(), "config": dataclasses.asdict(c), "steps": steps, "predicted": row.memory,
            "measured": measured[worst], "rank": worst, "per_rank": measured,
            "step_s": max(r["step_s"] for r in results), "predicted_step_s": row.time["total"],
            "ratio": measured[worst]["total"] / (row.memory["total"] - row.memory["runtime"])}


def _worker(rank: int, world: int, config_path: str, candidate: dict[str, Any], seq_len: int, dtype: str,
            steps: int, root: str) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from hfzero.planning import estimate as est
    from hfzero.config import ZeroConfig
    from hfzero.profiler import ZeroProfiler
    from hfzero.parallel.data_parallel import prepare

    import psutil

    runtime = psutil.Process().memory_info().rss  # the framework's own resident memory, before the model
    config = est.load_hf_config(config_path)
    torch.manual_seed(0)
    classifier = est.is_encoder_config(config) and not config.is_encoder_decoder
    model = (AutoModelForSequenceClassification if classifier else AutoModelForCausalLM).from_config(config).float()
    model.train()
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False  # a KV cache in training keeps copies of K and V the activation model omits
    if candidate["checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    zero = ZeroConfig(stage=candidate["stage"], accumulation=candidate["accumulation"], dtype=dtype)
    model, optimizer = prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4), zero)
    micro, batch = candidate["accumulation_steps"], candidate["micro_batch"]
    generator = torch.Generator().manual_seed(rank)
    times = []
    with ZeroProfiler(model, optimizer, root, accumulation_steps=micro):
        for _ in range(steps):
            start = time.perf_counter()
            for _ in range(micro):
                ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=generator)
                labels = torch.zeros(batch, dtype=torch.long) if classifier else ids
                (model(input_ids=ids, labels=labels).loss / micro).backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
    return {"step_s": sorted(times)[len(times) // 2], "runtime": float(runtime)}


def _measured(root: str, world: int) -> dict[int, dict[str, float]]:
    from hfzero.profiler.decompose import ACTIVATION_KEYS
    from hfzero.profiler.reader import load_run, summarize
    from hfzero.roles import MODEL_STATE_ROLES

    run = load_run(root)
    summary = {entry["rank"]: entry for entry in summarize(run)["ranks"]}
    states = {r.value for r in MODEL_STATE_ROLES}
    out = {}
    for rank, log in run.ranks.items():
        transient = activations = total = rss = 0.0
        for record in log.records:
            roles = record.get("roles") or {}
            parts = (sum(v for k, v in roles.items() if k in states),
                     sum(v for k, v in roles.items() if k not in states and k not in ACTIVATION_KEYS),
                     sum(v for k, v in roles.items() if k in ACTIVATION_KEYS))
            transient, activations, total = max(transient, parts[1]), max(activations, parts[2]), max(total, sum(parts))
            peak = record.get("peak") if record.get("kind") == "step" else None
            if isinstance(peak, dict):
                rss = max(rss, float(peak.get("peak_total") or 0))
        out[rank] = {"model_states": float(summary[rank]["model_state_bytes"] or 0), "transient": transient,
                     "activations": activations, "total": total, "rss": rss}
    return out
