"""ZeRO optimizer state in Trainer and accelerate checkpoints, through ``hfzero.checkpoint``.

Every rank writes its own shard (a ZeRO optimizer's state exists nowhere else) with
``hfzero.checkpoint.save_checkpoint``; ``load_checkpoint`` reads it back at any world size and stage
(resharding). Both are collectives: every rank calls them with the same directory.
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

logger = get_logger(__name__)


def unwrap_optimizer(optimizer: Any) -> ZeroOptimizer | None:
    """The ZeroOptimizer behind ``optimizer`` (itself, or inside accelerate's AcceleratedOptimizer)."""
    while optimizer is not None and not isinstance(optimizer, ZeroOptimizer):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


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
