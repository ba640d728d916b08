"""``prepare``'s placement check: the model's device must be one the process group serves, and on an
accelerator the rank's current device, so a misplaced model is one clear error before any collective
instead of an NCCL "invalid device ordinal" / "Duplicate GPU detected" (or a hang) at the first one.

Holds no memory; reads the group's backend table (see [Note: collective device] in hfzero/devices.py),
the accelerator's current device index and the launcher's LOCAL_RANK / LOCAL_WORLD_SIZE.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

from hfzero.config import ConfigError
from hfzero.devices import HOST_BACKENDS, backend_map

_SET_DEVICE = ("call torch.accelerator.set_device_index(int(os.environ['LOCAL_RANK'])) (torch.cuda.set_device on "
               "CUDA) before init_process_group, then model.to(torch.accelerator.current_accelerator()); "
               "`hfzero run` with the Trainer or accelerate does both")


@dataclasses.dataclass(frozen=True)
class Placement:
    """What the check reads, gathered once (tests build one by hand to fake a host).

    Attributes:
        backends: the group's ``{device type: backend}`` table (empty: torch.distributed not initialized).
        current_index: the accelerator's current device index (None: no accelerator).
        local_rank: LOCAL_RANK from the launcher (None: not launched by torchrun).
        local_world: LOCAL_WORLD_SIZE from the launcher (None: unknown).
        device_count: accelerator devices this process sees.
    """

    backends: dict[str, str]
    current_index: int | None
    local_rank: int | None
    local_world: int | None
    device_count: int

    @classmethod
    def read(cls, group: dist.ProcessGroup | None) -> "Placement":
        accelerator = torch.accelerator.is_available()
        return cls(backends=backend_map(group),
                   current_index=torch.accelerator.current_device_index() if accelerator else None,
                   local_rank=_env_int("LOCAL_RANK"), local_world=_env_int("LOCAL_WORLD_SIZE"),
                   device_count=torch.accelerator.device_count() if accelerator else 0)


def placement_error(device: torch.device, where: Placement) -> str | None:
    """Why ``device`` (where the model's trainable parameters are) cannot train over the group, or None."""
    if not where.backends:
        return None  # a single process without torch.distributed: no collective, nothing to match
    served = ", ".join(f"{d}:{b}" for d, b in where.backends.items())
    if device.type not in where.backends:
        return (f"the model is on {device} but the process group serves {served}; move the model to a device "
                f"the group serves, or initialize the group with a backend for {device.type} (gloo for cpu, "
                f"nccl for cuda: init_process_group(\"{'gloo' if device.type == 'cpu' else 'nccl'}\"))")
    if device.type == "cpu" or where.current_index is None:
        return None
    index = device.index if device.index is not None else where.current_index
    if index != where.current_index:
        return (f"the model is on {device.type}:{index} but this rank's current device is "
                f"{device.type}:{where.current_index} (LOCAL_RANK={where.local_rank}); {_SET_DEVICE}")
    device_backend = where.backends[device.type] not in HOST_BACKENDS
    every_rank_sees_every_device = where.local_world is not None and where.device_count >= where.local_world
    if device_backend and every_rank_sees_every_device and where.local_rank is not None and index != where.local_rank:
        # each local rank sees all the host's devices, so rank r belongs on device r; two ranks on one
        # device is what NCCL refuses ("Duplicate GPU detected") at the first collective
        return (f"LOCAL_RANK={where.local_rank} is on {device.type}:{index}: with {where.device_count} visible "
                f"device(s) and {where.local_world} rank(s) on this host, each rank needs its own device; "
                f"{_SET_DEVICE}")
    return None


def check_placement(device: torch.device, group: dist.ProcessGroup | None) -> None:
    """Raise ConfigError when the model on ``device`` cannot train over ``group``; see placement_error."""
    error = placement_error(device, Placement.read(group))
    if error is not None:
        raise ConfigError(f"hfzero.prepare: {error}")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.strip().isdigit() else None
