"""ZeRO model and optimizer state for Trainer and accelerate: full weights, checkpoint shards.

- Weights: stages 0-2 keep full parameters on every rank; at stage 3 (``is_partitioned``) a
  partitioned parameter is a 0-element tensor between uses, so ``model.state_dict()`` would save
  an empty model: callers gather with ``hfzero.runtime.stage3.full_state_dict`` (a collective).
- Training state: every rank writes its own shard (a ZeRO optimizer's state exists nowhere else)
  with ``hfzero.checkpoint.save_checkpoint``; ``load_checkpoint`` reads it back at any world size
  and stage (resharding) and republishes the parameters from the fp32 master shards, so it also
  restores the weights. Both are collectives: every rank calls them with the same directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import nn

from hfzero.checkpoint import load_checkpoint, save_checkpoint
from hfzero.config import ConfigError
from hfzero.logging import get_logger
from hfzero.runtime.optimizer import ZeroOptimizer
from hfzero.runtime.prepare import get_engine

logger = get_logger(__name__)


def unwrap_optimizer(optimizer: Any) -> ZeroOptimizer | None:
    """The ZeroOptimizer behind ``optimizer`` (itself, or inside accelerate's AcceleratedOptimizer)."""
    while optimizer is not None and not isinstance(optimizer, ZeroOptimizer):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


def is_partitioned(model: Any) -> bool:
    """True for a stage-3 model: its parameters are flat shards between uses, not full tensors."""
    try:
        return get_engine(model).stage >= 3
    except ValueError:
        return False


def model_param_count(model: nn.Module, trainable_only: bool = False, exclude_embeddings: bool = False) -> int:
    """Parameters of ``model`` counted whole at every stage (``p.numel()`` is 0 for a partitioned one
    between uses); the figure the Trainer logs as "Number of trainable parameters" and uses for FLOPs."""
    numel = get_engine(model).full_numel if is_partitioned(model) else (lambda p: p.numel())
    skip = {m.weight for m in model.modules() if isinstance(m, nn.Embedding)} if exclude_embeddings else set()
    return sum(numel(p) for p in model.parameters() if (p.requires_grad or not trainable_only) and p not in skip)


def _require_zero(optimizer: Any, what: str) -> ZeroOptimizer:
    zero = unwrap_optimizer(optimizer)
    if zero is None:
        raise ConfigError(f"{what}: the optimizer was not prepared by hfzero (got {type(optimizer).__name__})")
    return zero


def save_optimizer_shards(directory: str | os.PathLike[str], model: nn.Module, optimizer: Any) -> Path:
    """Save the model's ZeRO training state (every rank's optimizer shard) into ``directory`` (collective)."""
    return save_checkpoint(directory, model, _require_zero(optimizer, "save_optimizer_shards"))


def load_optimizer_shards(directory: str | os.PathLike[str], model: nn.Module, optimizer: Any) -> None:
    """Load ZeRO training state saved by save_optimizer_shards, at any world size or stage (collective)."""
    load_checkpoint(directory, model, _require_zero(optimizer, "load_optimizer_shards"))
