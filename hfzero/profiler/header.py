"""The run header: what was run, where, and what the paper's formula predicts for it.

``build_header`` gathers the configuration, the model class and Ψ, the data-parallel degree, the
stage, dtypes, library versions, the host, and the estimator's predicted model-state bytes per rank
with the formula written out. It reads attributes only (no collective, no tensor allocation).
"""

from __future__ import annotations

import datetime
import platform
import socket
import sys
import time
from typing import Any

import torch

from hfzero.logging import get_logger
from hfzero.planning.models import model_activation_estimate, optimizer_kind
from hfzero.profiler.format import FORMAT_VERSION

logger = get_logger(__name__)

_STAGE_FORMULAS: dict[int, str] = {
    0: "({p} + {g} + {k})Ψ",
    1: "({p} + {g})Ψ + {k}Ψ/N_d",
    2: "{p}Ψ + ({g} + {k})Ψ/N_d",
    3: "({p} + {g} + {k})Ψ/N_d",
}
"""The paper's per-device model-state formula for each stage, with p, g and K filled in."""


def frozen_param_count(engine: Any) -> int:
    """Ψ_f: parameters of the engine's model outside its optimizer layout (frozen ones), counted whole."""
    count = getattr(engine, "num_frozen_params", None)  # stage 3: partitioned ones are 0-element tensors
    if count is None:
        layout = getattr(engine, "layout", None)
        if layout is None:
            return 0
        in_layout = set(layout.slots)
        count = sum(p.numel() for p in set(engine.model.parameters()) if p not in in_layout)
    return int(count)


def predict(engine: Any, optimizer: torch.optim.Optimizer, accumulation_steps: int = 1) -> dict[str, Any] | None:
    """The estimator's model-state bytes per rank for this run, with the formula and its inputs.

    ``model_state_bytes`` counts every model state wherever it lives (what the profile's
    ``model_state_bytes`` measures): the estimator's formula, or with the optimizer offloaded
    (the engine's ``offload``: not on a CPU device, where there is nothing to offload)
    ``device_model_state_bytes`` and ``host_model_state_bytes`` say where they live, what the records'
    ``model_state_bytes`` minus ``host_model_state_bytes`` and ``host_model_state_bytes`` measure.
    Returns None (and logs why) when the optimizer's kind is not one the estimator knows.
    """
    from hfzero.planning.estimate import (accumulator_held, checkpoint_staging_bytes, model_states_bytes,
                                 model_states_cpu_bytes, precision_bytes)

    kind = optimizer_kind(optimizer)
    if kind is None:
        logger.warning("optimizer %s is not one the estimator knows; the header has no prediction",
                       type(optimizer).__name__)
        return None
    config = engine.config
    p, g, k = precision_bytes(config.dtype, kind)
    persistent = int(getattr(engine, "num_persistent_params", 0) or 0)
    frozen = frozen_param_count(engine)
    inputs = {"num_params": int(engine.num_params), "dp": int(engine.world_size), "stage": int(engine.stage),
              "param_bytes": p, "grad_bytes": g, "optimizer_k": k, "persistent_params": persistent,
              "frozen_params": frozen, "accumulation_steps": int(accumulation_steps),
              "accumulation": config.accumulation_policy}
    formula = _STAGE_FORMULAS[inputs["stage"]].format(p=p, g=g, k=k)
    if frozen:
        formula += f" + {p}Ψ_f/N_d" if inputs["stage"] == 3 else f" + {p}Ψ_f"
    if persistent and inputs["stage"] == 3:
        formula += f" + {p}P(1 - 1/N_d)"
    if accumulator_held(inputs["stage"], config.accumulation_policy, accumulation_steps):
        formula += f" + {g}Ψ (local accumulator)"
    offloaded = offload_placement(engine)["offloaded"]
    if offloaded:
        formula += " with the K part" + (" and 4Ψ/N_d fp32 gradients" if inputs["stage"] >= 2 else "") + " on the host"
    parts = _partition_inputs(engine, inputs)
    if len(parts) > 1:
        formula += " for the dense parameters over N_d = the world, plus the same for the experts over N_e = edp"
    device = sum(model_states_bytes(**part, offload_optimizer=offloaded) for part in parts)
    host = sum(model_states_cpu_bytes(**{k: v for k, v in part.items() if k != "frozen_params"},
                                      offload_optimizer=offloaded) for part in parts)
    residuals = _error_feedback_bytes(engine, inputs["num_params"])
    if residuals:  # qgZ error feedback: fp32 residuals kept across steps (QUANT_RESIDUAL)
        formula += " + qgZ residuals 4Ψ(L > 1) + 4Ψ/L(nodes > 1)"
    staging = 0.0
    if getattr(config, "async_save", False):  # the staging buffer, held once the first save allocated it
        # it also holds a copy of the residuals (hfzero/checkpoint/residuals.py)
        staging = checkpoint_staging_bytes(inputs["num_params"], inputs["dp"], param_bytes=p, optimizer_k=k) + residuals
        formula += f" + {k + (4 if p >= 4 else 0)}Ψ/N_d checkpoint staging (host, after the first save)"
        host += staging
    extra = {}
    if inputs["stage"] == 3 and getattr(engine, "units", None):  # See [Note: stage-3 gather order]
        from hfzero.config import stage3_gathered_numel

        numels = [int(u.numel) for u in engine.units]
        extra["stage3_gathered_bytes"] = stage3_gathered_numel(numels[0], numels[1:], int(engine.prefetch_numel)) * p
    return {**extra,
        # offloaded, the host holds gradients in fp32 (and an fp32 master in fp32 runs): the sum of both sides
        "model_state_bytes": (device + host if offloaded
                              else sum(model_states_bytes(**part) for part in parts) + staging) + residuals,
        "device_model_state_bytes": device + residuals,
        "host_model_state_bytes": host,
        "formula": formula,
        "optimizer": kind,
        "inputs": inputs,
        **({"partition_inputs": parts} if len(parts) > 1 else {}),
    }


