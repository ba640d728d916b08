"""The process groups one engine runs over, handed to it by the layer that builds meshes.

The engine takes groups and policies and never builds a mesh: ``hfzero.prepare`` (parallel/data_parallel.py) and
the wrappers (tensor, expert, sequence parallelism, pipelines) resolve which ranks ZeRO shards over and pass them
here; ``runtime.prepare.prepare_engine`` turns them into communicators on the model's device.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class EngineGroups:
    """Where an engine's collectives run.

    Attributes:
        shard: the group model states are sharded over (None: the world). With ``expert`` set it is the world
            (the dense parameters') and ``expert`` is the experts' (See [Note: bucket partitions] in layout.py).
        replicate: HSDP: this rank's replicas of its shard group, one rank per shard group (None: flat ZeRO);
            see [Note: hierarchical sharding] in engine.py.
        expert: expert parallelism: the expert-data-parallel group the expert parameters are sharded over.
        tensor: tensor parallelism: the tp group; the gradient norm also sums over it.
        average_over: how many data-parallel ranks' gradient sums the step averages (None: the shard group's
            size, the world's with ``expert``); see [Note: average_over] in engine.py.
    """

    shard: dist.ProcessGroup | None = None
    replicate: dist.ProcessGroup | None = None
    expert: dist.ProcessGroup | None = None
    tensor: dist.ProcessGroup | None = None
    average_over: int | None = None
