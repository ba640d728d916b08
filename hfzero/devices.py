"""Which device a process group's collectives serve, read from the group's own backend configuration.

A process group can hold one backend per device type: ``init_process_group("nccl")`` serves CUDA only
("cuda:nccl"), ``"gloo"`` serves CPU and CUDA tensors through the host ("cpu:gloo,cuda:gloo"), and
``init_process_group()`` with no backend (torch names it "undefined") or ``"cpu:gloo,cuda:nccl"`` serves
CPU with gloo and CUDA with NCCL. The backend *name* says nothing reliable about the device, so every
question goes to ``torch.distributed.get_backend_config``, the public spelling of that table. Holds no
tensor memory.

[Note: collective device]
The device of hfzero's scratch tensors (metadata all-reduces, agreement checks) and of its device
meshes is the accelerator when the group serves it with a device backend (NCCL, XCCL, ...): that is
where the model lives and where those collectives are fast. A group that serves the accelerator only
through gloo (which stages device tensors through the host) keeps its scratch on the CPU, as it always
has. Used by comm.py (``_default_device``), parallel/mesh.py and the placement check in
runtime/placement.py, so the three can never disagree on which device a group serves.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

HOST_BACKENDS = frozenset({"gloo"})
"""Backends that serve device tensors by copying them through host memory (never the scratch device)."""


def backend_map(group: dist.ProcessGroup | None = None) -> dict[str, str]:
    """``{device type: backend}`` for ``group`` (default: the world group), e.g. {"cpu": "gloo", "cuda":
    "nccl"}; empty when torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return {}
    return parse_backend_config(str(dist.get_backend_config(group)))


def parse_backend_config(config: str) -> dict[str, str]:
    """``"cpu:gloo,cuda:nccl"`` -> {"cpu": "gloo", "cuda": "nccl"}; a bare backend name maps to itself
    under "cpu" for gloo and under "cuda" otherwise (older torch spells a one-backend group that way)."""
    out: dict[str, str] = {}
    for item in filter(None, (part.strip().lower() for part in config.split(","))):
        if ":" in item:
            device_type, backend = item.split(":", 1)
            out[device_type] = backend
        else:
            out["cpu" if item in HOST_BACKENDS else "cuda"] = item
    return out


def device_backend(backends: dict[str, str]) -> str | None:
    """The first device type (not "cpu") served by a device backend (not gloo); None if there is none."""
    for device_type, backend in backends.items():
        if device_type != "cpu" and backend not in HOST_BACKENDS:
            return device_type
    return None


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where ``group``'s scratch tensors live; see [Note: collective device]. The accelerator's current
    device (``torch.accelerator.current_device_index``, set from LOCAL_RANK by the launcher or the script)
    when the group serves it with a device backend, else the CPU."""
    device_type = device_backend(backend_map(group))
    if device_type is None:
        return torch.device("cpu")
    return torch.device(device_type, torch.accelerator.current_device_index())
