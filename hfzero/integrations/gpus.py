"""One rank per accelerator device, checked before anything starts.

transformers and accelerate put local rank r on device r (``cuda:LOCAL_RANK``). With fewer visible devices
than ranks on a host, the extra ranks either fail to set their device ("invalid device ordinal") or share
one, which NCCL refuses at the first collective ("Duplicate GPU detected"), both after every rank has
loaded the model. ``hfzero run`` (from ``--nproc_per_node``), ZeroTrainingArguments and ZeroAccelerator
(from LOCAL_WORLD_SIZE) refuse such a launch up front with what to do instead. A CPU run (``--use_cpu``,
``ACCELERATE_USE_CPU=true``, or no accelerator at all) needs no device. Holds no memory.

``job_placement`` decides where a data-parallel job that needs at least two ranks runs on this host: one rank
per visible GPU when there are two or more, else a fixed number of CPU ranks (``examples/main_job.sh`` asks
it through ``python -m hfzero.integrations.gpus``, which prints ``NPROC cpu|gpu SENTENCE``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence

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


@dataclasses.dataclass(frozen=True)
class JobPlacement:
    """Where a data-parallel job's ranks run on this host.

    Attributes:
        nproc: processes to start (``--nproc_per_node``).
        cpu: CPU ranks over gloo (pass ``--use_cpu true``), else one GPU per rank over NCCL.
        sentence: which, and why, for the job to print.
    """

    nproc: int
    cpu: bool
    sentence: str


def job_placement(devices: int, *, cpu_ranks: int = 2, kind: str = "cuda", cpu: bool = False) -> JobPlacement:
    """One rank per visible ``kind`` device when ``devices`` >= 2 (NCCL), else ``cpu_ranks`` CPU ranks (gloo):
    one GPU cannot hold two ranks (see ``check_ranks_fit_devices``) and a data-parallel job of one rank shards
    nothing. ``cpu``: a CPU run was asked for (``ACCELERATE_USE_CPU``), whatever the devices."""
    if devices >= 2 and not cpu:
        return JobPlacement(devices, False, f"{devices} ranks, one per visible GPU ({kind}:0-{kind}:{devices - 1}), "
                                            f"NCCL")
    why = ("ACCELERATE_USE_CPU asks for a CPU run" if cpu else "no GPU is visible" if devices == 0
           else "1 GPU is visible and two ranks cannot share it")
    return JobPlacement(cpu_ranks, True, f"{cpu_ranks} CPU ranks, gloo ({why})")


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m hfzero.integrations.gpus [--cpu-ranks N]``: print ``NPROC cpu|gpu SENTENCE`` for this host."""
    parser = argparse.ArgumentParser(prog="python -m hfzero.integrations.gpus", description=main.__doc__)
    parser.add_argument("--cpu-ranks", type=int, default=2, help="ranks when fewer than two GPUs are visible")
    args = parser.parse_args(argv)
    if args.cpu_ranks < 1:
        parser.error("--cpu-ranks must be a positive number of processes")
    devices = accelerator_count()
    accelerator = torch.accelerator.current_accelerator() if devices else None  # None on a CPU-only torch build
    kind = accelerator.type if accelerator is not None else "cuda"
    where = job_placement(devices, cpu_ranks=args.cpu_ranks, kind=kind, cpu=cpu_requested())
    sys.stdout.write(f"{where.nproc} {'cpu' if where.cpu else 'gpu'} {where.sentence}\n")


if __name__ == "__main__":
    main()
