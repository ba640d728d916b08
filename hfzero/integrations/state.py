"""Saving and loading a prepared model's ZeRO optimizer shards for the Trainer and accelerate integrations.

Every rank writes its own shard: a ZeRO optimizer's state exists nowhere else. When
``hfzero.checkpoint`` is installed its ``save_checkpoint``/``load_checkpoint`` do the work (sharded,
reshardable across world sizes and stages). Without it a built-in format is used, loadable only by
the same layout (world size, stage, bucket size, dtype):

- ``optimizer_shards.json``: ``{"format": 1, "world_size": W, "stage": S, "dtype": ..., "files": [...]}``
  written by rank 0 after every rank wrote its file;
- ``optimizer_shard-rank{r}-of-{W}.pt``: rank r's ``ZeroOptimizer.state_dict()`` (tensors, numbers,
  strings only: read back with ``torch.load(weights_only=True)``).
Files are written to a temporary name, flushed and renamed, so a crash never leaves a torn shard.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hfzero.config import ConfigError
from hfzero.logging import get_logger
from hfzero.runtime.optimizer import ZeroOptimizer

logger = get_logger(__name__)

MANIFEST = "optimizer_shards.json"
_FORMAT = 1


def checkpoint_module() -> ModuleType | None:
    """``hfzero.checkpoint`` when it provides save_checkpoint/load_checkpoint, else None."""
    try:
        module = importlib.import_module("hfzero.checkpoint")
    except ImportError:
        return None
    if callable(getattr(module, "save_checkpoint", None)) and callable(getattr(module, "load_checkpoint", None)):
        return module
    return None


def unwrap_optimizer(optimizer: Any) -> ZeroOptimizer | None:
    """The ZeroOptimizer behind ``optimizer`` (itself, or inside accelerate's AcceleratedOptimizer)."""
    while optimizer is not None and not isinstance(optimizer, ZeroOptimizer):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _atomic_write(path: Path, write: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_optimizer_shards(directory: str | os.PathLike[str], model: nn.Module, optimizer: Any) -> None:
    """Write every rank's optimizer shard (and, with hfzero.checkpoint, the model) under ``directory``.

    Collective: every rank must call it with the same directory.
    """
    zero = unwrap_optimizer(optimizer)
    if zero is None:
        raise ConfigError("save_optimizer_shards: the optimizer was not prepared by hfzero")
    directory = Path(directory)
    module = checkpoint_module()
    if module is not None:
        module.save_checkpoint(str(directory), model, zero)
        return
    rank, world = _rank_world()
    directory.mkdir(parents=True, exist_ok=True)
    name = f"optimizer_shard-rank{rank}-of-{world}.pt"
    _atomic_write(directory / name, lambda f: torch.save(zero.state_dict(), f))
    _barrier()
    if rank == 0:
        meta = {"format": _FORMAT, "world_size": world, "stage": zero.engine.stage,
                "dtype": zero.engine.config.dtype, "writer": "hfzero.integrations.state",
                "files": [f"optimizer_shard-rank{r}-of-{world}.pt" for r in range(world)]}
        _atomic_write(directory / MANIFEST, lambda f: f.write(json.dumps(meta, indent=2).encode()))
    _barrier()
    logger.info("saved %d optimizer shard(s) to %s", world, directory)


def has_optimizer_shards(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds shards written by save_optimizer_shards (either format)."""
    directory = Path(directory)
    if (directory / MANIFEST).is_file():
        return True
    return directory.is_dir() and checkpoint_module() is not None and any(directory.iterdir())


def load_optimizer_shards(directory: str | os.PathLike[str], model: nn.Module, optimizer: Any) -> None:
    """Load this rank's optimizer shard written by save_optimizer_shards (collective)."""
    zero = unwrap_optimizer(optimizer)
    if zero is None:
        raise ConfigError("load_optimizer_shards: the optimizer was not prepared by hfzero")
    directory = Path(directory)
    manifest = directory / MANIFEST
    if not manifest.is_file():
        module = checkpoint_module()
        if module is None:
            raise ConfigError(f"{directory} holds no hfzero optimizer shards ({MANIFEST} is missing); pass the "
                              "directory a ZeroTrainer / ZeroAccelerator checkpoint was saved to")
        module.load_checkpoint(str(directory), model, zero)
        return
    meta = json.loads(manifest.read_text())
    rank, world = _rank_world()
    if meta.get("format") != _FORMAT:
        raise ConfigError(f"{manifest}: unknown format {meta.get('format')!r} (this version reads {_FORMAT})")
    if meta["world_size"] != world or meta["stage"] != zero.engine.stage:
        raise ConfigError(
            f"{directory} was saved by {meta['world_size']} rank(s) at stage {meta['stage']}; this run has "
            f"{world} rank(s) at stage {zero.engine.stage}. Loading optimizer shards into another layout needs "
            "hfzero.checkpoint (resharding), which is not installed in this version: resume with the same "
            "world size and stage, or drop the optimizer state (load the model weights only)")
    path = directory / meta["files"][rank]
    state = torch.load(path, map_location="cpu", weights_only=True)
    zero.load_state_dict(state)
    logger.info("loaded optimizer shard %s", path)
