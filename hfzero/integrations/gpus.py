"""One rank per accelerator device, checked before anything starts.

transformers and accelerate put local rank r on device r (``cuda:LOCAL_RANK``). With fewer visible devices
than ranks on a host, the extra ranks either fail to set their device ("invalid device ordinal") or share
one, which NCCL refuses at the first collective ("Duplicate GPU detected"), both after every rank has
loaded the model. ``hfzero run`` (from ``--nproc_per_node``), ZeroTrainingArguments and ZeroAccelerator
(from LOCAL_WORLD_SIZE) refuse such a launch up front with what to do instead. A CPU run (``--use_cpu``,
``ACCELERATE_USE_CPU=true``, or no accelerator at all) needs no device. Holds no memory.
"""

from __future__ import annotations

import os

import torch

from hfzero.config import ConfigError


def accelerator_count() -> int:
    """Accelerator devices this process sees (0 without an accelerator); tests patch it to fake a host."""
    return torch.accelerator.device_count() if torch.accelerator.is_available() else 0


def cpu_requested(environ: dict[str, str] | os._Environ | None = None) -> bool:
    """``ACCELERATE_USE_CPU`` is true: the run is a CPU run whatever devices the host has."""
    value = (os.environ if environ is None else environ).get("ACCELERATE_USE_CPU", "")
    return value.strip().lower() in ("1", "true", "yes", "y", "on")


def check_ranks_fit_devices(local_ranks: int, *, what: str, cpu: bool = False, option: str = "--nproc_per_node") -> None:
    """ConfigError when ``local_ranks`` ranks on this host would share fewer accelerator devices."""
    devices = accelerator_count()
    if cpu or devices == 0 or local_ranks <= devices:
        return
    kind = torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else "accelerator"
    raise ConfigError(
        f"{what}: {local_ranks} ranks on this host ({option} {local_ranks}) but only {devices} {kind} device(s) "
        f"are visible; each rank needs its own device (two ranks on one GPU fail at the first NCCL collective). "
        f"Start at most {devices} rank(s) per host ({option} {devices}), make more devices visible "
        f"(CUDA_VISIBLE_DEVICES), or train on the CPU: hide the devices (CUDA_VISIBLE_DEVICES=\"\") or pass "
        f"--use_cpu true (ACCELERATE_USE_CPU=true)")


def local_world_size() -> int:
    """Ranks on this host as the launcher (torchrun, `hfzero run`) set them; 1 outside a launcher."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.strip().isdigit() else 1
