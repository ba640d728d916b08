"""``--zero_stage auto``: pick the lowest ZeRO stage whose per-rank memory fits, once the model is known.

``resolve_auto_stage(config, model, optimizer, ...)`` measures the budget (``memory_budget_bytes``, else
free CUDA memory, or on a CPU the available RAM divided by the ranks on the host, plus the bytes of the
model's parameters already loaded there, the minimum over the ranks (one all_reduce), less
``DEFAULT_HEADROOM``), builds the estimator's table for this model (``hfzero.planning.estimate.stage_table``:
model states with frozen and persistent parameters, the accumulation policy's buffer, the activation
bytes reserved for the batch: the decoder activation model's device peak for a transformers model,
with its checkpointing and the config's tp_size / P_a / P_a+cpu, else the older per-layer estimate,
see ``activation_reserve``), logs it, and returns the config with ``stage`` an int. No stage fitting is an
EstimateError holding the table. The Trainer and accelerate integrations call it before
``hfzero.prepare``; so can a custom loop.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
from torch import nn

from hfzero.planning import estimate as est
from hfzero.config import STAGE_AUTO, ZeroConfig
from hfzero.logging import get_logger
from hfzero.planning.models import model_activation_estimate, optimizer_kind

logger = get_logger(__name__)


def free_bytes(device: torch.device, ranks_per_host: int) -> float:
    """Memory this rank may still take, as it measures it: free CUDA memory, or available RAM / ranks per
    host. The model already loaded is not free (see ``device_budget_bytes``)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free)
    import psutil

    return psutil.virtual_memory().available / max(1, ranks_per_host)


def resident_bytes(model: nn.Module, device: torch.device) -> int:
    """Bytes of ``model``'s parameters already on ``device`` (tied ones once)."""
    params = dict.fromkeys(p for p in model.parameters() if p.device == device)
    return sum(p.numel() * p.element_size() for p in params)


def device_budget_bytes(device: torch.device, ranks_per_host: int, resident: int = 0) -> float:
    """Bytes one rank may use for its model states and activations, before headroom: the free memory it
    measures plus the ``resident`` bytes of the model's parameters already loaded there. The stage table
    counts those parameters among the model states (and ZeRO replaces them by its own buffers), so leaving
    them out of the free memory would count them twice."""
    return free_bytes(device, ranks_per_host) + resident


