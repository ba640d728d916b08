"""Quantized collectives (ZeRO++ qwZ / qgZ): a block-quantized parameter all-gather and a hierarchical quantized
gradient reduce-scatter, both over a data-parallel ``Communicator`` and counted in its statistics.

[Note: quantized collectives]
qwZ (``ZeroConfig.quantize_weights="int8"``): each rank packs its own shard (``hfzero.quantize``, one fp32 scale
per ``quantize_block`` elements), the packed rows are all-gathered as uint8 (one collective, counted as an
"all_gather" of the packed bytes), and every other rank's row is decoded into the compute-dtype output; the
rank's own chunk keeps its exact value (the output may alias it). Used for stage 3's unit and persistent gathers
and the post-step all-gather at stages 1-2. hpZ's secondary-partition gathers (backward, inside the node) stay
unquantized: they copy the forward's gathered (already decoded) values, and they cross no node.

qgZ (``ZeroConfig.quantize_gradients="int8"|"int4"``) replaces the gradient reduce-scatter by two all-to-all hops
over the group's nodes (L ranks of the group per node, N nodes): chunk g of the input belongs to group rank g.
1. intra-node: to local peer j this rank sends, packed, the N chunks owned by the ranks of local index j on every
   node; it receives L such rows, decodes them and sums them in fp32: (N, c), the node's sums for those ranks;
2. inter-node, over the N ranks of local index j (one per node): row m goes to node m; the N rows received are
   decoded and summed in fp32 into this rank's chunk of the total.
A hop over one rank is skipped (a group inside one node has no inter hop). Both hops are counted as "all_to_all"
(the packed input, own row included, as a reduce-scatter counts its whole input), the first inside the node,
the second across it. Each value is quantized twice (once per hop), so the error is bounded per hop by [Note:
block quantization]; no error feedback is kept (not built). Nodes must cut the group into equal parts.

Every collective here runs at the point where its unquantized counterpart would, on every rank, in the same
order. The reduction runs synchronously when launched (no overlap with backward on any backend); a gather's
decode runs when it is waited on. On NCCL the intra- and inter-node groups are communicators of their own (as
hpZ's node group): see [Note: one communicator per data-parallel group] for the hazard of two in flight at once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hfzero import topology
from hfzero.comm import Communicator
from hfzero.config import ConfigError
from hfzero.quantize import BITS, dequantize_rows, packed_row_bytes, quantize_rows


class _Decoded:
    """A gather in flight whose decode runs once, after the collective, when it is waited on."""

    def __init__(self, handle: Any, then: Any):
        self._handle = handle
        self._then = then

    def wait(self) -> None:
        if self._then is None:
            return
        self._handle.wait()
        then, self._then = self._then, None
        then()


class _Done:
    def wait(self) -> None:
        return None


class QuantizedGather:
    """``all_gather`` with ``Communicator.all_gather``'s signature, moving block-quantized shards (qwZ)."""

    def __init__(self, comm: Communicator, name: str, block: int):
        self.comm = comm
        self.bits = BITS[name]
        self.block = block
        self.world_size = comm.world_size
        self.rank = comm.rank

    def packed_bytes(self, chunk: int) -> int:
        """Bytes one gather of ``chunk`` elements per rank moves (what the communicator counts)."""
        return self.comm.world_size * packed_row_bytes(chunk, self.bits, self.block)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Any:
        world, rank = self.comm.world_size, self.comm.rank
        if world == 1:
            return self.comm.all_gather(output, input, async_op=async_op)
        chunk = input.numel()
        if output.numel() != chunk * world:
            raise ValueError(f"all_gather: output has {output.numel()} elements, expected {chunk} x {world}")
        mine = quantize_rows(input.view(1, chunk), self.bits, self.block)  # (1, R) uint8
        packed = torch.empty(world, mine.shape[1], dtype=torch.uint8, device=input.device)
        handle = self.comm.all_gather(packed, mine.view(-1), async_op=True)
        rows = output.view(world, chunk)

        def decode() -> None:
            if rank > 0:
                dequantize_rows(packed[:rank], chunk, self.bits, self.block, rows[:rank])
            if rank + 1 < world:
                dequantize_rows(packed[rank + 1:], chunk, self.bits, self.block, rows[rank + 1:])
            if rows[rank].data_ptr() != input.data_ptr():
                rows[rank].copy_(input)  # the owner's chunk stays exact

        result = _Decoded(handle, decode)
        if not async_op:
            result.wait()
        return result


