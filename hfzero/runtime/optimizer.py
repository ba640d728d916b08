"""ZeroOptimizer: a torch.optim.Optimizer over the model's parameters that steps the rank's shard.

The user's optimizer is rebuilt (same class, same hyper-parameters and param groups) over this
rank's fp32 master slices: it holds the optimizer states for the shard only (OPTIM_STATE). This
object's ``param_groups`` list the model's parameters and are live: their hyper-parameters (a
scheduler's learning rate, say) are copied to the inner optimizer before every step. Where the inner
optimizer steps on the host (a CPU engine, or the optimizer offloaded) it uses torch's fused CPU kernel
where the class has one, else foreach; on an accelerator, Adam and AdamW step fused unless the user chose an
implementation (runtime/host_step.py); with the optimizer offloaded it runs on the rank's share of the node's
cores (runtime/offload.py).
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch

from hfzero.config import ConfigError
from hfzero.logging import get_logger
from hfzero.runtime.engine import ZeroEngine
from hfzero.runtime.host_step import device_step_overrides, host_step_overrides
from hfzero.runtime.hostmem import HeapTrimmer
from hfzero.runtime.legacy_state import upgrade_v1

logger = get_logger(__name__)

STATE_FORMAT = 2
"""Version of ``state_dict()``'s layout: 2 since parameter slots are aligned (see [Note: slot alignment]
in layout.py); format 1 is upgraded on load (runtime/legacy_state.py)."""

# Optimizers whose update of an element depends only on that element's history: they give the same
# result on a flat shard as on the whole tensor. Others (Adafactor, LAMB, LBFGS, ...) do not.
_ELEMENTWISE = {
    "SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Rprop", "NAdam", "RAdam", "ASGD",
}


def _check_elementwise(optimizer: torch.optim.Optimizer) -> None:
    cls = type(optimizer)
    if cls.__module__.startswith("torch.optim") and cls.__name__ in _ELEMENTWISE:
        return
    raise ConfigError(
        f"hfzero shards optimizer states element by element, which gives the same result only for "
        f"element-wise optimizers ({', '.join(sorted(_ELEMENTWISE))} from torch.optim); {cls.__module__}."
        f"{cls.__name__} is not one of them. Build one of those optimizers before calling hfzero.prepare.")


def _rebuild(cls: type[torch.optim.Optimizer], groups: list[dict[str, Any]],
             defaults: dict[str, Any]) -> torch.optim.Optimizer:
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in defaults.items() if k in accepted}
    return cls(groups, **kwargs)


class ZeroOptimizer(torch.optim.Optimizer):
    """Sharded optimizer returned by ``hfzero.prepare``.

    Besides the Optimizer API (step, zero_grad, state_dict, load_state_dict, param_groups) it has
    ``backward(loss)`` (applies the fp16 loss scale), ``clip_grad_norm_(max_norm)`` (global norm),
    ``no_sync()`` and ``engine``. ``step()`` consumes the gradients: they are zeroed after the update,
    as in DeepSpeed, so a backward after a step starts a new accumulation.
    """

    def __init__(self, engine: ZeroEngine, base: torch.optim.Optimizer):
        _check_elementwise(base)
        self.engine = engine
        engine.zero_optimizer = weakref.ref(self)  # unprepare finds it (See [Note: engine lifetime] in lifetime.py)
        groups = [{**g, "params": list(g["params"])} for g in base.param_groups]
        super().__init__(groups, dict(base.defaults))
        # Share the user's group dicts, so a scheduler built on ``base`` before prepare drives the shards.
        self.param_groups = base.param_groups
        self._source = base
        inner_groups = []
        on_host = engine.offload is not None or engine.device.type == "cpu"
        self._overrides = (host_step_overrides(type(base), base.defaults) if on_host
                           else device_step_overrides(type(base), base.defaults))
        """Implementation options of an optimizer stepping on the host (CPU engine or offload): they win over
        the user's group values, which are synced into the inner groups before every step (a loaded state
        dict's too)."""
        for index, group in enumerate(base.param_groups):
            views = [engine.master_views[b.index] for b in engine.layout.group_buckets(index)]
            kept = {k: v for k, v in group.items() if k != "params"}
            inner_groups.append({**kept, **{k: v for k, v in self._overrides.items() if k in kept}, "params": views})
        self.inner = _rebuild(type(base), inner_groups, {**base.defaults, **self._overrides})
        engine.optimizer = self.inner
        self.skipped_steps = 0
        self.last_step_skipped = False
        cpu_trim = engine.device.type == "cpu" and engine.config.host_trim
        self.heap = HeapTrimmer(engine.config.host_trim_slack) if cpu_trim else None
        """CPU engines: the per-step heap trim's decision (see [Note: host allocator])."""

    def release(self) -> None:
        """``unprepare``: drop the inner optimizer (its states are freed); the engine is released by the caller,
        after which every use of this optimizer raises ``UNPREPARED``."""
        self.inner = None
        self.heap = None

    # ---- training -------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Run backward on ``loss`` times the loss scale (needed with fp16; plain backward otherwise)."""
        self.engine.backward(loss, **kwargs)

    def no_sync(self):
        """Context manager: backward passes inside accumulate locally without communication."""
        return self.engine.no_sync()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm (all ranks, all shards) to ``max_norm``; return the total norm."""
        return self.engine.clip_grad_norm_(max_norm, norm_type)

    @property
    def loss_scale(self) -> float:
        return self.engine.scaler.scale

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Update this rank's shard, then all-gather the updated parameters; skipped on fp16 overflow."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        engine = self.engine
        # A scheduler built on the user's optimizer checks that its step ran (torch's LRScheduler marker).
        self._source._opt_called = True  # type: ignore[attr-defined]
        engine.materialize_grads()
        engine.wait_checkpoint_copy()  # an asynchronous save still copying the slices this step changes
        self.last_step_skipped = engine.overflow
        if engine.overflow:
            self.skipped_steps += 1
            logger.warning("fp16 gradient overflow: step skipped on all ranks (loss scale %g)", engine.scaler.scale)
        else:
            for ours, inner in zip(self.param_groups, self.inner.param_groups):
                inner.update({k: v for k, v in ours.items() if k != "params"}, **self._overrides)
            host_step = engine.offload.host_step() if engine.offload is not None else contextlib.nullcontext()
            with engine.keep_unused_unchanged(), host_step:
                self.inner.step()
            engine.publish_params()
        engine.scaler.update(engine.overflow)
        engine.finish_step()
        if self.heap is not None:
            self.heap.after_step()  # the step's transient memory is free now: see [Note: host allocator]
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget accumulated gradients (the gradient buffers stay allocated and are zeroed)."""
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None
        self.engine.finish_step()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "engine", None) is not None and hasattr(self, "inner"):
            raise ConfigError("hfzero: add_param_group after prepare is not supported; build the optimizer "
                              "with all its param groups before hfzero.prepare")
        super().add_param_group(param_group)

    # ---- state ----------------------------------------------------------------------------------
    def _layout_meta(self) -> dict[str, Any]:
        e = self.engine
        return {"format": STATE_FORMAT, "stage": e.stage, "world_size": e.world_size, "rank": e.rank,
                "dtype": e.config.dtype, "reduce_bucket_size": e.bucket_numel,
                "num_params": e.num_params, "optimizer": type(self.inner).__name__}

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """This rank's shard: inner optimizer state, fp32 master slice, loss scaler, hyper-parameters.

        Loadable by ``load_state_dict`` on the same rank of the same layout (world size, stage,
        bucket size); use hfzero.checkpoint to move state between layouts. A state of format 1 (written
        before slots were aligned) is upgraded on load, collectively where the layout shards: every
        rank of the group must call ``load_state_dict`` together (runtime/legacy_state.py).
        """
        return {
            "hfzero": self._layout_meta(),
            "inner": self.inner.state_dict(),
            "master": self.engine.master_flat,
            "loss_scaler": self.engine.scaler.state_dict(),
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        meta = state_dict.get("hfzero") if isinstance(state_dict, dict) else None
        if meta is None:
            raise ConfigError("hfzero: this optimizer state was not saved by a hfzero ZeroOptimizer "
                              "(no 'hfzero' section); load the model weights and start a fresh optimizer")
        mine = self._layout_meta()
        upgrade = meta.get("format") == 1  # unaligned slots: see runtime/legacy_state.py
        diffs = {k: (meta.get(k), v) for k, v in mine.items() if meta.get(k) != v and not (upgrade and k == "format")}
        if diffs:
            detail = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in sorted(diffs.items()))
            raise ConfigError(f"hfzero: optimizer state was saved with another layout ({detail}); use "
                              "hfzero.checkpoint.load_checkpoint, which reshards across world sizes and stages")
        if upgrade:
            buckets = [b.index for g in range(len(self.inner.param_groups)) for b in self.engine.layout.group_buckets(g)]
            state_dict = upgrade_v1(self.engine, state_dict, buckets)
        self.engine.wait_host_copies()
        self.inner.load_state_dict(state_dict["inner"])
        if self.engine.master_flat is not None:
            self.engine.master_flat.copy_(state_dict["master"])
        self.engine.scaler.load_state_dict(state_dict["loss_scaler"])
        for ours, saved in zip(self.param_groups, state_dict["param_groups"]):
            ours.update(saved)
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.engine.publish_params()
