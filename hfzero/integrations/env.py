"""The ``HFZERO_*`` environment variables: how a launcher hands ZeRO settings to the processes it starts.

Field ``x`` of ``ZeroConfig`` travels as ``HFZERO_X`` (upper case), as text; ``ZeroConfig.from_strings``
converts it back, so the launcher, the accelerate integration and the Trainer read one format.
``HFZERO_PROFILE_DIR`` (not a ZeroConfig field) asks the Trainer integration to attach the profiler.
Pipeline options (``PipelineConfig`` fields, as ``--zero_pp_size``, ``--zero_pp_schedule``, ...) travel
the same way: ``HFZERO_PP_SIZE``, ``HFZERO_PP_SCHEDULE``, ...
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from hfzero.config import ConfigError, ZeroConfig
from hfzero.parallel.pipeline.config import PipelineConfig

ENV_PREFIX = "HFZERO_"
PROFILE_DIR_ENV = "HFZERO_PROFILE_DIR"
NOT_CONFIG = frozenset({
    PROFILE_DIR_ENV,
    "HFZERO_DASHBOARD_RUNS",  # the dashboard's run directories (dashboard/pages.py)
    "HFZERO_CHECKPOINT_PAUSE_AT", "HFZERO_CHECKPOINT_PAUSE_SIGNAL",  # a test hook of hfzero/checkpoint/save.py
    "HFZERO_FORCE_CPU_CHECKPOINTING", "HFZERO_FORCE_HOST_OFFLOAD",  # test switches of the host paths (FORCE_ENV)
    "HFZERO_WORKER_START",  # how hfzero.testing.run_distributed starts ranks (testing/spawn.py START_ENV)
})
"""``HFZERO_*`` variables hfzero reads that are not ZeroConfig fields: never taken for a typo."""
_PIPELINE = PipelineConfig.options()


def env_name(field: str) -> str:
    """The environment variable carrying ZeroConfig field ``field``."""
    return ENV_PREFIX + field.upper()


def config_strings_from_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ZeroConfig fields set in ``environ`` (default ``os.environ``), as raw strings.

    Raises ConfigError for an ``HFZERO_*`` variable that names no ZeroConfig field, so a typo in a
    launcher's settings is reported instead of silently ignored.
    """
    environ = os.environ if environ is None else environ
    fields = set(ZeroConfig.field_names())
    values: dict[str, str] = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX) or key in NOT_CONFIG or key[len(ENV_PREFIX):].lower() in _PIPELINE:
            continue
        field = key[len(ENV_PREFIX):].lower()
        if field not in fields:
            valid = ", ".join(sorted(env_name(f) for f in fields))
            pipeline = ", ".join(sorted(env_name(o) for o in _PIPELINE))
            raise ConfigError(f"environment variable {key} names no ZeroConfig option; valid ones are {valid}, "
                              f"{pipeline} (and, not options, {', '.join(sorted(NOT_CONFIG))}). Unset or rename it")
        values[field] = raw
    return values


def config_from_env(environ: Mapping[str, str] | None = None) -> ZeroConfig | None:
    """The ZeroConfig described by ``HFZERO_*`` variables, or None when none is set."""
    values = config_strings_from_env(environ)
    return ZeroConfig.from_strings(values) if values else None


def pipeline_strings_from_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The pipeline options set in ``environ`` (``HFZERO_PP_SIZE=2`` -> ``{"pp_size": "2"}``)."""
    environ = os.environ if environ is None else environ
    return {key[len(ENV_PREFIX):].lower(): raw for key, raw in environ.items()
            if key.startswith(ENV_PREFIX) and key[len(ENV_PREFIX):].lower() in _PIPELINE}


def split_pipeline_options(values: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """``{option: text}`` -> (ZeroConfig fields, pipeline options)."""
    return ({k: v for k, v in values.items() if k not in _PIPELINE},
            {k: v for k, v in values.items() if k in _PIPELINE})


def config_to_env(values: Mapping[str, str]) -> dict[str, str]:
    """``{field: text}`` -> ``{HFZERO_FIELD: text}`` (validated: the texts must build a ZeroConfig and, for
    pipeline options, a PipelineConfig)."""
    zero, pipe = split_pipeline_options(values)
    ZeroConfig.from_strings(zero)
    if pipe:
        PipelineConfig.from_strings(pipe)
    return {env_name(k): str(v) for k, v in values.items()}


def profile_dir_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The profiler run directory requested through ``HFZERO_PROFILE_DIR``, if any."""
    environ = os.environ if environ is None else environ
    return environ.get(PROFILE_DIR_ENV) or None
