"""Sharded construction for stage 3: build a Hugging Face model whose ranks never hold it whole.

``from_pretrained_sharded(model_dir, optimizer_factory, ZeroConfig(stage=3))`` builds the model from
its config with the parameters on the meta device, then lets the stage-3 engine fill each rank's
shard straight from the directory's safetensors files (``init_sharded(config, ...)`` does the same
with a deterministic fresh initialization). See [Note: stage-3 sharded construction] in weights.py.

Memory per rank while loading: the rank's parameter shard (+ persistent parameters whole), the
buffers, and at most the covering rows of one parameter read from the checkpoint (or one decoder
block / one module outside the blocks when initializing) — never the full model. The engine's own
model states (gradient shard, master shard) are allocated as by ``hfzero.prepare``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from hfzero.comm.collectives import Communicator
from hfzero.config import ConfigError, ZeroConfig
from hfzero.logging import get_logger
from hfzero.runtime.optimizer import ZeroOptimizer
from hfzero.parallel.data_parallel import prepare
from hfzero.runtime.stage3.units import default_unit_names
from hfzero.runtime.stage3.weights import (CheckpointSource, InitSource, WeightLoadError, WeightSource,
                                           init_added_values, params_on_meta, parameter_aliases)

logger = get_logger(__name__)

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]
"""Builds the (plain) optimizer from the model, whose parameters are still on the meta device."""


def from_pretrained_sharded(model_dir_or_config, optimizer_factory: OptimizerFactory, zero_config: ZeroConfig, *,
                            process_group: dist.ProcessGroup | None = None, dtype: torch.dtype | None = None,
                            device: torch.device | str | None = None, units: Sequence[str] | None = None,
                            seed: int = 0, verify_gather_order: bool = True,
                            wrap: Callable[[nn.Module], nn.Module] | None = None) -> tuple[nn.Module, ZeroOptimizer]:
    """Build ``AutoModelForCausalLM`` sharded over ``process_group`` and return ``(model, optimizer)``.

    ``model_dir_or_config``: a ``save_pretrained`` directory (``model.safetensors`` or a sharded save
    with ``model.safetensors.index.json``): each rank reads only the element ranges of its shard; or
    a ``transformers`` config: parameters are initialized per init group under ``seed`` (see
    [Note: stage-3 sharded construction]). ``optimizer_factory(model)`` builds the optimizer over the
    model's (meta) parameters, e.g. ``lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4)``.
    ``dtype``: the dtype the model is built in (default float32; ``zero_config.dtype`` still decides
    the parameters' dtype as in ``hfzero.prepare``). ``device``: where the shard and the buffers live
    (default: the process group's device, CPU for gloo). Collective: every rank must call it.
    ``wrap(model) -> model`` (checkpoint directories only) wraps the model built on meta before the
    optimizer is built, e.g. ``lambda m: peft.get_peft_model(m, LoraConfig(...))``: the base weights are
    found in the checkpoint by parameter identity (whatever the wrapper renamed them to) and the
    parameters it adds are initialized on the CPU (see ``init_added_values`` in weights.py), then sharded
    like the others.
    """
    if not isinstance(zero_config, ZeroConfig) or zero_config.stage != 3:
        raise ConfigError("hfzero: sharded construction needs ZeroConfig(stage=3); at stages 0-2 every rank "
                          "holds the full parameters anyway (load with from_pretrained, then hfzero.prepare)")
    if dist.is_available() and dist.is_initialized():
        device = torch.device(device) if device is not None else Communicator(process_group).device
    else:
        device = torch.device(device or "cpu")
    config, model_dir = _config_of(model_dir_or_config)
    checkpoint = CheckpointSource(model_dir, device) if model_dir is not None else None  # fails early
    if wrap is not None and checkpoint is None:
        raise ConfigError("hfzero: wrap= needs a save_pretrained directory (its weights); a fresh initialization "
                          "from a config cannot be wrapped yet")
    model = _build_on_meta(config, dtype, device)
    source: WeightSource = checkpoint or InitSource(model, list(units or default_unit_names(model)), device, seed)
    try:
        if checkpoint is not None:
            checkpoint.check(model, list(parameter_aliases(model)))
            _load_persistent_buffers(model, checkpoint)
            _load_generation_config(model, model_dir)
            model.eval()  # as from_pretrained returns it
        if wrap is not None:
            model = _wrap(model, wrap, checkpoint, seed)
        optimizer = optimizer_factory(model)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"hfzero: optimizer_factory must return a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        _materialize_whole(model, optimizer, source, dtype, zero_config.param_persistence_threshold)
        model, zero_optimizer = prepare(model, optimizer, zero_config, process_group, units=units,
                                        verify_gather_order=verify_gather_order, weights=source)
    finally:
        source.close()
    logger.info("stage 3: built %s sharded from %s", type(model).__name__, model_dir or "a fresh initialization")
    return model, zero_optimizer


def init_sharded(config, optimizer_factory: OptimizerFactory, zero_config: ZeroConfig, **kwargs):
    """``from_pretrained_sharded`` from a ``transformers`` config: a fresh, deterministic initialization."""
    from transformers import PretrainedConfig

    if not isinstance(config, PretrainedConfig):
        raise TypeError(f"hfzero.init_sharded: config must be a transformers PretrainedConfig, got "
                        f"{type(config).__name__}; to load weights use from_pretrained_sharded(model_dir, ...)")
    return from_pretrained_sharded(config, optimizer_factory, zero_config, **kwargs)


def _config_of(model_dir_or_config):
    """(config, model directory or None)."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model_dir_or_config, PretrainedConfig):
        return model_dir_or_config, None
    if not isinstance(model_dir_or_config, (str, os.PathLike)):
        raise TypeError("hfzero: pass a save_pretrained directory or a transformers config, got "
                        f"{type(model_dir_or_config).__name__}")
    model_dir = os.fspath(model_dir_or_config)
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise WeightLoadError(f"hfzero: {model_dir!r} has no config.json; pass a directory written by "
                              "save_pretrained (a local path: nothing is downloaded)")
    return AutoConfig.from_pretrained(model_dir, local_files_only=True), model_dir


def _build_on_meta(config, dtype: torch.dtype | None, device: torch.device) -> nn.Module:
    """The model with parameters on meta and buffers (computed by the constructors) on ``device``."""
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype} if dtype is not None else {}
    with params_on_meta():
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)
    return model


