"""Why a rank's memory peaks: its memory split into model states, transient buffers, activations
(with the other live tensors the engine does not hold) and the remainder. Pure functions of one
record (no torch), so the dashboard and tests use them on recorded data.

[Note: peak decomposition]
``total`` is what the rank holds from the system: RSS on a CPU rank, the caching allocator's
reserved bytes on a CUDA rank. It is split into:
- ``model_states``: the model-state roles (the paper's formula, see roles.py);
- ``transient``: the engine's other roles (buckets, gathered units and gather buffers, fp32
  gradients, communication buffers), which follow the configured bucket / prefetch sizes;
- ``activations``: live tensors the engine does not hold (allocated - engine bytes; activation
  checkpoints included): activations and their gradients, optimizer temporaries, the data;
- ``remainder``: total - allocated: memory the allocator holds but has free (fragmentation, the
  caching allocator's cache) and, on the host, the libraries' code and non-malloc memory.
A run that does not fit shows at once which part grew. The step record keeps the split at the
sampled boundary with the largest total, and ``peak_total`` (VmHWM / the allocator's reserved
peak, lifetime), whose excess over the sampled peak happened between phase boundaries.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

PARTS = ("model_states", "transient", "activations", "remainder")
"""The decomposition's parts, in stacking order."""


def decompose(roles: Mapping[str, int], allocator: Mapping[str, Any], model_state_keys: Collection[str],
              host_roles: Mapping[str, int] | None = None) -> dict[str, int] | None:
    """The split of one record's memory (see [Note: peak decomposition]); None without allocator figures.

    ``host_roles``: the part of ``roles`` offloaded to host memory; on a CUDA rank it is not device
    memory and is left out (on a CPU rank host memory is what ``rss`` measures, so it stays in)."""
    cuda = allocator.get("reserved_unallocated") is not None or allocator.get("peak_reserved") is not None
    total = allocator.get("reserved") if cuda else allocator.get("rss")
    allocated = allocator.get("allocated")
    if not isinstance(total, int) or not isinstance(allocated, int):
        return None
    if cuda and host_roles:
        roles = {k: int(v) - int(host_roles.get(k, 0)) for k, v in roles.items()}
    model_states = sum(int(v) for k, v in roles.items() if k in model_state_keys)
    engine = sum(int(v) for v in roles.values())
    return {
        "total": total,
        "model_states": model_states,
        "transient": engine - model_states,
        "activations": max(0, allocated - engine),
        "remainder": total - max(allocated, engine),
    }
