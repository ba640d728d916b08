"""Which device a process group's collectives serve, read from the group's own backend configuration.

A process group can hold one backend per device type: ``init_process_group("nccl")`` serves CUDA only
("cuda:nccl"), ``"gloo"`` serves CPU and CUDA tensors through the host ("cpu:gloo,cuda:gloo"), and
``init_process_group()`` with no backend (torch names it "undefined") or ``"cpu:gloo,cuda:nccl"`` serves
CPU with gloo and CUDA with NCCL. The backend *name* says nothing reliable about the device, so every
question goes to ``torch.distributed.get_backend_config``, the public spelling of that table. Holds no
tensor memory.

[Note: collective device]
The device of hfzero's scratch tensors (the step agreement's counts, stage 3's step check, the clip norm's
sum, fp16's overflow flag, unused-parameter flags, metadata all-gathers) and of its device meshes is the
accelerator when the group serves it with a device backend (NCCL, XCCL, ...): that is where the model
lives and where those collectives are fast. A group that serves the accelerator only through gloo keeps its
scratch on the CPU, even when the model is on the accelerator: ``prepare`` asks ``scratch_device`` (the model's
device against the group's backend table), ``Communicator`` without a device asks ``collective_device``.

Why the CPU under gloo, counted per optimizer step from the code paths (no GPU measured it): gloo reduces a
CUDA tensor through the host (ProcessGroupGloo's CUDA work): at the call it copies the tensor into pinned
host memory on a side stream ordered after the current stream; on gloo's worker thread it synchronizes that
stream (the worker waits for everything queued before the call), runs the host algorithm and copies the
result back; the caller's ``wait()`` blocks until the worker is done, then orders the current stream after
the copy back. A CPU tensor is reduced in place, with no copy and no stream. Per step of stages 0-2 at world
> 1 with a clipping Trainer (D2H / H2D: device-to-host / host-to-device copies; a wait: the host blocked
until the device has caught up, on the caller's thread or on gloo's worker, which the caller waits for):

- scratch on the GPU: the agreement costs gloo's D2H + H2D and worker wait, then the read's D2H and wait;
  the clip norm gloo's D2H + H2D and worker wait (its coefficient stays on the GPU). 3 D2H, 2 H2D, 3 waits.
- scratch on the CPU: the agreement costs nothing (the counts are host data, reduced and read on the host);
  the clip norm one D2H and wait of the local sum, and its coefficient scales the gradients as a 0-dim CPU
  tensor (a kernel argument, no copy). 1 D2H, 0 H2D, 1 wait.

fp16's overflow flag adds one gloo round trip on the GPU (D2H + H2D + a worker wait) against one D2H and
wait on the CPU; unused-parameter flags (Python data) cost an H2D, a round trip and a read on the GPU and
nothing on the CPU; with the optimizer offloaded the gradients are on the host already and CPU scratch
moves nothing at all. So CPU scratch is never worse under gloo. Gradient buckets are not scratch: they
stay on the model's device and gloo moves them as above whatever this choice. Without a process group (one
process, nothing communicated) the scratch stays on the model's device, where the values it holds (the
clip norm) are computed. Used by comm/collectives.py (``_default_device``), runtime/prepare.py
(``scratch_device``), parallel/mesh.py and the placement check in runtime/placement.py, so they can never
disagree on which device a group serves.

[Note: device index]
``torch.device("cuda")`` names no device: tensors created with it land on the current device, but
``torch.cuda.set_device`` refuses it (ValueError), and a stream, event or current-stream query taken with it
belongs to whichever device is current on the calling thread, which on a helper thread (offload's fold
thread) is device 0 whatever the rank's device. So every device hfzero keeps for later (the engine's, the
offload's and its side stream's, the communicator's and its timer's, the profiler's) is resolved once by
``with_index`` to the device that was current when it was given, on the thread that gave it.
"""

from __future__ import annotations

from collections.abc import Callable

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


def current_index(device_type: str) -> int | None:
    """The calling thread's current device index of ``device_type``: the accelerator's (``torch.accelerator``),
    else that type's own module's (e.g. ``torch.xpu.current_device``); None where torch has no such notion."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is not None and accelerator.type == device_type:
        return torch.accelerator.current_device_index()
    current = getattr(getattr(torch, device_type, None), "current_device", None)
    return int(current()) if callable(current) else None


def with_index(device: torch.device | str, current: Callable[[str], int | None] = current_index) -> torch.device:
    """``device`` with its index: an index-less accelerator device ("cuda") becomes the current device of its
    type (``current``, asked of the calling thread); CPU and meta devices, indexed ones and types without a
    current device stay as they are. See [Note: device index]."""
    device = torch.device(device)
    if device.index is not None or device.type in ("cpu", "meta"):
        return device
    index = current(device.type)
    return device if index is None else torch.device(device.type, index)


def scratch_device(device: torch.device, backends: dict[str, str]) -> torch.device:
    """Where the scratch tensors of a group with backend table ``backends`` live for a model on ``device``:
    ``device`` when the group serves its type with a device backend (NCCL) or when there is no group (empty
    table: nothing is communicated), else the CPU (gloo, which stages device tensors through the host). See
    [Note: collective device]."""
    if device.type == "cpu" or not backends:
        return device
    backend = backends.get(device.type)
    return device if backend is not None and backend not in HOST_BACKENDS else torch.device("cpu")
