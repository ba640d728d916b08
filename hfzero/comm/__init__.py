"""The communication layer: every torch.distributed call hfzero makes, and what it needs to make them.

- ``collectives.py``: ``Communicator``, the only caller of torch.distributed collectives, with byte
  accounting (intra / inter node) and ``record_function`` labels.
- ``quantized.py`` and ``codec.py``: ZeRO++'s quantized all-gather and reduce-scatter (qwZ, qgZ) and the
  block codec they use.
- ``hierarchy.py``: the node parts of data-parallel groups (hpZ's node communicator, qgZ's two-hop reduce).
- ``topology.py``: which ranks share a node (pure Python: the estimator uses it too).
- ``timing.py``: time marks on a device (CUDA events, host clock on CPU).
- ``gloo_exit.py``: lets gloo's worker threads finish before the interpreter finalizes.

Nothing here imports the runtime, the wrappers or the integrations. ``Communicator``, ``CommStats`` and
``Handle`` load on first use from ``hfzero.comm``, so that ``hfzero.comm.topology`` stays torch-free.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {"Communicator": "collectives", "CommStats": "collectives", "Handle": "collectives"}

if TYPE_CHECKING:
    from hfzero.comm.collectives import CommStats, Communicator, Handle


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hfzero.comm' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hfzero.comm.{module}"), name)
