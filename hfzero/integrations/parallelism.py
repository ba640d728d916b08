"""accelerate's ``ParallelismConfig`` (``Accelerator(parallelism_config=...)``, TrainingArguments
``parallelism_config``, or ``ACCELERATE_USE_PARALLELISM_CONFIG`` + ``PARALLELISM_CONFIG_*``) read into ZeroConfig.

Mapped: ``sp_size`` -> ``ZeroConfig.sp_size`` (hfzero's own Ulysses attention, whatever ``sp_backend`` names:
accelerate's "deepspeed" backend is replaced, not used), ``tp_size`` -> ``ZeroConfig.tp_size``. Refused by
name, with a ConfigError: ``dp_replicate_size`` / ``dp_shard_size`` > 1 (hfzero shards model states over
every data-parallel rank; a replicate x shard split, HSDP, is not built here), ``cp_size`` > 1 (context
parallelism: use sp_size), and the handlers' non-default options. The data-parallel size is what remains:
world / (tp x sp).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

from hfzero.config import ConfigError, ZeroConfig

_REFUSED = {
    "dp_replicate_size": "replicated x sharded data parallelism (HSDP) is not built; hfzero shards model states "
                         "over every data-parallel rank (world / (tp_size x sp_size))",
    "dp_shard_size": "hfzero's ZeRO shards over every data-parallel rank (world / (tp_size x sp_size)); a "
                     "separate shard size (HSDP) is not built",
    "cp_size": "context parallelism (ring attention) is not built; hfzero splits sequences with sp_size "
               "(Ulysses all-to-all attention)",
}


def _size(pc: Any, name: str) -> int:
    value = getattr(pc, name, None)
    return 1 if value is None else int(value)


def _refuse_handlers(pc: Any) -> None:
    for name in ("tp_handler", "cp_handler", "sp_handler"):
        handler = getattr(pc, name, None)
        if handler is None:
            continue
        default = type(handler)()
        changed = [f.name for f in dataclasses.fields(handler) if getattr(handler, f.name) != getattr(default, f.name)]
        if changed:
            raise ConfigError(f"hfzero: ParallelismConfig.{name} options {changed} are not supported by hfzero "
                              "(its tensor / sequence parallelism takes sizes only); drop them")


def zero_config_from_parallelism(pc: Any, config: ZeroConfig) -> ZeroConfig:
    """``config`` with ``pc``'s sizes (see the module docstring); a ConfigError for what hfzero cannot honour
    or for a size that contradicts an explicit ``--zero_*`` one."""
    if pc is None:
        return config
    for name, why in _REFUSED.items():
        if _size(pc, name) > 1:
            raise ConfigError(f"hfzero: ParallelismConfig.{name}={_size(pc, name)} is not supported: {why}. "
                              f"Drop {name} (leave it 1)")
    _refuse_handlers(pc)
    mapped = {}
    for name in ("sp_size", "tp_size"):
        wanted, have = _size(pc, name), getattr(config, name)
        if wanted > 1 and have > 1 and wanted != have:
            raise ConfigError(f"hfzero: ParallelismConfig.{name}={wanted} contradicts ZeroConfig.{name}={have} "
                              f"(--zero_{name}); give it once")
        if wanted > 1:
            mapped[name] = wanted
    return dataclasses.replace(config, **mapped) if mapped else config


_ENV = "ACCELERATE_USE_PARALLELISM_CONFIG"


def parallelism_from_env() -> Any:
    """The ParallelismConfig accelerate would build from ``PARALLELISM_CONFIG_*`` when
    ``ACCELERATE_USE_PARALLELISM_CONFIG`` is true (``accelerate launch`` with a parallelism section), else None."""
    if os.environ.get(_ENV, "false").lower() != "true":
        return None
    from accelerate import ParallelismConfig

    return ParallelismConfig()


@contextlib.contextmanager
def without_accelerate_mesh() -> Iterator[None]:
    """While accelerate's Accelerator initializes: it builds no device mesh of its own from the environment
    (hfzero read the sizes already and builds its meshes at prepare)."""
    saved = os.environ.get(_ENV)
    os.environ[_ENV] = "false"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[_ENV]
        else:
            os.environ[_ENV] = saved
