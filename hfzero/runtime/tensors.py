"""Walking nested module outputs (tensors inside tuples, lists and dicts such as ModelOutput)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``value``: itself, or inside (nested) tuples, lists and dicts, in order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from iter_tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from iter_tensors(v)
