"""Nodes: how many ranks share one, and which of a group's ring hops cross from one node to the next.

Ranks are assigned to nodes in blocks, as torchrun does: global rank r is on node r // ranks_per_node.
Pure Python over rank numbers (no tensors, no collectives), so the estimator can use it too.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from hfzero.config import ConfigError

LOCAL_WORLD_SIZE_ENV = "LOCAL_WORLD_SIZE"
"""Set by torchrun (and ``hfzero run``) on every rank: the ranks of this rank's node."""


def ranks_per_node(configured: int, world_size: int) -> int:
    """Ranks per node: ``configured`` (``ZeroConfig.ranks_per_node``) when set, else LOCAL_WORLD_SIZE from the
    environment, else ``world_size`` (one node). A clear ConfigError when it does not divide the world."""
    source = "ZeroConfig.ranks_per_node (--zero_ranks_per_node)"
    value = configured
    if not value:
        raw = os.environ.get(LOCAL_WORLD_SIZE_ENV)
        if not raw:
            return max(world_size, 1)
        source = f"{LOCAL_WORLD_SIZE_ENV}={raw} (from the launcher)"
        try:
            value = int(raw)
        except ValueError:
            raise ConfigError(f"hfzero: {source} is not an integer; launch with torchrun or `hfzero run`, or set "
                              "--zero_ranks_per_node") from None
    if value < 1 or world_size % value:
        raise ConfigError(f"hfzero: {source} gives {value} ranks per node, which does not divide the world size "
                          f"{world_size}; every node must run the same number of ranks (set --zero_ranks_per_node "
                          f"to a divisor of {world_size})")
    return value


def node_of(global_rank: int, per_node: int) -> int:
    """The node holding ``global_rank`` (ranks are placed on nodes in blocks of ``per_node``)."""
    return global_rank // per_node


def ring_crossings(global_ranks: Sequence[int], per_node: int) -> int:
    """Hops of the ring through ``global_ranks`` (in group-rank order, the last back to the first) that join two
    ranks on different nodes: 0 for a group inside one node, ``len(global_ranks)`` for one rank per node.
    See [Note: node traffic] in hfzero/comm/collectives.py."""
    p = len(global_ranks)
    if p < 2:
        return 0
    nodes = [node_of(r, per_node) for r in global_ranks]
    return sum(nodes[i] != nodes[(i + 1) % p] for i in range(p))


def nodes_spanned(global_ranks: Sequence[int], per_node: int) -> int:
    """How many nodes ``global_ranks`` touch."""
    return len({node_of(r, per_node) for r in global_ranks})