class QuantizedReduceScatter:
    """``reduce_scatter`` with ``Communicator.reduce_scatter``'s signature, as qgZ's two quantized all-to-all hops.
    See [Note: quantized collectives]. Holds the node groups' communicators, no tensor memory."""

    def __init__(self, comm: Communicator, name: str, block: int, intra: Communicator | None,
                 inter: Communicator | None, order: list[int]):
        self.comm = comm
        self.bits = BITS[name]
        self.block = block
        self.intra = intra
        """This rank's node part of the group (None: one rank per node)."""
        self.inter = inter
        """The group's ranks of this rank's local index, one per node (None: the group lies inside one node)."""
        self.order = order
        """Group ranks ordered (local index, node): the intra hop sends rows [j N, (j + 1) N) to local peer j."""
        self.world_size = comm.world_size
        self.rank = comm.rank
        self._order_index: torch.Tensor | None = None
        self._reordered = order != list(range(len(order)))
        """Whether rows must be reordered before the intra hop (not when one node or one rank per node)."""

    def hop_sizes(self) -> tuple[int, int]:
        """(L, N): ranks of the group per node and nodes spanned."""
        return (self.intra.world_size if self.intra else 1), (self.inter.world_size if self.inter else 1)

    def packed_bytes(self, chunk: int) -> tuple[int, int]:
        """(intra-hop, inter-hop) bytes one reduction of ``chunk`` elements per rank moves (what is counted)."""
        per_node, nodes = self.hop_sizes()
        intra = per_node * packed_row_bytes(nodes * chunk, self.bits, self.block) if per_node > 1 else 0
        inter = nodes * packed_row_bytes(chunk, self.bits, self.block) if nodes > 1 else 0
        return intra, inter

    def _hop(self, comm: Communicator, rows: torch.Tensor) -> torch.Tensor:
        """One quantized all-to-all of ``rows`` (peers, n): row p goes to peer p; returns the fp32 sum (n,) of
        the decoded rows received."""
        peers, n = rows.shape
        packed = quantize_rows(rows, self.bits, self.block)
        received = torch.empty_like(packed)
        comm.all_to_all(received, packed)
        decoded = torch.empty(peers, n, dtype=torch.float32, device=rows.device)
        return dequantize_rows(received, n, self.bits, self.block, decoded).sum(dim=0)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Any:
        world = self.comm.world_size
        if world == 1:
            return self.comm.reduce_scatter(output, input, async_op=async_op)
        chunk = output.numel()
        if input.numel() != chunk * world:
            raise ValueError(f"reduce_scatter: input has {input.numel()} elements, expected {chunk} x {world}")
        per_node, nodes = self.hop_sizes()
        rows = input.view(world, chunk)  # (L N, c)
        if self._reordered:  # ordered (local index, node): one copy of the bucket
            if self._order_index is None:
                self._order_index = torch.tensor(self.order, dtype=torch.long, device=input.device)
            rows = rows.index_select(0, self._order_index)
        if per_node > 1:
            part = self._hop(self.intra, rows.view(per_node, nodes * chunk)).view(nodes, chunk)  # (N, c) fp32
        else:
            part = rows.to(torch.float32)
        total = self._hop(self.inter, part) if nodes > 1 else part.view(chunk)
        output.copy_(total)
        return _Done()


def check_quantized_group(ranks: list[int], ranks_per_node: int) -> tuple[int, int]:
    """(L, N) for the group of global ``ranks``: ranks per node inside it and nodes spanned; a ConfigError when
    nodes do not cut it into equal parts."""
    nodes: dict[int, list[int]] = {}
    for g in ranks:
        nodes.setdefault(topology.node_of(g, ranks_per_node), []).append(g)
    sizes = {len(members) for members in nodes.values()}
    if len(sizes) != 1:
        raise ConfigError(f"hfzero.prepare: quantize_gradients needs the same number of the group's ranks on every "
                          f"node; the group {list(ranks)} has {sorted(sizes)} on its nodes (set "
                          f"--zero_ranks_per_node to match the launch, or drop quantize_gradients)")
    return sizes.pop(), len(nodes)


def build_quantized_reduce(comm: Communicator, name: str, block: int, groups: list[list[int]]) -> QuantizedReduceScatter:
    """qgZ over ``comm``: the intra- and inter-node groups of every data-parallel group in ``groups`` (lists of
    global ranks, the same list on every rank) are created in the same order on every rank (``new_group`` is a
    collective of the world); this rank keeps its own two, counting into ``comm``'s statistics."""
    per_node = comm.ranks_per_node
    for ranks in groups:  # every group, before any is created: every rank raises or none does
        check_quantized_group(ranks, per_node)
    intra_mine = inter_mine = None
    order: list[int] = []
    me = dist.get_rank() if dist.is_initialized() else 0
    for ranks in groups:
        by_node: dict[int, list[int]] = {}
        for g in sorted(ranks):
            by_node.setdefault(topology.node_of(g, per_node), []).append(g)
        members = [by_node[n] for n in sorted(by_node)]  # members[node][local index]
        local, count = len(members[0]), len(members)
        intra_groups = members if local > 1 else []
        inter_groups = [[members[n][j] for n in range(count)] for j in range(local)] if count > 1 else []
        for group_ranks in intra_groups:
            group = dist.new_group(group_ranks)
            if me in group_ranks:
                intra_mine = comm.on_group(group)
        for group_ranks in inter_groups:
            group = dist.new_group(group_ranks)
            if me in group_ranks:
                inter_mine = comm.on_group(group)
        if me in ranks:
            position = {g: i for i, g in enumerate(comm.global_ranks)}
            order = [position[members[n][j]] for j in range(local) for n in range(count)]
    return QuantizedReduceScatter(comm, name, block, intra_mine, inter_mine, order)
