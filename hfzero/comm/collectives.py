"""Collectives with byte accounting and profiler labels: the only place hfzero calls torch.distributed.

Every collective runs under ``torch.profiler.record_function("hfzero::<kind>")`` while torch's profiler
collects ([Note: collective labels]) and is counted in
``CommStats`` by kind. Volumes follow the paper's convention (logical elements per rank): an
all-reduce of n elements counts 2n (a reduce-scatter plus an all-gather), a reduce-scatter of an
n-element input counts n, an all-gather into an n-element output counts n. ``bytes`` is elements
times the element size. A group of one rank moves nothing and counts nothing. An implementation choice (e.g. a reduce-scatter carried out as an all-reduce
on gloo) does not change the logical count; ``CommStats.impl_calls`` records what actually ran.

[Note: node traffic]
Every counted byte is also split into ``intra_node_bytes`` and ``inter_node_bytes`` (they add up to
``bytes``), by one model: a collective over p ranks runs as a ring through the group's ranks in
group-rank order (the last back to the first), every hop carrying the same share of the traffic, so the
fraction of a collective's bytes that crosses nodes is c / p, c the ring hops joining ranks on different
nodes (``hfzero.comm.topology.ring_crossings``; nodes hold consecutive global ranks, ``ranks_per_node`` each).
Each rank is charged that same fraction of its logical bytes (an average over the ring: on a real ring
the rank whose outgoing hop crosses sends it all), rounded down per collective. So a group inside one
node moves 0 inter-node bytes, a group with one rank per node (an HSDP replicate group) moves all its
bytes between nodes, and a flat group of 4 ranks on 2 nodes (hops 0-1, 1-2, 2-3, 3-0: two cross) moves
half of its bytes between nodes. The model does not know NCCL's topology-aware rings and trees (which
cross each node boundary fewer times); it is the same for every configuration, so comparisons hold.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from hfzero.comm import gloo_exit, topology
from hfzero.devices import collective_device, with_index
from hfzero.logging import get_logger
from hfzero.comm.timing import DeviceTimer, Mark

logger = get_logger(__name__)

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# Measured on the machines we run on (see benchmarks/collectives.py): on gloo a 100 MB reduce_scatter
# took ~125 ms against ~70 ms for an all-reduce of the same input; NCCL's reduce-scatter moves half
# the bytes of an all-reduce. One table decides, so no call site carries a backend branch.
_REDUCE_SCATTER_VIA_ALL_REDUCE = {"gloo": True, "nccl": False}
# gloo's all_gather_into_tensor allocates a flat output of its own per call and copies out of it; those
# blocks, every bucket every step, made a stage-1/2 rank's peak RSS creep (issue 21: GPT-2 5.3M, world 2,
# 24 steps, growth 1.05-1.11 and peak 572-589 MB). gloo's broadcast works in place on the tensor it is
# given, so on gloo a gather is one broadcast per rank, each rooted at the owner of its chunk: no block
# is allocated, the bytes are an all-gather's, and it is the cheapest of the three in CPU time (2 gloo
# ranks, 4 / 32 MB output, CPU ms per call: broadcasts 0.75 / 7.4, an in-place all-reduce with zeros
# outside this rank's chunk 2.0 / 20, all_gather_into_tensor 2.3 / 39). NCCL gathers in place.
_ALL_GATHER_IMPL = {"gloo": "broadcast", "nccl": "all_gather"}


def _process_group_method(group: Any, name: str) -> Callable[[torch.Tensor, torch.Tensor], Any] | None:
    """``group.<name>`` (the ProcessGroup's own ``all_gather_single`` / ``reduce_scatter_single``, public methods
    of the torches that have them: 2.14.1 here) when ``group`` has it, else None (the ``torch.distributed`` function is called instead).

    [Note: direct collectives]
    ``dist.all_gather_single`` and ``dist.reduce_scatter_single`` are Python wrappers around the process group's
    method of the same name: per call they check the tensors, the group membership, complex dtypes, torch-function
    modes and a coalescing context, then build the options and call the method. That costs about 15-20 us per
    call on this project's CPU machine, and stage 3 makes some 75 such calls per step on a 24-layer model (two
    gathers and one reduce-scatter per unit). None of those checks applies here: the communicator's tensors are
    plain, real and contiguous, its rank is in its group (``rank >= 0``), and hfzero opens no coalescing context.
    So an asynchronous gather or reduce-scatter calls the group's method with its default options (``asyncOp``
    true, a SUM reduction): the work the wrapper would have launched with ``async_op=True``, from the first lines
    of ``all_gather`` / ``reduce_scatter`` in one helper (``Communicator._direct``: the accounting, the timer's mark,
    the call and its handle, and the label only while the profiler collects). Blocking calls and torches without the methods take the
    ``torch.distributed`` function; tests/test_collectives_direct.py runs both paths on gloo and compares the
    results."""
    method = getattr(group, name, None) if group is not None else None
    return method if callable(method) else None


def _profiler_check() -> Callable[[], bool]:
    """Whether torch's profiler is collecting now, asked of ``torch._C._autograd._profiler_enabled`` (private:
    feature-tested here; without it, always True). See [Note: collective labels]."""
    check = getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", None)
    if callable(check):
        try:
            if isinstance(check(), bool):
                return check
        except Exception:  # noqa: BLE001 - a changed binding: fall back to always labelling
            pass
    return lambda: True


_profiling = _profiler_check()


def label(kind: str) -> contextlib.AbstractContextManager[Any]:
    """``record_function("hfzero::<kind>")`` while torch's profiler collects, else nothing.

    [Note: collective labels]
    Every collective runs under a ``record_function("hfzero::<kind>")`` label so that profiler traces explain
    themselves; but entering and leaving a ``record_function`` dispatches two ops even when no profiler runs
    (about 13 us per collective measured on this project's CPU machine), a per-collective host cost that stage 3
    pays some 80 times per step on a 24-layer model. So the label is entered only while the profiler is
    collecting (``torch._C._autograd._profiler_enabled()``, a C flag read in well under a microsecond; private, so
    feature-tested in ``_profiler_check`` with "always label" as the fallback; tests/test_step_kernels.py checks
    both the labels in a trace and the fallback).
    """
    return record_function(f"hfzero::{kind}") if _profiling() else _UNLABELLED


_UNLABELLED = contextlib.nullcontext()


def _default_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device ``group``'s collectives operate on, asked of the group's backend table (not its name,
    which is "undefined" for ``init_process_group()``); see [Note: collective device] in devices.py."""
    return collective_device(group)


@dataclasses.dataclass
class CommStats:
    """Cumulative figures for one collective kind on one rank."""

    calls: int = 0
    elements: int = 0
    bytes: int = 0
    seconds: float = 0.0
    """Time from launch until the caller's wait returned (overlapped time included): host wall time on
    backends whose wait blocks the host (gloo); on CUDA (NCCL) device time between CUDA events recorded
    on the current stream at the launch and after the wait, added when they are read (see
    ``Communicator.timing`` and [Note: device timing] in hfzero/comm/timing.py)."""
    impl_calls: dict[str, int] = dataclasses.field(default_factory=dict)
    intra_node_bytes: int = 0
    """The part of ``bytes`` that stays inside a node; see [Note: node traffic]."""
    inter_node_bytes: int = 0
    """The part of ``bytes`` that crosses between nodes; see [Note: node traffic]."""


class Handle:
    """An in-flight collective: ``wait()`` blocks until it is done, then runs its completion step once."""

    __slots__ = ("_work", "_stats", "_timer", "_started", "_then", "_done")

    def __init__(self, work: Any, stats: CommStats, timer: DeviceTimer, started: Mark,
                 then: Callable[[], None] | None = None):
        self._work = work
        self._stats = stats
        self._timer = timer
        self._started = started
        self._then = then
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        if self._work is not None:
            self._work.wait()
        if self._then is not None:
            self._then()
        _add_seconds(self._timer, self._stats, self._started)
        self._done = True


class _Works:
    """Several in-flight collectives waited on as one (a gather made of one broadcast per rank)."""

    def __init__(self, works: list[Any]):
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()


def _add_seconds(timer: DeviceTimer, stats: CommStats, started: Mark) -> None:
    """Add the time since ``started`` to ``stats.seconds`` (on CUDA when the events are read)."""
    if started is None:  # nothing was timed: a group of one rank, or a stream under graph capture
        return
    if timer.kind == "wall":  # complete at once: no interval object (a per-collective host cost)
        stats.seconds += time.perf_counter() - started
        return

    def add(seconds: float) -> None:
        stats.seconds += seconds

    timer.interval(started, timer.mark(), add)


class Communicator:
    """Collectives over one process group (any sub-group of a mesh, never assumed to be WORLD).

    Holds no tensor memory of its own; ``stats()`` returns cumulative CommStats per kind.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, reduce_scatter_impl: str = "auto",
                 device: torch.device | None = None, *, ranks_per_node: int = 0):
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.ranks_per_node = (topology.ranks_per_node(ranks_per_node, dist.get_world_size()) if self.distributed
                               else 1)
        """Ranks per node (``ZeroConfig.ranks_per_node``, else LOCAL_WORLD_SIZE, else the whole world)."""
        self.global_ranks: list[int] = (dist.get_process_group_ranks(group or dist.group.WORLD)
                                        if self.distributed else [0])
        """The group's ranks as global ranks, in group-rank order."""
        self.node_crossings = topology.ring_crossings(self.global_ranks, self.ranks_per_node)
        """Ring hops of this group that cross nodes, out of ``world_size``: See [Note: node traffic]."""
        self.backend = str(dist.get_backend(group)) if self.distributed else "none"
        if "gloo" in self.backend:  # See [Note: gloo teardown abort]
            gloo_exit.install()
            gloo_exit.keep(group if group is not None else dist.group.WORLD)
        if reduce_scatter_impl == "auto":
            via_ar = _REDUCE_SCATTER_VIA_ALL_REDUCE.get(self.backend.split(":")[0], False)
        else:
            via_ar = reduce_scatter_impl == "all_reduce"
        self.reduce_scatter_via_all_reduce = via_ar
        self.all_gather_impl = _ALL_GATHER_IMPL.get(self.backend.split(":")[0], "all_gather")
        """How a gather runs: "all_gather", or one in-place broadcast per rank (gloo): see ``_ALL_GATHER_IMPL``."""
        self.device = with_index(device) if device is not None else (
            _default_device(group) if self.distributed else torch.device("cpu"))
        """Where scratch tensors for metadata collectives live, with its index: the GPU under NCCL, the CPU under
        gloo (See [Note: collective device] and [Note: device index] in hfzero/devices.py)."""
        self._stats: dict[str, CommStats] = {}
        pg = (group if group is not None else dist.group.WORLD) if self.distributed and self.rank >= 0 else None
        self._gather_async = _process_group_method(pg, "all_gather_single")
        self._scatter_async = _process_group_method(pg, "reduce_scatter_single")
        """The group's own asynchronous all-gather and reduce-scatter (sum), called straight: See [Note: direct
        collectives]. None: the ``torch.distributed`` functions."""
        on_stream = self.device.type == "cuda" and self.backend.split(":")[0] != "gloo"  # gloo waits block
        self.timer = DeviceTimer(self.device if on_stream else "cpu")
        """Marks around each collective: wall clock, or CUDA events for a device backend (see ``timing``)."""

    @property
    def timing(self) -> str:
        """What ``CommStats.seconds`` measures here: "wall" (host wall time; gloo waits block until the
        transfer is done) or "cuda_event" (NCCL: device time between CUDA events recorded on the current
        stream at launch and after the wait; no host synchronization is added, the figures are complete
        once ``settle_timings(wait=True)`` ran, which the profiler does at each recorded step's end)."""
        return "cuda_event" if self.timer.kind == "cuda_event" else "wall"

    def _mark(self) -> Mark:
        return self.timer.mark() if self.world_size > 1 else None  # a group of one moves and counts nothing

    def settle_timings(self, *, wait: bool = False) -> None:
        """Add to the statistics the collective times whose CUDA events have happened (nothing to do for
        wall times); ``wait`` first blocks on the last one: only where the caller's step waits anyway."""
        self.timer.settle(wait=wait)

    def on_group(self, group: dist.ProcessGroup, *, share_stats: bool = True) -> "Communicator":
        """A communicator over another group (or the same group with a ledger of its own:
        ``share_stats=False``, for small checks that are not volume), on the same device and, by default,
        counting into the same statistics."""
        impl = "all_reduce" if self.reduce_scatter_via_all_reduce else "native"
        other = Communicator(group, impl, device=self.device, ranks_per_node=self.ranks_per_node)
        if share_stats:
            other._stats = self._stats
            other.timer = self.timer  # one place settles the timings of shared statistics
        return other

    def stats(self) -> dict[str, CommStats]:
        """Cumulative figures per collective kind (a copy: callers may keep it to take deltas). On CUDA the
        ``seconds`` of collectives whose events have not happened yet are added at a later call."""
        self.timer.settle()
        return {k: dataclasses.replace(v, impl_calls=dict(v.impl_calls)) for k, v in self._stats.items()}

    def _account(self, kind: str, impl: str, elements: int, element_size: int) -> CommStats:
        if self.world_size == 1:
            return CommStats()  # nothing moves between ranks: count nothing
        s = self._stats.get(kind)
        if s is None:
            s = self._stats[kind] = CommStats()
        s.calls += 1
        s.elements += elements
        nbytes = elements * element_size
        s.bytes += nbytes
        inter = nbytes * self.node_crossings // self.world_size  # See [Note: node traffic]
        s.inter_node_bytes += inter
        s.intra_node_bytes += nbytes - inter
        s.impl_calls[impl] = s.impl_calls.get(impl, 0) + 1
        return s

    def account(self, kind: str, elements: int, element_size: int) -> None:
        """Count a collective over this group that ran outside this communicator (transformers' expert
        all-to-all: hfzero/parallel/expert.py) under ``kind``: ``elements`` this rank sent to other ranks."""
        self._account(kind, kind, elements, element_size)

    def all_reduce(self, tensor: torch.Tensor, *, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                   async_op: bool = False) -> Handle:
        """Reduce ``tensor`` in place across the group."""
        stats = self._account("all_reduce", "all_reduce", 2 * tensor.numel(), tensor.element_size())
        started = self._mark()
        work = None
        if self.world_size > 1:
            with label("all_reduce"):
                work = dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op)
        handle = Handle(work, stats, self.timer, started)
        if not async_op:
            handle.wait()
        return handle

    def _direct(self, method: Callable[[torch.Tensor, torch.Tensor], Any], kind: str, impl: str, output: torch.Tensor,
                input: torch.Tensor, counted: torch.Tensor) -> Handle:
        """Launch an asynchronous collective by the group's own method: account ``counted``'s elements, mark, call,
        hand back; the label only while the profiler collects (See [Note: direct collectives])."""
        stats = self._account(kind, impl, counted.numel(), counted.element_size())
        started = self.timer.mark()
        if _profiling():
            with record_function(f"hfzero::{kind}"):
                work = method(output, input)
        else:
            work = method(output, input)
        return Handle(work, stats, self.timer, started)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Handle:
        """Sum ``input`` (numel = world * output.numel) across ranks; this rank's chunk lands in ``output``.

        ``output`` may alias this rank's chunk of ``input``. With the all-reduce implementation the
        whole of ``input`` holds the reduced sum afterwards; with the native one only the chunk is
        defined: callers must not read the rest.
        """
        if input.numel() != output.numel() * self.world_size:
            raise ValueError(f"reduce_scatter: input has {input.numel()} elements, expected "
                             f"{output.numel()} x {self.world_size}")
        direct = self._scatter_async is not None and not self.reduce_scatter_via_all_reduce
        if async_op and direct and self.world_size > 1:  # stage 3's per-unit reductions
            return self._direct(self._scatter_async, "reduce_scatter", "reduce_scatter", output, input, input)
        impl = "all_reduce" if self.reduce_scatter_via_all_reduce else "reduce_scatter"
        stats = self._account("reduce_scatter", impl, input.numel(), input.element_size())
        started = self._mark()
        if self.world_size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Handle(None, stats, self.timer, started)
        with label("reduce_scatter"):
            if self.reduce_scatter_via_all_reduce:
                chunk = input.view(self.world_size, -1)[self.rank]
                work = dist.all_reduce(input, group=self.group, async_op=async_op)
                then = None if output.data_ptr() == chunk.data_ptr() else (lambda: output.copy_(chunk))
            elif async_op and self._scatter_async is not None:  # See [Note: direct collectives]
                work, then = self._scatter_async(output, input), None
            else:
                work = _reduce_scatter(output, input, group=self.group, async_op=async_op)
                then = None
        handle = Handle(work if async_op else None, stats, self.timer, started, then)
        if not async_op:
            handle.wait()
        return handle

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Handle:
        """Concatenate every rank's ``input`` into ``output`` (numel = world * input.numel), rank order.

        ``input`` may alias this rank's chunk of ``output``.
        """
        if output.numel() != input.numel() * self.world_size:
            raise ValueError(f"all_gather: output has {output.numel()} elements, expected "
                             f"{input.numel()} x {self.world_size}")
        impl = self.all_gather_impl
        if async_op and self._gather_async is not None and impl != "broadcast" and self.world_size > 1:
            return self._direct(self._gather_async, "all_gather", impl, output, input, output)  # stage 3's gathers
        stats = self._account("all_gather", impl, output.numel(), output.element_size())
        started = self._mark()
        if self.world_size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Handle(None, stats, self.timer, started)
        with label("all_gather"):
            if impl == "broadcast":
                chunks = output.view(self.world_size, -1)
                if chunks[self.rank].data_ptr() != input.data_ptr():
                    chunks[self.rank].copy_(input)
                work = _Works([dist.broadcast(chunks[r], src=self.global_ranks[r], group=self.group,
                                              async_op=True) for r in range(self.world_size)])
            elif async_op and self._gather_async is not None:  # See [Note: direct collectives]
                work = self._gather_async(output, input)
            else:
                work = _all_gather(output, input, group=self.group, async_op=async_op)
        handle = Handle(work if async_op or impl == "broadcast" else None, stats, self.timer, started)
        if not async_op:
            handle.wait()
        return handle

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Equal-split all-to-all along dim 0: chunk j of ``input`` goes to rank j, chunk i of ``output``
        comes from rank i (both contiguous, ``world`` chunks each)."""
        if output.shape != input.shape or input.shape[0] % self.world_size:
            raise ValueError(f"all_to_all: input {tuple(input.shape)} and output {tuple(output.shape)} must have "
                             f"the same shape, dim 0 a multiple of {self.world_size}")
        stats = self._account("all_to_all", "all_to_all", input.numel(), input.element_size())
        started = self._mark()
        if self.world_size == 1:
            output.copy_(input)
        else:
            with label("all_to_all"):
                dist.all_to_all_single(output, input, group=self.group)
        _add_seconds(self.timer, stats, started)

    def broadcast(self, tensor: torch.Tensor, src_rank: int = 0) -> None:
        """Broadcast ``tensor`` from group rank ``src_rank`` (in place)."""
        stats = self._account("broadcast", "broadcast", tensor.numel(), tensor.element_size())
        started = self._mark()
        if self.world_size > 1:
            with label("broadcast"):
                src = dist.get_global_rank(self.group, src_rank) if self.group is not None else src_rank
                dist.broadcast(tensor, src=src, group=self.group)
        _add_seconds(self.timer, stats, started)

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every rank's ``payload`` (any lengths), in rank order; for small metadata such as config checks."""
        if self.world_size == 1:
            return [payload]
        length = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        lengths = torch.zeros(self.world_size, dtype=torch.int64, device=self.device)
        self.all_gather(lengths, length)
        lengths = lengths.cpu()
        width = int(lengths.max())
        mine = torch.zeros(width, dtype=torch.uint8)
        if payload:
            mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        out = torch.zeros(width * self.world_size, dtype=torch.uint8, device=self.device)
        self.all_gather(out, mine.to(self.device))
        rows = out.cpu().view(self.world_size, width)
        return [bytes(rows[r, : int(lengths[r])].tolist()) for r in range(self.world_size)]
