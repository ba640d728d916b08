"""Why a rank's memory peaks: its memory split into model states, transient buffers, activations,
other live tensors and the remainder. Pure functions of one record (no torch), so the dashboard and
tests use them on recorded data.

[Note: peak decomposition]
``total`` is what the rank holds from the system: RSS on a CPU rank, the caching allocator's
reserved bytes on a CUDA rank. It is split into:
- ``model_states``: the model-state roles (the paper's formula, see roles.py);
- ``transient``: the engine's other roles (buckets, gathered units and gather buffers, fp32
  gradients, communication buffers), which follow the configured bucket / prefetch sizes;
- ``activations``: the measured activation roles, ``activations`` (saved for backward) and
  ``act_checkpoint`` (checkpoints as stored; in host memory with cpu_checkpointing);
- ``other``: allocated - all roles: live tensors no role accounts for (gradients of activations,
  a checkpointed layer's recomputation, optimizer temporaries, the data);
- ``remainder``: total - allocated: memory the allocator holds but has free (fragmentation, the
  caching allocator's cache) and, on the host, the libraries' code and non-malloc memory.
``other + remainder`` is what the dashboard calls "other / allocator overhead": the peak minus the
roles. A run that does not fit shows at once which part grew. The step record keeps the split at the
sampled boundary with the largest total, and ``peak_total`` (VmHWM / the allocator's reserved
peak, lifetime), whose excess over the sampled peak happened between phase boundaries.
Profiles written before ``other`` existed have ``activations`` = allocated - all roles (the
activation roles were counted under ``transient``); ``legacy_parts`` maps them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

PARTS = ("model_states", "transient", "activations", "other", "remainder")
"""The decomposition's parts, in stacking order."""

ACTIVATION_KEYS = frozenset({"activations", "act_checkpoint"})
"""The measured activation roles (``MemoryRole.ACTIVATIONS`` and ``MemoryRole.ACT_CHECKPOINT`` values)."""


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
    activations = sum(int(v) for k, v in roles.items() if k in ACTIVATION_KEYS)
    held = sum(int(v) for v in roles.values())
    return {
        "total": total,
        "model_states": model_states,
        "transient": held - model_states - activations,
        "activations": activations,
        "other": max(0, allocated - held),
        "remainder": total - max(allocated, held),
    }


def legacy_parts(peak: Mapping[str, Any]) -> dict[str, Any]:
    """A recorded ``peak`` with every part of ``PARTS``: one written before ``other`` existed has its
    ``activations`` (allocated - all roles) moved to ``other`` and 0 measured activations."""
    if "other" in peak:
        return dict(peak)
    return {**peak, "activations": 0, "other": peak.get("activations")}
