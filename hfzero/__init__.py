"""hfzero: ZeRO (Rajbhandari et al.) for Hugging Face models.

Public names load on first use, so ``import hfzero`` (and the torch-free profile reader the
dashboard uses) does not import torch.distributed, transformers or accelerate until needed. Importing it with a
torch older than the floor (``hfzero.version.TORCH_FLOOR``) raises ImportError at once.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import TYPE_CHECKING, Any

from hfzero.version import __version__ as __version__
from hfzero.version import check_torch as _check_torch

_check_torch()  # below the torch floor, fail here with a message that names it (hfzero/version.py)

_EXPORTS = {
    "ZeroConfig": "hfzero.config",
    "ConfigError": "hfzero.config",
    "MemoryRole": "hfzero.roles",
    "MODEL_STATE_ROLES": "hfzero.roles",
    "prepare": "hfzero.parallel.data_parallel",
    "unprepare": "hfzero.runtime.unprepare",
    "get_engine": "hfzero.runtime.engine",
    "ZeroEngine": "hfzero.runtime.engine",
    "ZeroOptimizer": "hfzero.runtime.optimizer",
    "save_checkpoint": "hfzero.checkpoint",
    "load_checkpoint": "hfzero.checkpoint",
    "consolidate": "hfzero.checkpoint",
    "CheckpointError": "hfzero.checkpoint",
    "ZeroProfiler": "hfzero.profiler",
    "model_states_bytes": "hfzero.planning.estimate",
    "max_params": "hfzero.planning.estimate",
    "choose_stage": "hfzero.planning.estimate",
    "full_state_dict": "hfzero.runtime.stage3.state_dict",
    "compile_regions": "hfzero.runtime.compile",
    "GatherOrderError": "hfzero.runtime.stage3.scheduler",
    "init_sharded": "hfzero.loading.construct",
    "from_pretrained_sharded": "hfzero.loading.construct",
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
    from hfzero.planning.estimate import choose_stage, max_params, model_states_bytes
    from hfzero.integrations.accelerate import ZeroAccelerator
    from hfzero.integrations.trainer import ZeroTrainer, ZeroTrainingArguments
    from hfzero.parallel.pipeline import PipelineConfig, pipeline
    from hfzero.profiler import ZeroProfiler
    from hfzero.roles import MODEL_STATE_ROLES, MemoryRole
    from hfzero.runtime.compile import compile_regions
    from hfzero.runtime.engine import ZeroEngine
    from hfzero.runtime.optimizer import ZeroOptimizer
    from hfzero.parallel.data_parallel import prepare
    from hfzero.runtime.unprepare import unprepare
    from hfzero.runtime.engine import get_engine
    from hfzero.loading import sharded_init
    from hfzero.loading.construct import from_pretrained_sharded, init_sharded
    from hfzero.runtime.stage3.scheduler import GatherOrderError
    from hfzero.runtime.stage3.state_dict import full_state_dict
    from hfzero.runtime.stage3.weights import WeightLoadError


MOVED = {
    "hfzero.estimate": "hfzero.planning.estimate",
    "hfzero.estimate_activations": "hfzero.planning.activations",
    "hfzero.estimate_quantized": "hfzero.planning.quantized",
    "hfzero.plan": "hfzero.planning.plan",
    "hfzero.plan_measured": "hfzero.planning.measured",
    "hfzero.plan_verify": "hfzero.planning.verify",
    "hfzero.autostage": "hfzero.planning.autostage",
    "hfzero.quantize": "hfzero.comm.codec",
    "hfzero.quantized_comm": "hfzero.comm.quantized",
    "hfzero.topology": "hfzero.comm.topology",
    "hfzero.timing": "hfzero.comm.timing",
    "hfzero.gloo_exit": "hfzero.comm.gloo_exit",
    "hfzero.runtime.stage3.init": "hfzero.loading.construct",
}
"""Modules that moved with the layout by concept (issue 31) -> where they live now. The old names keep importing, as
the same module object, with a DeprecationWarning, for one release (README's changelog)."""


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves an old module path of ``MOVED`` to the module at its new one (the same object)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: Any) -> Any:
        warnings.warn(f"{spec.name} moved to {MOVED[spec.name]}; the old path works until the next release",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(MOVED[spec.name])  # keeps its own __name__ and __spec__

    def exec_module(self, module: Any) -> None:
        """Nothing to run: the new module is already imported."""


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())


def __getattr__(name: str) -> Any:
    if f"hfzero.{name}" in MOVED:  # ``from hfzero import estimate``: the moved module, with its warning
        return importlib.import_module(f"hfzero.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hfzero' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
