"""``hfzero.unprepare``: undo ``hfzero.prepare`` and give the user a plain module back.

What the returned module is (the same object ``prepare`` returned, its class and parameter objects unchanged):
- every parameter holds its whole values, on every rank, in memory of its own (not a view of the engine's flat
  buffers): at stages 0-2 the values the model trains with (the fp32 master values cast to the parameter dtype at
  the last step), at stage 3 the same, gathered unit by unit (a collective). Parameters keep the dtype
  ``prepare`` gave them (``config.dtype``) and their ``.grad`` is None: gradients not yet stepped are dropped;
- no hook, patched method or attribute of hfzero remains (See [Note: engine lifetime] in lifetime.py):
  ``hfzero_engine``, ``no_sync``, stage 3's synced ``generate``, the activation-checkpoint function (the layers
  get back the function the user enabled), the tiled MLP, the engine's and stage 3's hooks, and what the
  wrappers recorded (sequence parallelism's attention and hooks);
- the engine lets go of everything it held (flat buffers, master weights, optimizer states, offload host
  buffers, stage 3's unit buffers, quantized collectives' buffers): once the caller's last reference to it goes, so
  does its memory. The ZeroOptimizer stays an object but raises ``UNPREPARED`` at any use.
Not undone: what is the model's parallel layout rather than ZeRO's (tensor or expert parallelism's DTensor
parameters, each rank its shard, as transformers' own tp_plan loading leaves them) and ``compile_regions``.

Memory: while it runs, one more copy of the parameters (stage 3: of the unprepared whole parameters, built up
one unit at a time beside the shards), freed with the engine.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hfzero.logging import get_logger
from hfzero.runtime.engine import ZeroEngine, get_engine
from hfzero.runtime.torch_api import graph_task_id

logger = get_logger(__name__)


def unprepare(model: nn.Module, optimizer: Any = None) -> nn.Module:
    """Undo ``hfzero.prepare`` on ``model``; return it as a plain module with whole parameters on every rank.

    ``optimizer``: the ZeroOptimizer ``prepare`` returned (or a wrapper of it, such as accelerate's), checked to
    belong to ``model``; with or without it, that optimizer is unusable afterwards (a clear error at any use)
    and its states are freed. Collective at stage 3 (every unit is gathered): every rank of the model's group
    calls it at the same point. Raises when called inside a backward pass. See this module's docstring for what
    the returned module holds; to train it with ZeRO again, build a new optimizer and call ``hfzero.prepare``.
    """
    engine = get_engine(model)
    if getattr(model, "hfzero_engine", None) is not engine:
        raise ValueError("hfzero.unprepare: pass the model hfzero.prepare returned (its optimizer is not enough)")
    zero = _zero_optimizer(engine, optimizer)
    if graph_task_id() != -1:
        raise RuntimeError("hfzero.unprepare: called inside a backward pass; call it between steps")
    engine.finish_step()  # drops this step's gradients and forgets a pass that raised
    engine.wait_checkpoint_copy()
    engine.wait_host_copies()
    whole = engine.whole_params()  # stage 3: a collective
    engine.installed.undo()
    for local, values in whole:
        local.data = values
    for p in model.parameters():
        p.grad = None
    if engine.offload is not None:
        engine.offload.close()
    if zero is not None:
        zero.release()
    logger.info("unprepared %s: %d parameter tensor(s) made whole; the engine is released", type(model).__name__,
                len(whole))
    engine.release()
    return model


def _zero_optimizer(engine: ZeroEngine, optimizer: Any) -> Any:
    """The engine's ZeroOptimizer (found through its weak reference when ``optimizer`` is None), after
    checking that ``optimizer``, unwrapped, is it."""
    zero = engine.zero_optimizer() if engine.zero_optimizer is not None else None
    if optimizer is None:
        return zero
    inner = optimizer
    while inner is not None and getattr(inner, "engine", None) is None:
        inner = getattr(inner, "optimizer", None)  # accelerate's AcceleratedOptimizer, a Trainer's wrapper
    if inner is None or inner.engine is not engine:
        raise ValueError("hfzero.unprepare: optimizer is not the ZeroOptimizer hfzero.prepare returned with this "
                         "model")
    return inner
