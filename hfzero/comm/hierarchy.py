"""The node parts of data-parallel groups: hpZ's node communicator and the groups qgZ's two hops run over.

Both need every rank's data-parallel group (``world_groups``: one small all-gather of the world, learned once
per ``prepare``), and both create groups with ``new_group``, a collective of the world: every rank creates every
group, in the same order, whichever group it belongs to. Nodes hold consecutive global ranks
(``topology.node_of``).
"""

from __future__ import annotations

import json

import torch.distributed as dist

from hfzero.comm.collectives import Communicator
from hfzero.config import ConfigError
from hfzero.logging import get_logger

logger = get_logger(__name__)


def world_groups(comm: Communicator) -> list[tuple[int, ...]]:
    """Every rank's group of ``comm``'s kind (global ranks), each once, ordered by their first rank: gathered
    from every rank of the world (one small collective, which every rank reaches here)."""
    world = comm.on_group(dist.group.WORLD, share_stats=False)
    everyone = world.all_gather_bytes(json.dumps(comm.global_ranks).encode())
    return sorted({tuple(json.loads(payload)) for payload in everyone})


def node_comm(comm: Communicator, groups: list[tuple[int, ...]]) -> Communicator | None:
    """hpZ: a communicator over the ranks of ``comm``'s group on this rank's node (sharing its statistics), or None
    when no group crosses a node or each node holds one rank of it (nothing would change). Every rank learns every
    rank's group (``world_groups``) and creates every node part of every group, in the same order (a collective of
    the world), so any group layout works: the world, HSDP shard groups, a pipeline's stages, a tensor-parallel
    dp or shard group (ranks tp apart), provided each node holds the same number k of each group's ranks, k
    dividing the group's size (the slices are ``full.view(k, -1)``). Decided from world-wide facts, so every rank
    takes the same branch. ``groups``: every rank's group, from ``world_groups``."""
    per_node = comm.ranks_per_node
    parts = [[r for r in group if r // per_node == node] for group in groups
             for node in sorted({r // per_node for r in group})]
    sizes, counts = {len(group) for group in groups}, {len(part) for part in parts}
    if len(parts) == len(groups):
        logger.info("secondary_partition: each data-parallel group lies inside one node; nothing to do")
        return None
    if len(sizes) > 1 or len(counts) > 1 or next(iter(sizes)) % next(iter(counts)):
        raise ConfigError(f"hfzero.prepare: secondary_partition (hpZ) needs every node to hold the same number of each "
                          f"data-parallel group's ranks, dividing the group's size; with {per_node} ranks per node the "
                          f"groups of {sorted(sizes)} rank(s) are cut into parts of {sorted(counts)}: pick ranks per "
                          "node (or shard_size) so that nodes cut the groups evenly")
    if counts == {1}:
        logger.info("secondary_partition: each node holds one rank of each data-parallel group; nothing to keep local")
        return None
    mine = None
    for part in parts:
        group = dist.new_group(part)
        if dist.get_rank() in part:
            mine = comm.on_group(group)
    return mine
