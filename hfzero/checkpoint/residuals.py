"""qgZ's error-feedback residuals in checkpoints: saved with the rank's shard, restored only into the same layout.

[Note: residuals in checkpoints]
With ``quantize_error_feedback`` each rank holds, per bucket and hop, the fp32 residual of what it last packed
(QUANT_RESIDUAL, see [Note: quantized collectives] in hfzero/comm/quantized.py). ``save_checkpoint`` writes them
into the rank's own file as ``quant_residual/<bucket>/<hop>`` (safetensors, no copy: views of the live tensors,
staged eagerly by an asynchronous save since the next backward changes them) and records in the manifest's entry of
the rank (``ranks[r].quant_residual``) the layout they belong to: world size, stage, the rank's data-parallel
group, ranks per node, the qgZ hops and every bucket's padded size. They are this rank's quantization errors for
its peers on that layout and mean nothing on another, so ``load_checkpoint`` restores them only when every rank's
saved layout equals its own now (one small all-gather, at a point every rank reaches); otherwise (another world
size, stage, group layout or bucket size, or a checkpoint saved without error feedback) every rank drops its
residuals and starts from zero, and rank 0 logs one warning saying so. Resident memory: none beyond the residuals
themselves (a load reads each tensor once and copies it to the device).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hfzero.checkpoint.common import Scope, gather_json
from hfzero.checkpoint.errors import CheckpointError
from hfzero.logging import get_logger
from hfzero.runtime.engine import ZeroEngine

logger = get_logger(__name__)

PREFIX = "quant_residual/"
"""Rank-file key prefix of the residuals."""


def _reduce(engine: ZeroEngine) -> Any:
    """The engine's qgZ reduction when it keeps error-feedback residuals, else None."""
    scatter = engine.reducer.scatter
    return scatter if getattr(scatter, "error_feedback", False) else None


def layout(engine: ZeroEngine, scope: Scope) -> dict[str, Any]:
    """What the residuals of this rank belong to (JSON-able; equal on a resume into the same layout)."""
    scatter = engine.reducer.scatter
    return {"world_size": scope.world_size, "stage": engine.stage, "group": list(engine.comm.global_ranks),
            "ranks_per_node": engine.comm.ranks_per_node, "hops": list(scatter.hop_sizes()),
            "buckets": [bucket.padded for bucket in engine.layout.buckets]}


def capture(engine: ZeroEngine, scope: Scope) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """The rank file's residual tensors (views of the live ones) and the manifest's record of them; ({}, None)
    without error feedback."""
    scatter = _reduce(engine)
    if scatter is None:
        return {}, None
    tensors = {PREFIX + name: tensor for name, tensor in scatter.residual_state().items()}
    return tensors, {"layout": layout(engine, scope), "tensors": {k: list(t.shape) for k, t in tensors.items()}}


def decide(engine: ZeroEngine, scope: Scope, manifest: dict[str, Any]) -> bool:
    """Whether every rank restores its saved residuals (a collective over ``scope.comm``: every rank calls it at
    the same point of ``load_checkpoint``). False drops them; rank 0 then warns once when any were saved."""
    wants = _reduce(engine) is not None
    saved = None
    if manifest["world_size"] == scope.world_size:
        saved = manifest["ranks"][scope.rank].get("quant_residual")
    mine = bool(wants and isinstance(saved, dict) and saved.get("layout") == layout(engine, scope))
    everyone = gather_json(scope.comm, {"restore": mine, "saved": any(r.get("quant_residual")
                                                                       for r in manifest["ranks"])})
    restore = all(e["restore"] for e in everyone)
    if not restore and scope.rank == 0 and everyone[0]["saved"]:
        reason = ("error feedback is off now" if not wants else
                  "the layout differs (world size, stage, data-parallel groups, ranks per node or bucket sizes)")
        logger.warning("load_checkpoint: the checkpoint holds qgZ error-feedback residuals, but %s; they are "
                       "per-rank quantization errors of the saved layout, so they are dropped and the next "
                       "reductions start from zero residuals", reason)
    return restore


def restore(engine: ZeroEngine, scope: Scope, manifest: dict[str, Any], directory: Path, apply: bool) -> None:
    """Load this rank's saved residuals into its qgZ reduction (``apply``, as ``decide`` said), or drop the ones
    it holds (so a load never keeps residuals of the training it replaces)."""
    scatter = _reduce(engine)
    if scatter is None:
        return
    if not apply:
        scatter.load_residual_state({}, engine.device)
        return
    from safetensors import safe_open

    entry = manifest["ranks"][scope.rank]
    expected = entry["quant_residual"]["tensors"]
    with safe_open(str(directory / entry["file"]), framework="pt") as f:
        state = {k[len(PREFIX):]: f.get_tensor(k) for k in f.keys() if k.startswith(PREFIX)}
    shapes = {PREFIX + k: list(t.shape) for k, t in state.items()}
    if shapes != expected:
        raise CheckpointError(f"{directory / entry['file']}: its qgZ residuals {shapes} are not the ones the manifest "
                              f"lists {expected}; the file was replaced")
    scatter.load_residual_state(state, engine.device)
