"""``prepare_sequence_parallel``: the dp x sp mesh, Ulysses attention, the loss hook, then ZeRO over all ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hfzero.comm.collectives import Communicator
from hfzero.config import ConfigError, ZeroConfig
from hfzero.logging import get_logger
from hfzero.parallel.sequence.attention import apply_sequence_attention
from hfzero.parallel.sequence.loss import group_loss
from hfzero.parallel.sequence.mesh import SequenceMesh, build_sp_mesh
from hfzero.parallel.sequence.tiled_loss import enable_tiled_loss
from hfzero.runtime.lifetime import Installed

if TYPE_CHECKING:
    from hfzero.runtime.optimizer import ZeroOptimizer

logger = get_logger(__name__)

MESH_ATTR = "hfzero_sequence_mesh"
"""The SequenceMesh of a model set up for sequence parallelism (prepare checks it)."""


def _check_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    if args or kwargs.get("position_ids") is None:
        raise ConfigError("hfzero sequence parallelism: call the model with keyword arguments including the global "
                          "position_ids of this rank's chunk; build batches with "
                          "hfzero.parallel.sequence.split_batch or SequenceCollator")
    if kwargs.get("attention_mask") is not None:
        raise ConfigError("hfzero sequence parallelism: attention_mask is not supported on a split sequence; pad on "
                          "the right and let split_batch / SequenceCollator turn padding into ignored labels")


def install_sequence_parallel(model: nn.Module, mesh: SequenceMesh, comm: Communicator | None = None,
                              installed: Installed | None = None) -> None:
    """Ulysses attention over ``mesh``'s SP group and the model hooks (inputs checked, loss reported as the
    group's: loss.py), in place, before or after ``hfzero.prepare(..., average_over=mesh.dp_size)``.
    ``comm``: the SP group's communicator (default a new one; prepare_sequence_parallel passes one that
    counts into the engine's statistics, so profiles show the all-to-all volume). ``installed``: where the
    changes are recorded for ``hfzero.unprepare`` (prepare_sequence_parallel passes the engine's)."""
    if getattr(model, MESH_ATTR, None) is not None:
        raise ConfigError("hfzero sequence parallelism: this model is already set up for it")
    comm = comm or Communicator(mesh.sp_group)  # on the backend's device
    installed = installed or Installed()
    apply_sequence_attention(model, comm, installed)

    def report_group_loss(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        loss = getattr(output, "loss", None)
        if loss is not None:
            output.loss = group_loss(loss, comm)
        return output

    installed.handle(model.register_forward_pre_hook(_check_inputs, with_kwargs=True))
    installed.handle(model.register_forward_hook(report_group_loss, with_kwargs=True))
    installed.set_attr(model, MESH_ATTR, mesh)


def prepare_sequence_parallel(model: nn.Module, optimizer: torch.optim.Optimizer,
                              config: ZeroConfig) -> tuple[nn.Module, ZeroOptimizer, SequenceMesh]:
    """Build the dp x sp mesh, switch ``model`` to Ulysses attention (and tiled loss with ``config.loss_tiles``)
    and prepare ZeRO over every rank
    (stages 0-3, model states sharded over dp x sp, gradients averaged over the dp replicas). Returns
    (model, optimizer, mesh); feed each rank ``split_batch(batch, mesh.sp_rank, mesh.sp_size)`` of the
    same whole batch within an SP group (its dp replica's samples)."""
    from hfzero.parallel.data_parallel import prepare
    from hfzero.runtime.engine import get_engine

    if config.sp_size < 2:
        raise ConfigError("prepare_sequence_parallel: config.sp_size must be > 1")
    mesh = build_sp_mesh(config.sp_size)
    tiling = Installed()  # undone by unprepare with the rest: See [Note: engine lifetime] in runtime/lifetime.py
    if config.loss_tiles > 1 and getattr(model, "hfzero_loss_tiles", 1) == 1:
        enable_tiled_loss(model, config.loss_tiles, tiling)
    model, zero = prepare(model, optimizer, config, average_over=mesh.dp_size)
    engine = get_engine(model)
    engine.installed.on_undo(tiling.undo)
    install_sequence_parallel(model, mesh, engine.comm.on_group(mesh.sp_group), engine.installed)
    logger.info("sequence parallelism: dp=%d x sp=%d, Ulysses attention, ZeRO stage %s over all %d ranks",
                mesh.dp_size, mesh.sp_size, config.stage, mesh.dp_size * mesh.sp_size)
    return model, zero, mesh
