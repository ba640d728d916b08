"""Hugging Face integrations: ZeroAccelerator (accelerate), ZeroTrainer (transformers), ``hfzero run``.

Names load on first use, so ``import hfzero.integrations`` does not import accelerate or transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ZeroAccelerator": "hfzero.integrations.accelerate",
    "ZeroTrainer": "hfzero.integrations.trainer",
    "ZeroTrainingArguments": "hfzero.integrations.trainer",
    "ZeroProfilerCallback": "hfzero.integrations.trainer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hfzero.integrations' has no attribute {name!r}")
