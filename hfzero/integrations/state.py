"""ZeRO model and optimizer state for Trainer and accelerate: full weights, checkpoint shards.

- Weights: stages 0-2 keep full parameters on every rank; at stage 3 (``is_partitioned``) a
  partitioned parameter is a 0-element tensor between uses, so ``model.state_dict()`` would save
  an empty model: callers gather with ``hfzero.runtime.stage3.full_state_dict`` (a collective).
  Under tensor parallelism (``is_tensor_parallel``) parameters are DTensor shards at every stage:
  ``full_state_dict`` makes them whole too (``needs_gathered_weights`` covers both cases).
- Training state: every rank writes its own shard (a ZeRO optimizer's state exists nowhere else)
  with ``hfzero.checkpoint.save_checkpoint``; ``load_checkpoint`` reads it back at any world size
  and stage (resharding) and republishes the parameters from the fp32 master shards, so it also
  restores the weights. Both are collectives: every rank calls them with the same directory.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import nn

from hfzero.checkpoint import load_checkpoint, load_checkpoint_node_local, save_checkpoint, save_checkpoint_node_local
from hfzero.checkpoint.format import MANIFEST, previous_dir
from hfzero.config import ConfigError
from hfzero.logging import get_logger
from hfzero.parallel.pipeline import pipeline_of
from hfzero.runtime.optimizer import ZeroOptimizer
from hfzero.runtime.engine import get_engine

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


def is_tensor_parallel(model: Any) -> bool:
    """True for a model prepared over the dp group of a dp x tp mesh (DTensor parameters, sharded over tp)."""
    try:
        group = get_engine(model).norm_group
    except ValueError:
        return False
    return group is not None and group.world_size > 1


def is_expert_parallel(model: Any) -> bool:
    """True for a model prepared over an edp x ep mesh (experts are DTensor shards over ep, sharded by ZeRO over
    edp: the engine's ``expert_comm``)."""
    try:
        return get_engine(model).expert_comm is not None
    except ValueError:
        return False


@contextlib.contextmanager
def saving_gathered(model: Any) -> Iterator[None]:
    """While a save writes a gathered state dict (``full_state_dict``): a wrapper may call ``state_dict()``
    on a submodule for its *keys* (peft's ``modules_to_save`` does, through ``adapter_state_dict``), which
    the stage-3 guard would refuse; the values written are the gathered ones, so the guard is lowered."""
    try:
        engine = get_engine(model)
    except ValueError:
        engine = None
    if not hasattr(engine, "allow_partitioned_state_dict"):
        yield
        return
    engine.allow_partitioned_state_dict = True
    try:
        yield
    finally:
        engine.allow_partitioned_state_dict = False


def needs_gathered_weights(model: Any) -> bool:
    """True when ``model.state_dict()`` is not the whole model on a rank (stage 3, tensor or expert parallelism):
    saving it takes ``full_state_dict`` on every rank (a collective) first."""
    return is_partitioned(model) or is_tensor_parallel(model) or is_expert_parallel(model)


def model_param_count(model: nn.Module, trainable_only: bool = False, exclude_embeddings: bool = False) -> int:
    """Parameters of ``model`` counted whole at every stage (``p.numel()`` is 0 for a partitioned one
    between uses); the figure the Trainer logs as "Number of trainable parameters" and uses for FLOPs."""
    from hfzero.parallel.pipeline.driver import released_numel

    if is_partitioned(model):
        numel = get_engine(model).full_numel
    else:  # under pipeline parallelism other stages' parameters are freed here: count them whole
        numel = lambda p: released_numel(p) or p.numel()  # noqa: E731
    skip = {m.weight for m in model.modules() if isinstance(m, nn.Embedding)} if exclude_embeddings else set()
    return sum(numel(p) for p in model.parameters() if (p.requires_grad or not trainable_only) and p not in skip)


def _require_zero(optimizer: Any, what: str) -> ZeroOptimizer:
    zero = unwrap_optimizer(optimizer)
    if zero is None:
        raise ConfigError(f"{what}: the optimizer was not prepared by hfzero (got {type(optimizer).__name__})")
    return zero


def has_shards(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds ZeRO training state ``load_optimizer_shards`` can load: the directory
    itself, or the complete previous copy a save interrupted between its renames left beside it."""
    directory = Path(directory)
    return directory.is_dir() or (previous_dir(directory) / MANIFEST).is_file()


def save_optimizer_shards(directory: str | os.PathLike[str], model: nn.Module, optimizer: Any, *,
                          extra: dict[str, Any] | None = None, node_local: bool = False) -> Path:
    """Save the model's ZeRO training state (every rank's optimizer shard) into ``directory`` (collective).
    Under pipeline parallelism (``optimizer`` a pipeline stage's) every rank of the world writes its stage's.
    ``node_local``: ranks need not share ``directory``'s file system (see [Note: node-local checkpoints])."""
    zero = _require_zero(optimizer, "save_optimizer_shards")
    save = save_checkpoint_node_local if node_local else save_checkpoint
    return save(directory, pipeline_of(zero) or model, zero, extra=extra)


def load_optimizer_shards(directory: str | os.PathLike[str], model: nn.Module, optimizer: Any, *,
                          node_local: bool = False) -> None:
    """Load ZeRO training state saved by save_optimizer_shards, at any world size, stage or pipeline size
    (collective); ``node_local`` as for ``save_optimizer_shards``."""
    zero = _require_zero(optimizer, "load_optimizer_shards")
    load = load_checkpoint_node_local if node_local else load_checkpoint
    load(directory, pipeline_of(zero) or model, zero)


def scheduler_state_for_user_groups(state: dict[str, Any], optimizer: Any) -> dict[str, Any]:
    """A scheduler's state dict over a pipeline stage's optimizer, as over the user's optimizer: the stage's
    own group for the tied embedding (last; see [Note: tied embeddings]) dropped from per-group lists, so the
    saved scheduler resumes without a pipeline (or on another stage). Unchanged without a pipeline."""
    pipe = pipeline_of(unwrap_optimizer(optimizer))
    if pipe is None or pipe.tied_user_group is None:
        return state
    groups = len(pipe.optimizer.param_groups)
    return {k: v[: groups - 1] if isinstance(v, list) and len(v) == groups else v for k, v in state.items()}


def scheduler_state_for_stage(state: dict[str, Any], optimizer: Any) -> dict[str, Any]:
    """The inverse of ``scheduler_state_for_user_groups``: the tied group's entries copied from its source group."""
    pipe = pipeline_of(unwrap_optimizer(optimizer))
    if pipe is None or pipe.tied_user_group is None:
        return state
    users = len(pipe.optimizer.param_groups) - 1
    source = pipe.tied_user_group
    return {k: v + [v[source]] if isinstance(v, list) and len(v) == users else v for k, v in state.items()}
