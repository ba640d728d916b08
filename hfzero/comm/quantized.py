"""Quantized collectives (ZeRO++ qwZ / qgZ): a block-quantized parameter all-gather and a hierarchical quantized
gradient reduce-scatter, both over a data-parallel ``Communicator`` and counted in its statistics.

[Note: quantized collectives]
qwZ (``ZeroConfig.quantize_weights="int8"``): each rank packs its own shard (``hfzero.comm.codec``, one fp32 scale
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
block quantization]. Nodes must cut the group into equal parts. Error feedback (``quantize_error_feedback``): per
bucket and hop, the sender keeps the residual of what it packed (its fp32 input plus the last residual, minus the
decoded codes; non-finite residuals zeroed, so an fp16 overflow is not carried into the next step) and adds it to the
next reduction of that bucket before packing: the error of one reduction is paid back by the next instead of
accumulating. Residuals are model states (QUANT_RESIDUAL): fp32, the whole bucket for the intra hop (L > 1) plus
1/L of it for the inter hop (N > 1), per rank, kept across steps; checkpoints keep them with the rank's shard and
restore them only into the same layout (hfzero/checkpoint/residuals.py).

[Note: quantized buffers]
The packed, received and decoded buffers are kept across calls (ZeRO-R's constant buffers), not allocated per
bucket per call: the reduction runs synchronously, so one buffer per purpose (grown to the largest bucket, never
shrunk) serves every bucket and both hops; a gather's send and receive buffers live until its decode, and several
gathers may be in flight (stage 3's prefetch), so they come from a free list whose size is the most in flight at
once. Both count as COMM_BUFFER (transient: their size follows the bucket and unit sizes, not the model's).

Every collective here runs at the point where its unquantized counterpart would, on every rank, in the same
order. The reduction runs synchronously when launched (no overlap with backward on any backend); a gather's
decode runs when it is waited on. On NCCL the intra- and inter-node groups are communicators of their own (as
hpZ's node group): see [Note: one communicator per data-parallel group] for the hazard of two in flight at once.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from hfzero.comm import topology
from hfzero.comm.collectives import Communicator
from hfzero.config import ConfigError
from hfzero.comm.codec import BITS, decode_rows, dequantize_rows, num_blocks, packed_row_bytes, quantize_rows


class _Arena:
    """Buffers kept across calls, one per purpose, grown to the largest request and never shrunk; ``take`` hands out a
    view, so a purpose must not be in use twice at once (See [Note: quantized buffers])."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.allocations = 0

    def take(self, purpose: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        buffer = self._buffers.get(purpose)
        if buffer is None or buffer.numel() < size:
            self._buffers[purpose] = buffer = torch.empty(size, dtype=torch.uint8, device=device)
            self.allocations += 1
        return buffer[:size].view(dtype).view(shape)

    def nbytes(self) -> int:
        return sum(b.numel() for b in self._buffers.values())


class _FreeList:
    """Byte buffers for collectives still in flight when the call returns (qwZ's gathers): ``take`` gives the
    smallest free one that fits (else frees the smallest free one and allocates), ``give`` takes it back; so the list
    never holds more buffers than were in flight at once (See [Note: quantized buffers])."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self._lent = 0
        self.allocations = 0

    def take(self, size: int, device: torch.device) -> torch.Tensor:
        fitting = [b for b in self._free if b.numel() >= size]
        if fitting:
            buffer = min(fitting, key=torch.Tensor.numel)
            self._free = [b for b in self._free if b is not buffer]
        else:
            if self._free:  # by identity: list.remove would compare tensors with ==
                smallest = min(self._free, key=torch.Tensor.numel)
                self._free = [b for b in self._free if b is not smallest]
            buffer = torch.empty(size, dtype=torch.uint8, device=device)
            self.allocations += 1
        self._lent += buffer.numel()
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        self._lent -= buffer.numel()
        self._free.append(buffer)

    def nbytes(self) -> int:
        """Bytes held: free buffers and those lent to gathers in flight."""
        return sum(b.numel() for b in self._free) + self._lent


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
    """``all_gather`` with ``Communicator.all_gather``'s signature, moving block-quantized shards (qwZ). Keeps its
    buffers across calls ([Note: quantized buffers]): ``buffer_bytes`` of them (COMM_BUFFER)."""

    def __init__(self, comm: Communicator, name: str, block: int):
        self.comm = comm
        self.bits = BITS[name]
        self.block = block
        self.world_size = comm.world_size
        self.rank = comm.rank
        self._lent = _FreeList()
        self._scratch = _Arena()

    def packed_bytes(self, chunk: int) -> int:
        """Bytes one gather of ``chunk`` elements per rank moves (what the communicator counts)."""
        return self.comm.world_size * packed_row_bytes(chunk, self.bits, self.block)

    def buffer_bytes(self) -> int:
        """Bytes of the buffers kept across calls (COMM_BUFFER)."""
        return self._lent.nbytes() + self._scratch.nbytes()

    def allocations(self) -> int:
        """Buffers allocated since construction (a steady state allocates none)."""
        return self._lent.allocations + self._scratch.allocations

    def _work(self, rows: int, chunk: int, device: torch.device) -> torch.Tensor:
        """The fp32 work buffer of the codec for ``rows`` rows of ``chunk`` values."""
        return self._scratch.take("scratch", (rows, num_blocks(chunk, self.block) * self.block), torch.float32, device)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Any:
        world, rank = self.comm.world_size, self.comm.rank
        if world == 1:
            return self.comm.all_gather(output, input, async_op=async_op)
        chunk = input.numel()
        if output.numel() != chunk * world:
            raise ValueError(f"all_gather: output has {output.numel()} elements, expected {chunk} x {world}")
        row = packed_row_bytes(chunk, self.bits, self.block)
        send = self._lent.take(row, input.device)
        received = self._lent.take(world * row, input.device)
        mine = quantize_rows(input.view(1, chunk), self.bits, self.block, out=send[:row].view(1, row),
                             scratch=self._work(1, chunk, input.device))
        packed = received[:world * row].view(world, row)
        handle = self.comm.all_gather(packed, mine.view(-1), async_op=True)
        rows = output.view(world, chunk)

        def decode() -> None:
            if rank > 0:
                dequantize_rows(packed[:rank], chunk, self.bits, self.block, rows[:rank],
                                scratch=self._work(rank, chunk, input.device))
            if rank + 1 < world:
                dequantize_rows(packed[rank + 1:], chunk, self.bits, self.block, rows[rank + 1:],
                                scratch=self._work(world - rank - 1, chunk, input.device))
            if rows[rank].data_ptr() != input.data_ptr():
                rows[rank].copy_(input)  # the owner's chunk stays exact
            self._lent.give(send)
            self._lent.give(received)

        result = _Decoded(handle, decode)
        if not async_op:
            result.wait()
        return result


class QuantizedReduceScatter:
    """``reduce_scatter`` with ``Communicator.reduce_scatter``'s signature, as qgZ's two quantized all-to-all hops.
    See [Note: quantized collectives]. Holds the node groups' communicators, its buffers kept across calls
    ([Note: quantized buffers]; ``buffer_bytes``, COMM_BUFFER) and, with ``error_feedback``, each bucket's residuals
    (``residual_bytes``, QUANT_RESIDUAL: a model state)."""

    def __init__(self, comm: Communicator, name: str, block: int, intra: Communicator | None,
                 inter: Communicator | None, order: list[int], error_feedback: bool = False):
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
        self.error_feedback = error_feedback
        self._order_index: torch.Tensor | None = None
        self._reordered = order != list(range(len(order)))
        """Whether rows must be reordered before the intra hop (not when one node or one rank per node)."""
        self._buffers = _Arena()
        self._residuals: dict[tuple[Any, str], torch.Tensor] = {}
        """(bucket key, hop) -> the fp32 residual of what this rank last packed for it (error feedback)."""

    def hop_sizes(self) -> tuple[int, int]:
        """(L, N): ranks of the group per node and nodes spanned."""
        return (self.intra.world_size if self.intra else 1), (self.inter.world_size if self.inter else 1)

    def packed_bytes(self, chunk: int) -> tuple[int, int]:
        """(intra-hop, inter-hop) bytes one reduction of ``chunk`` elements per rank moves (what is counted)."""
        per_node, nodes = self.hop_sizes()
        intra = per_node * packed_row_bytes(nodes * chunk, self.bits, self.block) if per_node > 1 else 0
        inter = nodes * packed_row_bytes(chunk, self.bits, self.block) if nodes > 1 else 0
        return intra, inter

    def buffer_bytes(self) -> int:
        """Bytes of the buffers kept across calls (COMM_BUFFER)."""
        return self._buffers.nbytes()

    def allocations(self) -> int:
        """Buffers allocated since construction (a steady state allocates none)."""
        return self._buffers.allocations

    def residual_bytes(self) -> int:
        """Bytes of the error-feedback residuals held (QUANT_RESIDUAL, a model state)."""
        return sum(r.numel() * r.element_size() for r in self._residuals.values())

    def residual_state(self) -> dict[str, torch.Tensor]:
        """The error-feedback residuals held, as ``"<bucket key>/<hop>"`` -> the live fp32 tensor (not a copy), for
        checkpoints (hfzero/checkpoint/residuals.py). Empty without error feedback or before the first reduction."""
        return {f"{key}/{hop}": residual for (key, hop), residual in sorted(self._residuals.items())}

    def load_residual_state(self, state: dict[str, torch.Tensor], device: torch.device) -> None:
        """Replace the residuals by ``state`` (``residual_state``'s form, integer bucket keys), copied to ``device``;
        empty: drop them all, so the next reductions start from zero residuals."""
        loaded = {}
        for name, tensor in state.items():
            key, hop = name.split("/")
            loaded[int(key), hop] = tensor.to(device=device, dtype=torch.float32, copy=True)
        self._residuals = loaded

    def _residual(self, key: Any, hop: str, shape: tuple[int, int], device: torch.device) -> torch.Tensor | None:
        if not self.error_feedback or key is None:
            return None
        residual = self._residuals.get((key, hop))
        if residual is None:
            residual = self._residuals[key, hop] = torch.zeros(shape, dtype=torch.float32, device=device)
        return residual

    def _hop(self, comm: Communicator, rows: torch.Tensor, residual: torch.Tensor | None, out: str) -> torch.Tensor:
        """One quantized all-to-all of ``rows`` (peers, n): row p goes to peer p; returns the fp32 sum (n,) of
        the decoded rows received, in the kept buffer ``out``. With ``residual`` (peers, n), error feedback: the
        residual is added before packing and replaced by the new one."""
        peers, n = rows.shape
        device = rows.device
        size = packed_row_bytes(n, self.bits, self.block)
        packed = self._buffers.take("packed", (peers, size), torch.uint8, device)
        work = self._buffers.take("work", (peers, num_blocks(n, self.block) * self.block), torch.float32, device)
        if residual is None:
            quantize_rows(rows, self.bits, self.block, out=packed, scratch=work)
        else:  # See [Note: quantized collectives]: what is sent plus the last residual, minus what it decodes to
            residual.add_(rows)
            quantize_rows(residual, self.bits, self.block, out=packed, scratch=work)
            residual.sub_(decode_rows(packed, n, self.bits, self.block, work))
            residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        received = self._buffers.take("received", (peers, size), torch.uint8, device)
        comm.all_to_all(received, packed)
        total = self._buffers.take(out, (n,), torch.float32, device)
        return torch.sum(decode_rows(received, n, self.bits, self.block, work), dim=0, out=total)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False,
                       key: Any = None) -> Any:
        """``key``: what identifies the bucket across calls (its index), for error feedback's residuals; None: no
        error feedback for this call."""
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
            rows = torch.index_select(rows, 0, self._order_index,
                                      out=self._buffers.take("ordered", (world, chunk), input.dtype, input.device))
        if per_node > 1:
            shape = (per_node, nodes * chunk)
            part = self._hop(self.intra, rows.view(shape), self._residual(key, "intra", shape, input.device),
                             "part").view(nodes, chunk)  # (N, c) fp32
        else:
            part = self._buffers.take("part", (nodes, chunk), torch.float32, input.device).copy_(rows)
        if nodes > 1:
            total = self._hop(self.inter, part, self._residual(key, "inter", (nodes, chunk), input.device), "total")
        else:
            total = part.view(chunk)
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


def build_quantized_reduce(comm: Communicator, name: str, block: int, groups: list[list[int]],
                           error_feedback: bool = False) -> QuantizedReduceScatter:
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
    return QuantizedReduceScatter(comm, name, block, intra_mine, inter_mine, order, error_feedback)