def agreed_budget(budget: float) -> float:
    """The smallest ``budget`` over the ranks (each measures its own free memory, and they can disagree), so
    every rank picks the same stage. Collective over the world group when torch.distributed is initialized:
    one all_reduce(MIN), on every rank at the same point (resolve_auto_stage's measuring branch, which
    depends on the config only)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return budget
    from hfzero.comm.collectives import Communicator

    comm = Communicator()  # See [Note: collective device] in hfzero/devices.py
    value = torch.tensor([budget], dtype=torch.float64, device=comm.device)
    comm.all_reduce(value, op=dist.ReduceOp.MIN)
    return float(value.item())


def activation_reserve(model: nn.Module, config: ZeroConfig, batch: tuple[int, int] | None, dtype_bytes: int,
                       device: torch.device) -> tuple[float, str]:
    """Activation bytes to reserve per rank for one micro-batch ``batch`` = (size, sequence), and which
    estimate gave them. A whole transformers model whose config the decoder activation model reads
    (``hfzero.planning.estimate.decoder_activation_bytes``) gets that model's device peak (``total``), with the
    model's checkpointing flag and the config's tp_size / P_a / P_a+cpu; any other module with a
    transformer config gets the older per-layer estimate (``hfzero.planning.estimate.activation_bytes``,
    Korthikanti et al.); neither (or no batch): 0."""
    model_config = getattr(model, "config", None)
    if model_config is None or batch is None:
        return 0.0, "none"
    decoder = model_activation_estimate(model, config, batch[0], batch[1], dtype=dtype_bytes, device=device)
    if decoder is not None:
        return float(decoder.total), "decoder activation model"
    try:
        shape = est.TransformerShape.from_hf_config(model_config)
    except est.EstimateError as err:
        logger.info("auto stage: no activation estimate for %s (%s)", type(model).__name__, err)
        return 0.0, "none"
    return est.activation_bytes(shape, batch[1], batch[0], dtype_bytes=dtype_bytes).total, "per-layer estimate"


def default_seq_len(model: nn.Module) -> int | None:
    """The model's longest sequence (its position limit), an upper bound when the data's is unknown."""
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def resolve_auto_stage(config: ZeroConfig, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                       world_size: int, ranks_per_host: int | None = None, accumulation_steps: int = 1,
                       batch: tuple[int, int] | None = None, device: torch.device | None = None) -> ZeroConfig:
    """``config`` with ``stage="auto"`` replaced by the stage the estimator's table picks (else unchanged).

    ``batch``: (micro-batch size, sequence length) per rank for the activation estimate (None: no
    activations counted). ``accumulation_steps`` > 1 counts the "local" accumulation buffer where the
    policy keeps one (``ZeroConfig.accumulation`` when present, else "auto"). Collective when the budget
    is measured (no ``memory_budget_bytes``): every rank calls it, as the integrations do (``agreed_budget``).
    """
    if config.stage != STAGE_AUTO:
        return config
    params = list(dict.fromkeys(model.parameters()))
    in_optimizer = {p for group in optimizer.param_groups for p in group["params"]}
    trainable = sum(p.numel() for p in params if p.requires_grad and p in in_optimizer)
    frozen = sum(p.numel() for p in params if not (p.requires_grad and p in in_optimizer))
    persistent = sum(p.numel() for p in params if p.numel() < config.param_persistence_threshold)
    p_bytes, g_bytes, k = est.precision_bytes(config.dtype, optimizer_kind(optimizer) or "adam")
    device = device or (params[0].device if params else torch.device("cpu"))
    ranks = ranks_per_host or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if config.memory_budget_bytes:
        budget, source = float(config.memory_budget_bytes), "memory_budget_bytes"
    else:
        measured = device_budget_bytes(device, ranks, resident_bytes(model, device))
        budget = (1 - est.DEFAULT_HEADROOM) * agreed_budget(measured)
        source = (f"{device.type} memory of {ranks} rank(s) per host with the loaded parameters added back, the "
                  f"smallest over the ranks, less {est.DEFAULT_HEADROOM:.0%} headroom")
    activations, activation_source = activation_reserve(model, config, batch, p_bytes, device)
    # HSDP: model states are sharded over the shard group, not the whole world (docs/multinode.md)
    rows = est.stage_table(trainable, config.shard_size or world_size, budget, activation_bytes=activations,
                           accumulation=getattr(config, "accumulation", "auto"), accumulation_steps=accumulation_steps,
                           param_bytes=p_bytes, grad_bytes=g_bytes, optimizer_k=k, persistent_params=persistent,
                           frozen_params=frozen,
                           # on a CPU device nothing is offloaded (see runtime/offload.py): host memory is the budget
                           offload_optimizer=config.offload_optimizer and device.type != "cpu")
    table = est.format_stage_table(rows, budget)
    stage = est.pick_stage(rows, budget)
    logger.info("zero_stage auto: stage %d for Ψ=%s trainable + %s frozen parameters on %d rank(s), batch %s "
                "(budget from %s; activations from the %s)\n%s", stage, f"{trainable:,}", f"{frozen:,}", world_size,
                batch, source, activation_source, table)
    return dataclasses.replace(config, stage=stage)


def auto_batch_from(objects: Any) -> int | None:
    """The batch size of the first DataLoader among ``objects`` (accelerate's prepare arguments), if any."""
    for obj in objects:
        size = getattr(obj, "batch_size", None) if isinstance(obj, torch.utils.data.DataLoader) else None
        if isinstance(size, int) and size > 0:
            return size
    return None
