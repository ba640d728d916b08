"""ZeroAccelerator: an ``accelerate.Accelerator`` whose ``prepare`` applies ZeRO instead of DDP.

What changes against the base class, and why:
- ``prepare``/``prepare_model``/``prepare_optimizer``: models are placed on the device but never
  wrapped in DDP; each optimizer goes through ``hfzero.prepare`` with the model that owns its
  parameters (models are prepared before optimizers whatever the argument order) and comes back as
  an ``AcceleratedOptimizer`` over the ``ZeroOptimizer``, so ``step``/``zero_grad`` keep accelerate's
  ``sync_gradients`` gating for gradient accumulation.
- ``prepare_scheduler``: a scheduler built on the user's optimizer is re-pointed at the
  ``ZeroOptimizer``, whose ``param_groups`` feed the shards' learning rate at every step.
- ``backward``: divides by the accumulation steps like the base class, then runs the engine's
  backward (fp16 loss scaling); ``no_sync`` (and so ``accumulate``) defers the engine's reduction.
- ``clip_grad_norm_``: the gradients live in the engine, not in ``param.grad``: the engine clips the
  global norm and returns it.
- ``save_state``/``load_state``: every rank saves and loads its optimizer shard (see state.py).
- ``get_state_dict``: CPU copies of the full weights; at stage 3 gathered unit by unit (a collective:
  every rank calls it) and returned on the main process only (``{}`` elsewhere).
- ``pipeline_config`` (pp_size > 1): ``prepare`` builds ``hfzero.pipeline`` over the model and its
  optimizer (``self.pipeline``; the model object stays whole, this rank trains its stage), data loaders
  shard over the data-parallel replicas (the ranks of one pipeline read the same batches), clipping
  and ``get_state_dict`` span every stage. The training step is the pipeline's (ZeroTrainer runs it).
- ``zero_config.tp_size`` > 1: ``prepare`` builds the dp x tp mesh, shards the model over tp with its
  transformers TP plan (DTensor parameters), re-points the optimizer at them and prepares ZeRO over dp;
  data loaders shard over the dp replicas (the TP ranks of one replica read the same batches) and
  ``gather_for_metrics`` keeps one TP rank per replica, so evaluation sees a dp run's samples.
- ``zero_config.sp_size`` > 1: ``prepare`` builds the dp x sp mesh, switches the model to Ulysses attention
  and prepares ZeRO over every rank (hfzero/parallel/sequence/); data loaders shard over the dp replicas
  (the SP ranks of one replica read the same batches) and their collator is wrapped in ``SequenceCollator``
  (each rank keeps its chunk of every sequence, labels shifted on the whole sequence).
- mixed precision: ``mixed_precision="bf16"|"fp16"`` sets ZeRO's dtype (16-bit parameters and
  gradients, fp32 master shards); accelerate's autocast stays off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType, recursively_apply
from torch import nn

from hfzero.planning.autostage import auto_batch_from, default_seq_len, resolve_auto_stage
from hfzero.checkpoint.background import wait as wait_for_save
from hfzero.config import ConfigError, ZeroConfig
from hfzero.integrations.env import config_from_env
from hfzero.integrations.gpus import check_ranks_fit_devices, cpu_requested, local_world_size
from hfzero.integrations.parallelism import (parallelism_from_env, without_accelerate_mesh,
                                             zero_config_from_parallelism)
from hfzero.integrations.state import (load_optimizer_shards, needs_gathered_weights,
                                      save_optimizer_shards, unwrap_optimizer)
from hfzero.logging import get_logger
from hfzero.parallel.mesh import check_sizes
from hfzero.parallel.pipeline import Pipeline, PipelineConfig, pipeline
from hfzero.parallel.expert import prepare_expert_parallel
from hfzero.parallel.sequence import (SequenceCollator, check_sp_size, enable_tiled_loss,
                                     prepare_sequence_parallel)
from hfzero.parallel.tensor import check_tp_size, prepare_tensor_parallel
from hfzero.runtime.lifetime import Installed
from hfzero.runtime.optimizer import ZeroOptimizer
from hfzero.runtime.engine import get_engine
from hfzero.runtime.pending import find_pending
from hfzero.parallel.data_parallel import prepare as zero_prepare
from hfzero.runtime.stage3 import full_state_dict

logger = get_logger(__name__)

_SHARD_DIR = "zero_optimizer_{index}"
_FOREIGN_PLUGINS = ("deepspeed_plugin", "fsdp_plugin", "megatron_lm_plugin")


def apply_mixed_precision(config: ZeroConfig, mixed_precision: str | None) -> ZeroConfig:
    """Fold accelerate/Trainer mixed precision ("no", "bf16", "fp16") into ZeRO's dtype.

    ZeRO's dtype *is* its mixed precision (16-bit parameters and gradients, fp32 master weights), so
    ``bf16``/``fp16`` set ``config.dtype`` when it is the default ``"fp32"``; a different explicit
    16-bit dtype is a conflict.
    """
    if mixed_precision in (None, "", "no"):
        return config
    if mixed_precision not in ("bf16", "fp16"):
        raise ConfigError(f"hfzero: mixed precision {mixed_precision!r} is not supported with ZeRO; use bf16 or "
                          "fp16 (they set ZeroConfig.dtype) or no mixed precision")
    if config.dtype == "fp32":
        return dataclasses.replace(config, dtype=mixed_precision)
    if config.dtype != mixed_precision:
        raise ConfigError(f"hfzero: mixed precision {mixed_precision!r} conflicts with ZeroConfig.dtype="
                          f"{config.dtype!r}; set one of them (they mean the same thing)")
    return config


def _world_size_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _is_zero_model(model: Any) -> bool:
    try:
        get_engine(model)
    except ValueError:
        return False
    return True


def _track_scheduler_steps(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer.step`` the way LRScheduler does, so a re-pointed scheduler does not warn."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    step = optimizer.step

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]


class ZeroAcceleratedOptimizer(AcceleratedOptimizer):
    """accelerate's optimizer wrapper around a ZeroOptimizer, reporting fp16 overflow skips.

    ``AcceleratedScheduler`` does not advance on a step whose ``step_was_skipped`` is true; plain
    ``AcceleratedOptimizer`` only knows a GradScaler's skips, while ZeRO's loss scaler lives in the engine.
    """

    @property
    def step_was_skipped(self) -> bool:
        return bool(self.optimizer.last_step_skipped)


class ZeroAccelerator(Accelerator):
    """An Accelerator that prepares models and optimizers with ZeRO (any stage, gloo or NCCL).

    Args:
        zero_config: the ZeRO options; default: ``HFZERO_*`` environment variables (set by
            ``hfzero run``), else ``ZeroConfig()``.
        *args, **kwargs: as for ``accelerate.Accelerator``. ``mixed_precision`` bf16/fp16 becomes
            ZeRO's dtype; DeepSpeed, FSDP and Megatron plugins are refused (ZeRO replaces them);
            ``parallelism_config`` is read into ZeroConfig (sp_size, tp_size; the rest refused by name:
            integrations/parallelism.py).
    """

    def __init__(self, *args: Any, zero_config: ZeroConfig | None = None,
                 pipeline_config: PipelineConfig | None = None, **kwargs: Any):
        for name in _FOREIGN_PLUGINS:
            if kwargs.get(name) is not None:
                raise ConfigError(f"ZeroAccelerator: {name} cannot be combined with hfzero's ZeRO; drop it")
        if zero_config is not None and not isinstance(zero_config, ZeroConfig):
            raise ConfigError(f"ZeroAccelerator: zero_config must be a hfzero.ZeroConfig, got "
                              f"{type(zero_config).__name__}")
        mixed = kwargs.pop("mixed_precision", None) or os.environ.get("ACCELERATE_MIXED_PRECISION")
        mixed = getattr(mixed, "value", mixed)  # accelerate's PrecisionType enum
        config = zero_config or config_from_env() or ZeroConfig()
        parallelism = kwargs.pop("parallelism_config", None) or parallelism_from_env()
        # sizes read (dp_replicate x dp_shard as hfzero's HSDP); accelerate builds no mesh (and no FSDP) of its own
        config = zero_config_from_parallelism(parallelism, config, _world_size_env())
        self.zero_config: ZeroConfig = apply_mixed_precision(config, mixed)
        if kwargs.get("cpu") is None and not torch.accelerator.is_available() and _world_size_env() > 1:
            kwargs["cpu"] = True  # without it accelerate runs torchrun workers on CPU as separate single processes
        check_ranks_fit_devices(local_world_size(), what="ZeroAccelerator", option="LOCAL_WORLD_SIZE",
                                cpu=bool(kwargs.get("cpu")) or cpu_requested())
        with without_accelerate_mesh():
            super().__init__(*args, mixed_precision="no", **kwargs)
        if self.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP,
                                     DistributedType.MEGATRON_LM) or getattr(self, "is_fsdp2", False):
            raise ConfigError(f"ZeroAccelerator: accelerate is configured for {self.distributed_type.value} "
                              "(accelerate config / ACCELERATE_USE_* environment); hfzero's ZeRO replaces it: "
                              "launch with `hfzero run` or plain torchrun instead")
        dynamo = getattr(getattr(self.state.dynamo_plugin, "backend", None), "value", "NO")
        if self.zero_config.tp_size > 1 and str(dynamo).upper() != "NO":
            from hfzero.runtime.compile import TP_REFUSAL, tensor_parallel_compiles

            why = ("the accelerator's whole-model compile of a tensor-parallel model is not tested yet; compile "
                   "through the API instead (hfzero.compile_regions(model) before prepare_tensor_parallel, "
                   "docs/compile.md), or train without --torch_compile") if tensor_parallel_compiles() \
                else TP_REFUSAL.format(version=torch.__version__)
            raise ConfigError(f"ZeroAccelerator: tp_size={self.zero_config.tp_size} with torch.compile (dynamo "
                              f"backend {dynamo}; --torch_compile): {why}")
        self.pipeline_config = pipeline_config if pipeline_config is not None and pipeline_config.pp_size > 1 \
            else None
        if self.pipeline_config is not None and self.zero_config.tp_size > 1:
            raise ConfigError("ZeroAccelerator: tensor parallelism (tp_size > 1) and pipeline parallelism "
                              "(pp_size > 1) cannot be combined yet; use one of them")
        if self.pipeline_config is not None and self.zero_config.ep_size > 1:
            raise ConfigError("ZeroAccelerator: expert parallelism (ep_size > 1) and pipeline parallelism "
                              "(pp_size > 1) cannot be combined yet; use one of them")
        if self.pipeline_config is not None and self.zero_config.sp_size > 1:
            raise ConfigError("ZeroAccelerator: sequence parallelism (sp_size > 1) and pipeline parallelism "
                              "(pp_size > 1) cannot be combined yet; use one of them")
        self.pipeline: Pipeline | None = None
        """The Pipeline of this rank, once prepare built it (with ``pipeline_config``)."""
        self._data_parallel_view = False
        self._metrics_view = False
        self._zero_pairs: list[tuple[nn.Module, ZeroOptimizer]] = []
        self._zero_by_source: dict[int, ZeroOptimizer] = {}
        self._warned_clip = False
        self.zero_auto_batch: tuple[int, int] | None = None
        """stage="auto": (micro-batch, sequence length) per rank for the activation estimate; default:
        a prepared DataLoader's batch size (else 1) and the model's position limit."""
        self._loader_batch: int | None = None
        logger.info("ZeroAccelerator: %s", self.zero_config.to_json())

    # ---- prepare --------------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """As ``Accelerator.prepare``, with ZeRO in place of DDP; models are handled before optimizers."""
        placement = list(device_placement) if device_placement is not None else [None] * len(args)
        if len(placement) != len(args):
            raise ValueError(f"device_placement should be a list with {len(args)} elements")
        self._loader_batch = auto_batch_from(args) or self._loader_batch
        order = sorted(range(len(args)), key=lambda i: 0 if isinstance(args[i], nn.Module) else 1)
        prepared = super().prepare(*[args[i] for i in order], device_placement=[placement[i] for i in order])
        prepared = prepared if len(args) > 1 else (prepared,)
        result: list[Any] = [None] * len(args)
        for position, index in enumerate(order):
            result[index] = prepared[position]
        return tuple(result) if len(result) > 1 else result[0]

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> nn.Module:
        """Place ``model`` on the device without a DDP wrapper: ZeRO reduces its gradients.

        ``evaluation_mode=True`` at stage 3 (a model that is never trained, e.g. TRL's DPO reference model,
        prepared as ``accelerator.prepare_model(ref_model, evaluation_mode=True)``): its parameters are
        frozen and partitioned like a LoRA base, as DeepSpeed's ZeRO-3 shards it, instead of kept whole on
        every rank. At stages 0-2 such a model is whole on every rank: one loaded under sharded loading is read
        here (see [Note: pending weights] in runtime/pending.py)."""
        model = super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)
        pending = find_pending(model) if evaluation_mode and not self._partitions_frozen_models() else None
        if pending is not None:  # whole on every rank, as under DDP: read now, not at its first forward
            pending.load(f"was prepared for evaluation at stage {self.zero_config.stage}, which keeps it whole",
                         level=logging.INFO)
        if evaluation_mode and self._partitions_frozen_models() and not _is_zero_model(model):
            model.requires_grad_(False)
            nothing = torch.optim.SGD([{"params": []}], lr=0.0)  # no state, no step: the engine needs no optimizer
            untiled = dataclasses.replace(self.zero_config, loss_tiles=1)  # a reference model computes no loss tiled
            model, _ = zero_prepare(model, nothing, untiled)
            logger.info("ZeroAccelerator: %s prepared for evaluation only: frozen and partitioned (stage 3)",
                        type(model).__name__)
        return model

    def _partitions_frozen_models(self) -> bool:
        config = self.zero_config
        return config.stage == 3 and config.tp_size == 1 and config.ep_size == 1 and config.sp_size == 1 and self.pipeline_config is None

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        """Shard ``optimizer`` with ``hfzero.prepare`` over the prepared model that owns its parameters."""
        if getattr(optimizer, "_is_accelerate_prepared", False) or unwrap_optimizer(optimizer) is not None:
            return super().prepare_optimizer(optimizer, device_placement=False)
        model = self._owner_of(optimizer)
        tiling = Installed()  # undone by hfzero.unprepare with the engine's own changes
        if self.zero_config.loss_tiles > 1 and getattr(model, "hfzero_loss_tiles", 1) == 1:
            if self.pipeline_config is not None:
                raise ConfigError("ZeroAccelerator: loss_tiles > 1 with pipeline parallelism is not supported")
            enable_tiled_loss(model, self.zero_config.loss_tiles, tiling)
        world = self.num_processes // self.zero_config.tp_size  # data-parallel replicas
        self.zero_config = resolve_auto_stage(self.zero_config, model, optimizer, world_size=world,
                                              accumulation_steps=self.gradient_accumulation_steps,
                                              batch=self._activation_batch(model))
        if self.pipeline_config is not None:
            if self.pipeline is not None:
                raise ConfigError("ZeroAccelerator: pipeline parallelism prepares one model and optimizer")
            self.pipeline = pipeline(model, optimizer, self.zero_config, self.pipeline_config)
            # the model object stays (config, save_pretrained); other stages' tensors are freed on this rank
            self.pipeline.release_other_stages(model)
            zero = self.pipeline.optimizer
        elif self.zero_config.tp_size > 1:
            model, zero, _ = prepare_tensor_parallel(model, optimizer, self.zero_config)
        elif self.zero_config.ep_size > 1:  # every rank reads its own batch: data as under plain data parallelism
            model, zero, _ = prepare_expert_parallel(model, optimizer, self.zero_config)
        elif self.zero_config.sp_size > 1:
            model, zero, _ = prepare_sequence_parallel(model, optimizer, self.zero_config)
        else:
            model, zero = zero_prepare(model, optimizer, self.zero_config)
        zero.engine.installed.on_undo(tiling.undo)
        self._zero_pairs.append((model, zero))
        self._zero_by_source[id(optimizer)] = zero
        wrapped = ZeroAcceleratedOptimizer(zero, device_placement=False, scaler=None)
        self._optimizers.append(wrapped)
        return wrapped

    def _activation_batch(self, model: nn.Module) -> tuple[int, int] | None:
        if self.zero_auto_batch is not None:
            return self.zero_auto_batch
        seq = default_seq_len(model)
        return (self._loader_batch or 1, seq) if seq else None

    def _owner_of(self, optimizer: torch.optim.Optimizer) -> nn.Module:
        params = {p for group in optimizer.param_groups for p in group["params"]}
        for model in self._models:
            if any(p in params for p in model.parameters()):
                return model
        raise ConfigError("ZeroAccelerator.prepare: no prepared model owns this optimizer's parameters; pass the "
                          "model to prepare() together with (or before) its optimizer, and build the optimizer "
                          "from that model's parameters")

    def prepare_scheduler(self, scheduler: Any) -> Any:
        """Re-point a scheduler built on the user's optimizer at its ZeroOptimizer, then wrap it as usual."""
        inner = getattr(scheduler, "optimizer", None)
        zero = self._zero_by_source.get(id(inner)) if inner is not None else None
        if zero is not None:
            scheduler.optimizer = zero
            _track_scheduler_steps(zero)
        return super().prepare_scheduler(scheduler)

    def free_memory(self, *objects: Any) -> Any:
        self._zero_pairs = []
        self._zero_by_source = {}
        return super().free_memory(*objects)

    # ---- data under pipeline or tensor parallelism ----------------------------------------------
    @property
    def num_processes(self) -> int:
        return self.data_parallel_coords[0] if self._data_parallel_view else super().num_processes

    @property
    def process_index(self) -> int:
        return self.data_parallel_coords[1] if self._data_parallel_view else super().process_index

    @property
    def _replicated(self) -> bool:
        """Several ranks hold one data-parallel replica (pipeline stages, TP ranks or SP ranks)."""
        return self.pipeline_config is not None or self.zero_config.tp_size > 1 or self.zero_config.sp_size > 1

    @property
    def data_parallel_coords(self) -> tuple[int, int]:
        """(dp size, dp rank) of this rank: under ``pipeline_config`` rank = pp_rank * dp + dp_rank; under
        tensor parallelism rank = dp_rank * tp + tp_rank (see hfzero/parallel/tensor.py); under sequence
        parallelism rank = dp_rank * sp + sp_rank (hfzero/parallel/sequence/mesh.py)."""
        world, rank = super().num_processes, super().process_index
        if self.pipeline_config is not None:
            dp = check_sizes(world, self.pipeline_config.pp_size)
            return dp, rank % dp
        sp = self.zero_config.sp_size
        if sp > 1:
            return check_sp_size(world, sp), rank // sp
        tp = self.zero_config.tp_size
        return check_tp_size(world, tp), rank // tp

    def gather(self, tensor: Any) -> Any:
        """As accelerate's; under pipeline parallelism the ranks of one pipeline hold the same values (one
        replica's), so only the first stage's ranks (world ranks 0 .. dp-1, one per replica, in dp order)
        are kept: what a data-parallel run of dp ranks gathers (losses, token counts, metrics).

        Under tensor parallelism every rank is kept (the TP ranks of a replica hold equal copies): the
        Trainer knows the TP degree (``ZeroTrainer.get_tp_size``) and divides its gathered token counts
        by it, as for transformers' own TP; ``gather_for_metrics`` keeps TP rank 0 of each replica.
        """
        gathered = super().gather(tensor)
        if self.pipeline_config is not None:
            pp = self.pipeline_config.pp_size
            return recursively_apply(lambda t: t[: t.shape[0] // pp] if t.dim() else t, gathered,
                                     error_on_other_type=False)
        if self._metrics_view and self.zero_config.tp_size * self.zero_config.sp_size > 1:
            # TP or SP ranks of one replica hold equal values (SP: the group's loss, see sequence/loss.py)
            world, tp = super().num_processes, self.zero_config.tp_size * self.zero_config.sp_size

            def tp_rank0(t: torch.Tensor) -> torch.Tensor:  # world ranks 0, tp, 2 tp, ...: one per replica
                if not t.dim():
                    return t
                per_rank = t.reshape(world, t.shape[0] // world, *t.shape[1:])  # (world, n, ...)
                return per_rank[::tp].reshape(-1, *t.shape[1:])

            return recursively_apply(tp_rank0, gathered, error_on_other_type=False)
        return gathered

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """As accelerate's; under tensor parallelism with one TP rank per replica (a dp run's samples, so
        the last batch's remainder is dropped at the right place)."""
        if self.zero_config.tp_size * self.zero_config.sp_size > 1 and use_gather_object:
            raise ConfigError("ZeroAccelerator: gather_for_metrics(use_gather_object=True) under tensor or sequence "
                              "parallelism is not supported; gather tensors")
        self._metrics_view = True
        try:
            return super().gather_for_metrics(input_data, use_gather_object)
        finally:
            self._metrics_view = False

    def prepare_data_loader(self, data_loader: Any, device_placement: bool | None = None,
                            slice_fn_for_dispatch: Any = None) -> Any:
        """As accelerate's; under pipeline or tensor parallelism shard over the data-parallel replicas, not the
        ranks: every rank of one replica reads the same batches."""
        if not self._replicated:
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        sp = self.zero_config.sp_size
        if sp > 1 and not isinstance(getattr(data_loader, "collate_fn", None), SequenceCollator):
            data_loader.collate_fn = SequenceCollator(data_loader.collate_fn, super().process_index % sp, sp)
        self._data_parallel_view = True
        try:
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        finally:
            self._data_parallel_view = False

    # ---- training -------------------------------------------------------------------------------
    def _zero_optimizers(self) -> list[ZeroOptimizer]:
        return [zero for _, zero in self._zero_pairs]

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Divide by the accumulation steps (as accelerate does), then the engine's scaled backward."""
        kwargs.pop("learning_rate", None)
        zeros = self._zero_optimizers()
        if not zeros:
            return super().backward(loss, **kwargs)
        loss = loss / self.gradient_accumulation_steps
        scaled = [z for z in zeros if z.engine.scaler.enabled]
        if len(zeros) == 1:
            zeros[0].backward(loss, **kwargs)
        elif not scaled:
            loss.backward(**kwargs)
        else:
            raise ConfigError("ZeroAccelerator.backward: fp16 loss scaling with several ZeRO optimizers is "
                              "ambiguous (each has its own scale); call optimizer.backward(loss) yourself")

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Accumulate gradients locally in the block: the engine defers its bucket reductions."""
        if not _is_zero_model(model):
            with super().no_sync(model):
                yield
            return
        with get_engine(model).no_sync():
            yield

    def _zero_for(self, parameters: Any) -> ZeroOptimizer | None:
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        params = set(parameters)
        owners = [zero for model, zero in self._zero_pairs if any(p in params for p in model.parameters())]
        if len(owners) > 1:
            raise ConfigError("ZeroAccelerator.clip_grad_norm_: the parameters belong to several ZeRO models; "
                              "clip each model's parameters separately")
        return owners[0] if owners else None

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                        norm_type: float = 2) -> torch.Tensor | None:
        """Clip the global gradient norm of the ZeRO model owning ``parameters``; return the norm.

        The engine clips all of that model's trainable gradients (they are sharded over ranks, so a
        subset cannot be clipped alone). On accumulation micro-steps (``sync_gradients`` False) the
        gradients are not complete yet: nothing is clipped and None is returned.
        """
        parameters = list(parameters) if not isinstance(parameters, torch.Tensor) else parameters
        zero = self._zero_for(parameters)
        if zero is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        if self.pipeline is not None and zero is self.pipeline.optimizer:
            return self.pipeline.clip_grad_norm_(max_norm, norm_type) if self.sync_gradients else None
        if not self.sync_gradients:
            if not self._warned_clip:
                logger.warning("clip_grad_norm_ called on an accumulation micro-step; ZeRO clips only when "
                               "accelerator.sync_gradients is True (call it under `if accelerator.sync_gradients:`)")
                self._warned_clip = True
            return None
        return zero.clip_grad_norm_(max_norm, norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor] | torch.Tensor, clip_value: float) -> None:
        parameters = list(parameters) if not isinstance(parameters, torch.Tensor) else parameters
        if self._zero_for(parameters) is not None:
            raise ConfigError("ZeroAccelerator: clip_grad_value_ is not supported for ZeRO models (gradients are "
                              "sharded inside the engine); use clip_grad_norm_")
        return super().clip_grad_value_(parameters, clip_value)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """ZeRO unscales fp16 gradients inside its step; only non-ZeRO optimizers are unscaled here."""
        if self._zero_optimizers() and (optimizer is None or unwrap_optimizer(optimizer) is not None):
            return
        super().unscale_gradients(optimizer)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """True when a ZeRO fp16 step was skipped for overflow (the scheduler should not advance)."""
        if any(zero.last_step_skipped for zero in self._zero_optimizers()):
            return True
        return any(opt.step_was_skipped for opt in self._optimizers if unwrap_optimizer(opt) is None)

    # ---- state ----------------------------------------------------------------------------------
    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The full model state dict, as CPU copies.

        Stages 0-2 keep full parameters on every rank: every rank gets the copy (as with DDP). At
        stage 3 the parameters are partitioned: every rank must call this (the units are gathered
        one at a time, a collective) and only the main process gets the weights, other ranks ``{}``
        (as FSDP's rank0_only full state dict). Copies, because a ZeRO model's parameters are views
        into flat buffers: safetensors would take them for shared tensors and drop all but one.
        """
        if self.pipeline is not None and any(m is model for m, _ in self._zero_pairs):
            return self.pipeline.full_state_dict(rank0_only=True)  # every stage's weights, on the main process
        if not _is_zero_model(model):
            return super().get_state_dict(model, unwrap=unwrap)
        return full_state_dict(model, rank0_only=needs_gathered_weights(model))

    def _split_optimizers(self) -> tuple[list[Any], list[Any]]:
        zero = [opt for opt in self._optimizers if unwrap_optimizer(opt) is not None]
        other = [opt for opt in self._optimizers if unwrap_optimizer(opt) is None]
        return zero, other

    @contextlib.contextmanager
    def _without_zero(self) -> Iterator[None]:
        """Hide ZeRO models and optimizers from the base class's save/load: their parameters are views of
        one flat buffer (safetensors refuses them as shared tensors) and their state is sharded."""
        models, optimizers = self._models, self._optimizers
        self._models = [m for m in models if not _is_zero_model(m)]
        self._optimizers = self._split_optimizers()[1]
        try:
            yield
        finally:
            self._models, self._optimizers = models, optimizers

    def _model_of(self, optimizer: Any) -> nn.Module:
        zero = unwrap_optimizer(optimizer)
        return next(model for model, z in self._zero_pairs if z is zero)

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True,
                   **save_model_func_kwargs: Any) -> str:
        """accelerate's save_state for everything but ZeRO models and optimizers; those go, every rank its
        shard, to ``zero_optimizer_<i>/`` through hfzero.checkpoint (weights, master shards, optimizer
        states; reshardable, and exportable with ``hfzero consolidate``)."""
        zero, _ = self._split_optimizers()
        with self._without_zero():
            location = super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
        for index, opt in enumerate(zero):
            save_optimizer_shards(Path(location) / _SHARD_DIR.format(index=index), self._model_of(opt), opt)
        return location

    def end_training(self) -> None:
        """accelerate's end_training, once an asynchronous checkpoint save (``HFZERO_ASYNC_SAVE``) has finished
        writing (its failure is raised here, on every rank)."""
        wait_for_save()
        super().end_training()

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None,
                   **load_model_func_kwargs: Any) -> None:
        """accelerate's load_state for everything but ZeRO models and optimizers, which are loaded from
        ``zero_optimizer_<i>/`` (at any world size or stage)."""
        zero, _ = self._split_optimizers()
        with self._without_zero():
            super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        directory = Path(input_dir) if input_dir is not None else self._latest_automatic_checkpoint()
        for index, opt in enumerate(zero):
            load_optimizer_shards(directory / _SHARD_DIR.format(index=index), self._model_of(opt), opt)

    def _latest_automatic_checkpoint(self) -> Path:
        root = Path(self.project_dir) / "checkpoints"
        folders = [f for f in root.iterdir() if re.search(r"(\d+)$", f.name)] if root.is_dir() else []
        if not folders:
            raise ConfigError(f"ZeroAccelerator.load_state: no checkpoint folders under {root}; pass input_dir")
        return max(folders, key=lambda f: int(re.search(r"(\d+)$", f.name).group(1)))  # type: ignore[union-attr]