def _error_feedback_bytes(engine: Any, num_params: int) -> float:
    """qgZ error feedback's residuals per rank (``estimate_quantized.error_feedback_bytes``) for the nodes the
    engine's group spans; 0 without error feedback."""
    if not getattr(engine.config, "quantize_error_feedback", False) or engine.world_size < 2:
        return 0.0
    from hfzero.planning.quantized import error_feedback_bytes

    comm = engine.comm
    nodes = len({r // comm.ranks_per_node for r in comm.global_ranks})
    return error_feedback_bytes(num_params, engine.world_size, nodes=nodes)


def _partition_inputs(engine: Any, inputs: dict[str, Any]) -> list[dict[str, Any]]:
    """The estimator's inputs per layout partition: ``inputs`` alone, or under expert parallelism the dense
    parameters over the world and the experts over the edp group (See [Note: bucket partitions] in
    runtime/layout.py; ``hfzero.planning.estimate.expert_parallel_bytes`` is the same split)."""
    comms = getattr(engine, "partition_comms", None)
    if comms is None or len(comms) == 1:
        return [inputs]
    persistent = {b.index for b in engine._persistent_buckets()} if hasattr(engine, "_persistent_buckets") else set()
    parts = []
    for index, comm in enumerate(comms):
        buckets = [b for b in engine.layout.buckets if b.partition == index]
        parts.append(dict(inputs, num_params=sum(b.numel for b in buckets), dp=int(comm.world_size),
                          persistent_params=sum(b.numel for b in buckets if b.index in persistent),
                          frozen_params=inputs["frozen_params"] if index == 0 else 0))
    return parts


def offload_placement(engine: Any) -> dict[str, Any]:
    """Where the engine's states live: ``offloaded`` (master weights, optimizer states and the shard's
    fp32 gradients in host memory), ``pinned`` (page-locked buffers exist: a CUDA device), ``pinned_roles``
    (the host roles whose buffers are page-locked: those DMA copies touch) and ``host_roles`` (the roles
    placed on the host, whose bytes the records' ``host_roles`` give)."""
    offload = getattr(engine, "offload", None)
    if offload is None:
        return {"offloaded": False, "pinned": False, "pinned_roles": [], "host_roles": []}
    roles = ["master_shard", "optim_state", "grad_shard" if engine.stage >= 2 else "grad_fp32", "grad_bucket"]
    buffers = {"master_shard": "master", "grad_bucket": "staging"}
    pinned = [r for r, b in buffers.items() if offload.pinned and offload.pin_plan[b]]
    return {"offloaded": True, "pinned": bool(offload.pinned), "pinned_roles": pinned, "host_roles": roles}


def build_header(*, run_id: str, engine: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 global_world_size: int, device: torch.device, every_n_steps: int,
                 cuda_snapshot: bool, accumulation_steps: int = 1,
                 pipeline: dict[str, Any] | None = None) -> dict[str, Any]:
    """The contents of ``header.json`` (see docs/profile-format.md for every key).

    ``pipeline``: under pipeline parallelism, the header's ``pipeline`` section
    (``hfzero.profiler.pipeline.header_section``); the top-level ``prediction`` is then null, since
    each stage has its own (``pipeline.ranks[i].model_state_bytes``).
    """
    import transformers

    from hfzero.version import __version__

    config = engine.config
    now = time.time()
    extra = {} if pipeline is None else {"pipeline": pipeline}
    return {**extra,
        "format_version": FORMAT_VERSION,
        "run_id": run_id,
        "start_time": datetime.datetime.fromtimestamp(now, datetime.timezone.utc).isoformat(),
        "start_unix": now,
        "world_size": int(engine.world_size),
        "global_world_size": int(global_world_size),
        "stage": int(engine.stage),
        "config": config.to_dict(),
        "accumulation": {"policy": config.accumulation_policy, "steps": int(accumulation_steps)},
        "comm_timing": engine.comm.timing,
        **_topology(engine, global_world_size),
        "model": {
            "class": type(model).__name__,
            "module": type(model).__module__,
            "num_params": int(engine.num_params),
            "num_params_padded": int(engine.num_params_padded),
            "num_frozen_params": frozen_param_count(engine),
            "num_frozen_persistent_params": int(getattr(engine, "num_frozen_persistent_params", 0)),
        },
        "dtypes": {"param": config.dtype, "grad": config.dtype,
                   "master": "fp32" if config.mixed_precision or offload_placement(engine)["offloaded"] else None},
        "optimizer_class": type(optimizer).__name__,
        "placement": offload_placement(engine),
        "device_type": device.type,
        "versions": {"hfzero": __version__, "torch": torch.__version__,
                     "transformers": transformers.__version__, "python": platform.python_version()},
        "host": {"hostname": socket.gethostname(), "platform": sys.platform},
        "profiler": {"every_n_steps": every_n_steps, "cuda_snapshot": cuda_snapshot},
        "prediction": predict(engine, optimizer, accumulation_steps) if pipeline is None else None,
    }


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def activation_prediction(model: torch.nn.Module, engine: Any, batch_size: int, seq_len: int,
                          device: torch.device) -> dict[str, Any] | None:
    """The activation model's figures for this run (``hfzero.planning.estimate.decoder_activation_bytes``) at
    the first recorded forward's (batch, sequence), in the parameters' dtype, or None (logged) when
    the model is not a whole transformers decoder the model knows (a pipeline stage holds only some
    layers). Reads attributes only."""
    dtype = next((_DTYPE_NAMES.get(p.dtype) for p in model.parameters() if p.is_floating_point()), None)
    if dtype is None:
        logger.debug("no activation prediction: %s has no fp32 / bf16 / fp16 parameter", type(model).__name__)
        return None
    estimate = model_activation_estimate(model, engine.config, batch_size, seq_len, dtype=dtype, device=device)
    return None if estimate is None else estimate.to_dict()


def _topology(engine: Any, global_world_size: int) -> dict[str, Any]:
    """The header's ``topology`` (issue 22; absent from earlier profiles and for engines without a node
    layout): ranks per node, nodes, the shard group's size (``world_size``) and its replicas (HSDP, 1 flat)."""
    per_node = getattr(engine.comm, "ranks_per_node", None)
    if per_node is None:
        return {}
    replicate = getattr(engine, "replicate", None)
    return {"topology": {"ranks_per_node": int(per_node), "nodes": max(int(global_world_size) // int(per_node), 1),
                         "shard_size": int(engine.world_size),
                         "replicate_size": int(replicate.world_size) if replicate is not None else 1}}
