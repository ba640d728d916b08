"""hfzero: ZeRO (Rajbhandari et al.) for Hugging Face models.

Public names load on first use, so ``import hfzero`` (and the torch-free profile reader the
dashboard uses) does not import torch.distributed, transformers or accelerate until needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "ZeroConfig": "hfzero.config",
    "ConfigError": "hfzero.config",
    "MemoryRole": "hfzero.roles",
    "MODEL_STATE_ROLES": "hfzero.roles",
    "prepare": "hfzero.runtime.prepare",
    "get_engine": "hfzero.runtime.prepare",
    "ZeroEngine": "hfzero.runtime.engine",
    "ZeroOptimizer": "hfzero.runtime.optimizer",
    "save_checkpoint": "hfzero.checkpoint",
    "load_checkpoint": "hfzero.checkpoint",
    "consolidate": "hfzero.checkpoint",
    "CheckpointError": "hfzero.checkpoint",
    "ZeroProfiler": "hfzero.profiler",
    "model_states_bytes": "hfzero.estimate",
    "max_params": "hfzero.estimate",
    "choose_stage": "hfzero.estimate",
    "full_state_dict": "hfzero.runtime.stage3.state_dict",
    "compile_regions": "hfzero.runtime.compile",
    "GatherOrderError": "hfzero.runtime.stage3.scheduler",
    "init_sharded": "hfzero.runtime.stage3.init",
    "from_pretrained_sharded": "hfzero.runtime.stage3.init",
    "WeightLoadError": "hfzero.runtime.stage3.weights",
    "sharded_init": "hfzero.loading",
    "pipeline": "hfzero.parallel.pipeline",
    "PipelineConfig": "hfzero.parallel.pipeline",
    "ZeroAccelerator": "hfzero.integrations.accelerate",
    "ZeroTrainer": "hfzero.integrations.trainer",
    "ZeroTrainingArguments": "hfzero.integrations.trainer",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from hfzero.checkpoint import CheckpointError, consolidate, load_checkpoint, save_checkpoint
    from hfzero.config import ConfigError, ZeroConfig
    from hfzero.estimate import choose_stage, max_params, model_states_bytes
    from hfzero.integrations.accelerate import ZeroAccelerator
    from hfzero.integrations.trainer import ZeroTrainer, ZeroTrainingArguments
    from hfzero.parallel.pipeline import PipelineConfig, pipeline
    from hfzero.profiler import ZeroProfiler
    from hfzero.roles import MODEL_STATE_ROLES, MemoryRole
    from hfzero.runtime.compile import compile_regions
    from hfzero.runtime.engine import ZeroEngine
    from hfzero.runtime.optimizer import ZeroOptimizer
    from hfzero.runtime.prepare import get_engine, prepare
    from hfzero.loading import sharded_init
    from hfzero.runtime.stage3.init import from_pretrained_sharded, init_sharded
    from hfzero.runtime.stage3.scheduler import GatherOrderError
    from hfzero.runtime.stage3.state_dict import full_state_dict
    from hfzero.runtime.stage3.weights import WeightLoadError


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hfzero' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
