"""accelerate's ``ParallelismConfig`` (``Accelerator(parallelism_config=...)``, TrainingArguments
``parallelism_config``, or ``ACCELERATE_USE_PARALLELISM_CONFIG`` + ``PARALLELISM_CONFIG_*``) read into ZeroConfig.

Mapped: ``sp_size`` -> ``ZeroConfig.sp_size`` (hfzero's own Ulysses attention, whatever ``sp_backend`` names:
accelerate's "deepspeed" backend is replaced, not used), ``tp_size`` -> ``ZeroConfig.tp_size``,
``dp_replicate_size`` x ``dp_shard_size`` -> HSDP (``ZeroConfig.shard_size = dp_shard_size`` when
``dp_replicate_size`` > 1; ``dp_shard_size`` alone is flat ZeRO over the data-parallel world; hfzero builds the
mesh, accelerate builds none; docs/multinode.md). Refused by name, with a ConfigError: ``cp_size`` > 1
(context parallelism: use sp_size), HSDP together with sp (not built), and the handlers' non-default options.
HSDP with ``tp_size`` is hfzero's HSDP x TP (``rank = (replicate_rank x dp_shard_size + shard_rank) x tp_size +
tp_rank``, accelerate's mesh order). The data-parallel size is what remains: world / (tp x sp).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

from hfzero.config import ConfigError, ZeroConfig

_REFUSED = {
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


def zero_config_from_parallelism(pc: Any, config: ZeroConfig, world_size: int | None = None) -> ZeroConfig:
    """``config`` with ``pc``'s sizes (see the module docstring); a ConfigError for what hfzero cannot honour,
    for a size that contradicts an explicit ``--zero_*`` one, or (given ``world_size``) for sizes that do not
    cover the world."""
    if pc is None:
        return config
    for name, why in _REFUSED.items():
        if _size(pc, name) > 1:
            raise ConfigError(f"hfzero: ParallelismConfig.{name}={_size(pc, name)} is not supported: {why}. "
                              f"Drop {name} (leave it 1)")
    _refuse_handlers(pc)
    mapped: dict[str, int] = {}
    for name in ("sp_size", "tp_size"):
        wanted, have = _size(pc, name), getattr(config, name)
        if wanted > 1 and have > 1 and wanted != have:
            raise ConfigError(f"hfzero: ParallelismConfig.{name}={wanted} contradicts ZeroConfig.{name}={have} "
                              f"(--zero_{name}); give it once")
        if wanted > 1:
            mapped[name] = wanted
    mapped.update(_hsdp_sizes(pc, config, world_size))
    return dataclasses.replace(config, **mapped) if mapped else config


def _hsdp_sizes(pc: Any, config: ZeroConfig, world_size: int | None) -> dict[str, int]:
    """``dp_replicate_size`` x ``dp_shard_size`` as ``shard_size`` (HSDP), checked."""
    replicate, shard = _size(pc, "dp_replicate_size"), _size(pc, "dp_shard_size")
    if replicate == 1 and shard == 1:
        return {}
    split = _size(pc, "tp_size") * _size(pc, "sp_size")
    if world_size is not None and replicate * shard * split != world_size:
        raise ConfigError(f"hfzero: ParallelismConfig(dp_replicate_size={replicate}, dp_shard_size={shard}) covers "
                          f"{replicate * shard * split} rank(s) with tp x sp, the world has {world_size}")
    if replicate == 1:
        return {}  # dp_shard_size alone: ZeRO over the whole data-parallel world, as without it
    if _size(pc, "sp_size") > 1:  # HSDP x TP is built: the same dp_replicate x dp_shard x tp layout as accelerate's
        raise ConfigError(f"hfzero: ParallelismConfig(dp_replicate_size={replicate}) with sp_size="
                          f"{_size(pc, 'sp_size')}: HSDP x sequence parallelism is not built; use one")
    if shard == 1:
        raise ConfigError("hfzero: ParallelismConfig(dp_shard_size=1) replicates everything: use "
                          "ZeroConfig(stage=0) (plain data parallelism) instead")
    if config.shard_size not in (0, shard):
        raise ConfigError(f"hfzero: ParallelismConfig(dp_shard_size={shard}) disagrees with "
                          f"ZeroConfig.shard_size={config.shard_size}; set one of them")
    return {"shard_size": shard}


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