def _load_persistent_buffers(model: nn.Module, source: CheckpointSource) -> None:
    """Buffers saved in the checkpoint replace the computed ones (non-persistent ones are never saved)."""
    params = set(parameter_aliases(model))
    for key, value in model.state_dict(keep_vars=True).items():
        if key not in params and not isinstance(value, nn.Parameter) and source.has(key):
            stored = source.read_key(key)
            if stored.shape != value.shape:
                raise WeightLoadError(f"hfzero: buffer {key}: checkpoint shape {list(stored.shape)}, "
                                      f"model {list(value.shape)}")
            with torch.no_grad():
                value.copy_(stored)


def _load_generation_config(model: nn.Module, model_dir: str) -> None:
    if os.path.isfile(os.path.join(model_dir, "generation_config.json")):
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(model_dir, local_files_only=True)


def _wrap(model: nn.Module, wrap: Callable[[nn.Module], nn.Module], source: CheckpointSource, seed: int) -> nn.Module:
    """Apply ``wrap`` to the meta model; map its renamed parameters back to the checkpoint by identity."""
    base = {p: name for name, p in model.named_parameters()}
    wrapped = wrap(model)
    renamed, added = {}, []
    for name, p in wrapped.named_parameters():
        if p in base:
            renamed[name] = base[p]
        else:
            added.append((name, p))
    source.adopt_wrapped(renamed, init_added_values(wrapped, added, seed))
    logger.info("stage 3: wrapped as %s; %d parameter(s) added by the wrapper", type(wrapped).__name__, len(added))
    return wrapped


def _materialize_whole(model: nn.Module, optimizer: torch.optim.Optimizer, source: WeightSource,
                       dtype: torch.dtype | None, threshold: int) -> None:
    """Parameters the engine keeps whole are loaded whole: frozen ones below the persistence threshold
    and trainable ones outside the optimizer. Larger frozen parameters stay on meta: the engine fills
    only this rank's slice (see [Note: stage-3 frozen parameters])."""
    in_optimizer = {p for group in optimizer.param_groups for p in group["params"]}
    for name, p in model.named_parameters():
        whole = p.numel() < threshold if not p.requires_grad else p not in in_optimizer
        if p.device.type == "meta" and whole:
            value = source.read_whole(name, p.shape).to(source.device, dtype or p.dtype)
            torch.utils.swap_tensors(p, nn.Parameter(value, requires_grad=p.requires_grad))  # keeps ties
