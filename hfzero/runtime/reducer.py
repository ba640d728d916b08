"""Gradient reduction during backward: hooks fill buckets, full buckets reduce in a fixed order.

Memory held, by stage (see [Note: bucket sharding] in layout.py):
- stages 0-1: ``grad_full``, one flat gradient buffer shaped like the trainable parameters
  (GRAD_FULL, a model state). Buckets are views of it and are reduced in place.
- stages 2-3: ``grad_shard``, this rank's slice of every bucket (GRAD_SHARD, a model state), plus
  staging buffers for buckets being filled or reduced within one backward pass (GRAD_BUCKET,
  transient; pooled between passes up to the most a pass had open, see [Note: staging pool]; at
  stage 3 a bucket's late gradients, rare, keep a buffer until the step), plus, only under the
  "local" accumulation policy while reduction is deferred, a full local accumulator (GRAD_ACCUM, a
  model state: it is held across micro-batches) that the synchronizing backward reduces and frees.
- with offload (``sink``, runtime/offload.py), stages 2-3 hold no ``grad_shard``: each reduced slice is
  copied to the host and accumulated there; see [Note: offload copies].

[Note: gradient sums]
Stores hold SUMS over ranks, never averages; the division by the world size (and the loss-scale
unscaling) happens once, when the owned slice is converted to fp32 for the step. To keep repeated
backward passes without ``zero_grad`` exact:
- stage 0 all-reduces in place, so every rank holds the full sum S; before the next backward adds to
  it, every rank but rank 0 zeroes its buffer, and the next all-reduce gives exactly S + sum(new).
- stage 1 reduce-scatters in place; before the next backward adds to it (without a zero_grad between), every
  rank zeroes the slices it does not own, so only the owner keeps S. (Zeroing them at that point rather than
  after every reduction spares a pass over (N - 1) / N of the gradients per step: only the owned slices are
  read until then.)
- stages 2-3 reduce fresh staging buffers and add the owned slice into the shard.

[Note: gradient stores]
``zero()`` does not zero the store (``grad_full`` at stages 0-1, ``grad_shard`` at stages 2-3): that was a pass
over it every step which the plain loop does not make (it sets ``.grad`` to None). Each bucket carries a flag
instead, ``_valid``: its region of the store holds sums (or zeros) everywhere. ``zero()`` clears the flags;
while a bucket's flag is clear:
- the hooks write a parameter's first gradient since ``zero()`` with ``copy_`` (the store is not read), later
  ones with ``add_``, straight into the store (``_direct`` buckets): every bucket at stages 0-1, and at stages
  2-3 a bucket its group does not split (one rank: world 1), whose shard slice is the whole bucket, so it
  needs neither a staging buffer nor a copy out of one;
- at stages 2-3 a bucket's first reduction since ``zero()`` reduce-scatters straight into its shard slice
  (the collective's output), instead of into the staging buffer and then an add into the shard;
- before a region is read (its reduction, ``owned_grad``, HSDP's all-reduce of the shard: ``_settle``) what
  nothing wrote is zeroed: the slots of parameters no backward reached (rare: unused parameters), or the
  whole region when nothing reached it (a step without backward). Padding is never written by a hook and
  stays zero (collectives sum zeros into it).
A region settled or written whole is valid and everything adds into it, as before: repeated backward passes
without ``zero_grad``, stage 0's zeroing off rank 0 and stage 1's zeroing of the slices a rank does not own
([Note: gradient sums]) keep their meaning. Staging buffers and the "local" accumulator are still zeroed
when taken (a pooled buffer's padding and unused slots hold another bucket's values). Device work this saves
per step (16-bit gradients, Ψ elements, N ranks): the store's zero pass (2Ψ bytes at stages 0-1, 2Ψ/N at
2-3) and the first gradient's read of the store (2Ψ); at stages 2-3 the add of each reduced slice into the
shard (6Ψ/N); at world 1 also the staging buffer's zeroing and the copy out of it (stage 2: 8Ψ more).

[Note: staging pool]
Staging buffers are reused, never allocated per bucket per pass: a buffer given back after its
bucket's reduction joins a pool, and the next bucket takes one of its exact size (else the smallest
larger one). The pool keeps buffers while pooled + open + late elements stay within the high-water
mark of open + late elements seen so far (at least ``max_inflight + 1`` of the largest bucket), so the
GRAD_BUCKET footprint between passes never exceeds what a pass already needed at once, and a steady
state allocates nothing. At stages 0-2 at most ``max_inflight + 1`` buckets are open; at stage 3
buckets launch at unit boundaries, so a unit's buckets are open together (plus those in flight), and
a pool capped at ``max_inflight + 1`` buffers freed and reallocated several per pass: issue 21 counted
171 fresh buffers in 240 takes (69 MB per step of GPT-2 5.3M, world 2, 4 micro-batches), blocks of
1-8 MiB that fragment the host heap (see [Note: host allocator] in hostmem.py). Pooled buffers are
counted in GRAD_BUCKET at every sample (``staging_bytes``).

[Note: accumulation policy]
``policy`` decides what ``no_sync()`` does. "local": backward passes inside it add into the full
local store (stages 0-1: ``grad_full``; stages 2-3: the accumulator) and the reduction runs once, at
the next synchronizing backward or at ``reduce_pending()`` (the step). "sharded": ``no_sync()``
does not defer; every backward pass reduces its buckets as they fill. A pipeline schedule drives the
same two behaviours without the user's ``no_sync``: it runs its micro-batches inside ``no_sync()``
("local") or not ("sharded") and the step's ``reduce_pending()`` is the end-of-step reduction.

[Note: collective order across ranks]
Every rank launches every bucket's reduction exactly once per synchronizing backward, in bucket
index order, so a single process group never sees mismatched collectives. Stage 3 runs parameter
gathers on the same group (See [Note: one communicator per data-parallel group] in stage3/engine.py);
there the *interleaving* of gathers and reductions must not depend on the rank either (a gather
paired with another rank's reduce-scatter mixes or hangs). So at stage 3 a bucket is launched only at rank-independent points (``launch_on_fill``
is False): when the backward pass moves on to a later unit (``force_ready``), or at the end of the
backward pass, never at the moment its last gradient happens to arrive, which differs between ranks
(an unused parameter, a slower branch). Gradients arriving after their bucket was launched ("late")
are kept and reduced at the optimizer step, after the step's one check collective (See [Note: stage-3
step check] in stage3/step_check.py).

[Note: gradients in place]
At stage 3 a staging buffer's slots are the parameters' gradients themselves: when the backward pass reaches a
unit (``expect``, called by the stage-3 scheduler once the unit is gathered, and at the pass's start for the
persistent parameters' buckets), each bucket of it takes its staging buffer and every parameter whose ``.grad``
is None gets ``.grad`` = its slot, viewed with the parameter's shape. Autograd's AccumulateGrad then adds the
gradient into the slot in place (the buffer is zeroed when taken) and the reducer only does the bookkeeping when it
collects the gradient ([Note: gradients collected at rank-independent points]); the
per-parameter copy out of a fresh gradient tensor, a Python-level slice and ``copy_`` per parameter per
backward, goes away (DDP's ``gradient_as_bucket_view`` does the same for its buckets). The reducer clears ``.grad``
when it collects it, so between passes no parameter points into a staging buffer. Which buffer a bucket takes comes
from the pool ([Note: staging pool]); the slot views of each (buffer, bucket) pair are made once and kept while the
buffer is pooled or open (views hold no memory of their own), so a steady state makes no views either.
What falls back to the copy (the collected gradient is not its slot): a parameter whose ``.grad`` was set
when its unit was reached, the pass's first gradient (the reducer starts its pass there: the units reached
before are pointed at their slots then, but that one parameter already holds its gradient), a gradient computed
out of place (``create_graph=True`` replaces ``.grad``), a DTensor parameter or one whose dtype is not the
staging buffer's, and a late gradient: when a bucket is launched, its parameters still pointing at their slots
are cleared first (``_unset``), so a gradient arriving after its bucket left never writes into a buffer the pool
may have handed to another bucket. ``torch.autograd.grad`` accumulates into no ``.grad``: the reducer does not
start a pass for it (units reached are only remembered, ``_expected``, until a first gradient arrives) and the
scheduler forgets them when the next backward pass starts. Memory: none added; the staging buffer of a unit's
bucket is taken when the unit's backward starts instead of at its first gradient, a few kernels earlier, and the
persistent parameters' buckets (small: each parameter is under ``param_persistence_threshold``) at the pass's
first gradient instead of at their own first, which in a decoder is the last block's norm, near the start too.
Under the "local" accumulation policy inside ``no_sync`` gradients still go to the accumulator by copy.

[Note: gradients collected at rank-independent points]
At stages 0-2 a bucket launches as soon as its last gradient arrives, so each parameter's post-accumulate hook is a
Python call that does the bookkeeping at once. Stage 3 launches a unit's buckets only when the backward pass is done
with the unit ([Note: collective order across ranks]), so nothing needs the gradient the moment it lands: there the
hook is ``list.append`` of ``_arrived`` (``defer_hooks``), a C function autograd calls without entering the
interpreter, and ``collect`` does the same per-parameter work over the arrivals, in order, at the scheduler's points:
when the backward pass reaches a unit (before pointing it at its slots: the first arrivals start the reducer's pass),
when it is done with a unit (before the unit's buckets launch) and at its end (before the reducer's end, which is
queued after the scheduler's). FSDP2 likewise reads ``.grad`` at each group's post-backward instead of hooking
parameters. On the host proxy's 24-layer model that is 292 Python hook calls per step fewer (about 5% of a plain
step). Semantics kept: a gradient that arrives twice in a pass (the first collect took both sums) raises as before;
``torch.autograd.grad`` accumulates nothing, so nothing arrives and no pass starts. A backward that reaches no unit
(a penalty on persistent parameters alone) leaves its arrivals to ``flush``, a reducer pass of their own at the next
backward's start or at the step (rank-independent points: every rank ran the same backward), or to ``zero_grad``,
which forgets them; such a pass sees the ``no_sync`` state of the moment it is flushed and skips fp16's check that
the loss was scaled (it cannot be judged then). The gradients that arrive before the reducer's pass starts (it
starts at the first collect that finds any: in a decoder, the final norm's, when the backward pass reaches the last
block) take the copy path. Memory: the list of arrivals only.

[Note: active buckets]
A pipeline rank running several stages (a multi-stage schedule) back-propagates one stage at a time;
the other stages' buckets get nothing from that backward. ``active`` (set by the pipeline driver
around each backward and weight pass) names the buckets a pass reduces: the others are neither
launched nor, at stage 0, zeroed, so a stage's per-micro-batch reduction moves that stage's
buckets only. It is the same set on every rank of the dp group (the schedule is), so the order
of collectives stays rank-independent. None (the default): every bucket.
"""

from __future__ import annotations

import collections
import contextlib
import enum
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from hfzero.comm.collectives import Communicator, Handle
from hfzero.logging import get_logger
from hfzero.runtime.tensors import iter_tensors, local_tensor
from hfzero.runtime.layout import Bucket, FlatLayout, ParamSlot
from hfzero.runtime.lifetime import WeakHook
from hfzero.runtime.offload import HostOffload
from hfzero.runtime.torch_api import graph_task_id, queue_backward_callback, view_base

logger = get_logger(__name__)

_ADD, _DIRECT, _STORE = "add", "direct", "store"
"""Where a stage-2/3 bucket's reduced slice goes (``_launch`` / ``_complete``): added into the shard from the
reduced buffer, reduced straight into the shard (its first sums since ``zero()``), or already in it (a direct
bucket filled in place). See [Note: gradient stores]."""

_MAX_GRAPH_ROOTS = 64
"""Forward outputs remembered for the unused-parameter lookup before the graphs are let go."""

FAILED_PASS_MESSAGE = (
    "hfzero: the previous forward or backward pass raised before it finished, so this step's gradients "
    "are incomplete; call optimizer.zero_grad() (on every rank) to discard them, then continue with the "
    "next batch")


class GradState(enum.Enum):
    """What the gradient store holds.

    EMPTY: nothing accumulated (after zero_grad; the store's old values are stale until written or settled:
        See [Note: gradient stores]).
    LOCAL: unreduced local contributions (a backward ran under no_sync); reduced before the step.
    REDUCED: sums over all ranks of everything accumulated since zero_grad.
    """

    EMPTY = "empty"
    LOCAL = "local"
    REDUCED = "reduced"


class GradientReducer:
    """Registers post-accumulate-grad hooks and reduces gradients bucket by bucket."""

    def __init__(self, layout: FlatLayout, comm: Communicator, stage: int, dtype: torch.dtype,
                 device: torch.device, overlap: bool, max_inflight: int, policy: str = "local",
                 sink: HostOffload | None = None, comms: list[Communicator] | None = None):
        self.layout = layout
        self.comm = comm
        self.comms = comms or [comm]
        """The communicator of each layout partition (``Bucket.partition`` indexes it; ``comm`` is partition 0's):
        a bucket is reduced over its partition's group. See [Note: bucket partitions] in layout.py."""
        self.scatter: Any = comm
        """What runs partition 0's reduce-scatters (stages 1-3): ``comm``, or qgZ's hierarchical quantized
        reduction (set by the engine; same signature. See [Note: quantized collectives] in
        hfzero/comm/quantized.py)."""
        self.stage = stage
        self.dtype = dtype
        self._element = torch.empty(0, dtype=dtype).element_size()
        self.device = device
        self.overlap = overlap
        self.max_inflight = max_inflight
        self.policy = policy
        self.sink = sink
        """Where reduced slices go when the optimizer is offloaded (None: they stay on the device)."""
        self.replicate: Communicator | None = None
        """HSDP (set by the engine): late gradients reduced at the step are all-reduced over it before they are
        added to the shard, whose earlier sums the step already all-reduced (See [Note: hierarchical
        sharding] in engine.py)."""
        self.sync = True
        self.state = GradState.EMPTY
        self.grad_full: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        if stage < 2:
            self.grad_full = torch.zeros(layout.total_padded, dtype=dtype, device=device)
        elif sink is None:
            self.grad_shard = torch.zeros(layout.shard_numel, dtype=dtype, device=device)
        self.accumulator: torch.Tensor | None = None
        self.launch_on_fill = True
        """False at stage 3: buckets launch only at rank-independent points (see the Note above)."""
        self._staging: dict[int, torch.Tensor] = {}
        self._late: dict[int, torch.Tensor] = {}
        self._pool: list[torch.Tensor] = []
        """Pooled staging buffers, largest first (See [Note: staging pool])."""
        self._pooled = 0
        """Elements of the pooled buffers."""
        self._live = 0
        """Elements of the open staging and late buffers (their whole allocations): every one was taken by
        ``_take_buffer`` and leaves through ``_give_back``, which keep this count."""
        self._reuse_after: dict[int, torch.cuda.Event] = {}  # id(pooled buffer) -> its offload copy done
        self._pending: list[int] = []
        self._forced: list[bool] = []
        self._fired: set[ParamSlot] = set()
        self._assumed_unused: set[ParamSlot] = set()
        self.used: set[ParamSlot] = set()
        """The slots of the parameters that received a gradient on this rank since the last zero(). Sets of slots,
        not parameters: a slot hashes by identity in C, a tensor through ``Tensor.__hash__`` in Python, several
        times per parameter per backward."""
        self._dirty = False
        self._next_launch = 0
        self.active: frozenset[int] | None = None
        """Bucket indices the next backward or ``reduce_added`` reduces; None: all. See [Note: active buckets]."""
        self._inflight: collections.deque[tuple[Bucket, Handle]] = collections.deque()
        self._in_backward = False
        self._graph_task = -1
        self._told_sharded = False
        self.always_find_unused = False
        """ZeroConfig.find_unused_parameters: look unused parameters up before every backward."""
        self.find_unused = True
        """Look up, at the start of the next backward, which parameters the graph cannot reach, so their
        buckets do not wait for them (and hold staging open for every later bucket). On for the first
        backward; then only while some parameter went unused (or ``always_find_unused``)."""
        self._graph_roots: list[torch.autograd.graph.Node] = []
        self._roots_complete = True
        self.peak_staging_bytes = 0
        """Largest GRAD_BUCKET footprint seen (pool + open staging + late buffers) since construction."""
        self._live_high = (max_inflight + 1) * max((b.padded for b in layout.buckets), default=0)
        """Most staging elements open at once (open + late) so far, at least ``max_inflight + 1`` of the
        largest bucket: the pool keeps buffers up to it. See [Note: staging pool]."""
        self.allocations = 0
        """Staging buffers allocated since construction (steady state: constant; tests read it)."""
        self.before_first_grad: Callable[[], None] | None = None
        self.on_step_begin: Callable[[], None] | None = None
        """Called at the first backward after the gradients were zeroed, before any reduction."""
        # keyed by RemovableHandle id (an OrderedDict: the handle keeps a weak reference to it)
        self.backward_end_hooks: collections.OrderedDict[int, Callable[[], None]] = collections.OrderedDict()
        self._direct = [self.grad_full is not None or (self.grad_shard is not None and b.shard_world == 1)
                        for b in layout.buckets]
        """Buckets whose gradients the hooks write straight into the store: every bucket at stages 0-1
        (``grad_full``); at stages 2-3 a bucket its group does not split (one rank: world 1), whose shard
        slice is the whole bucket, so it needs no staging buffer. See [Note: gradient stores]."""
        self._regions: list[torch.Tensor | None] = [None] * len(layout.buckets)
        """Each bucket's region of the store, made when first asked for (``_store_region``)."""
        self._valid = [True] * len(layout.buckets)
        """Per bucket: its region of the store holds gradient sums (or zeros) everywhere; False after ``zero()``
        until it is written whole or settled. See [Note: gradient stores]."""
        self._hooked: dict[int, tuple[ParamSlot, torch.Tensor | None]] = {}
        """``id(param)`` -> its slot and, in a direct bucket, its view of the store shaped like it (a view: no
        memory), so the hook finds both without hashing a tensor and writes without slicing. The layout holds
        every parameter, so no id is reused while this lives."""
        for param, slot in layout.slots.items():
            bucket = layout.buckets[slot.bucket]
            view = None
            if self._direct[bucket.index]:
                view = self._store_region(bucket)[slot.offset: slot.offset + slot.numel].view(slot.shape)
            self._hooked[id(param)] = (slot, view)
        self._preset: dict[int, torch.Tensor] = {}
        """``id(param)`` -> the staging slot its ``.grad`` points at in this pass (See [Note: gradients in place])."""
        self._awaiting = [0] * len(layout.buckets)
        """Per bucket: its parameters whose ``.grad`` points at a slot and whose gradient has not arrived yet."""
        self._expected: list[Bucket] = []
        """Buckets of units the backward pass reached before the reducer's pass started (its first gradient)."""
        self._slot_views: dict[int, dict[int, list[tuple[nn.Parameter, torch.Tensor]]]] = {}
        """A pooled or open staging buffer's address (its first element: buffers start their allocation) -> bucket
        index -> (parameter, its slot view) for the parameters that can accumulate in place; dropped when the buffer
        leaves the pool (the views keep its memory alive, so no other buffer can take the address meanwhile)."""
        self._arrived: list[nn.Parameter] = []
        """With the hooks deferred (stage 3): the parameters autograd accumulated a gradient into since the last
        ``collect``, in order. See [Note: gradients collected at rank-independent points]."""
        # torch holds these in C++, out of the garbage collector's sight: weak (See [Note: engine lifetime])
        self._hook_handles = [slot.param.register_post_accumulate_grad_hook(WeakHook(self._on_grad))
                              for slot in layout.slots.values()]

    def remove_hooks(self) -> None:
        """Remove the post-accumulate-grad hooks from the parameters (``unprepare``), and any ``.grad`` still pointing
        at a staging slot (a pass that raised: See [Note: gradients in place])."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        self._unset_all()

    # ---- switches -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Under the "local" policy, accumulate gradients locally, without communication, for backward
        passes inside the block; under "sharded", backward passes still reduce (no full gradient is
        held). See [Note: accumulation policy]."""
        if self.policy != "local":
            if not self._told_sharded:
                logger.info("accumulation='sharded': no_sync() does not defer reduction; every micro-batch is "
                            "reduce-scattered into the shard (set accumulation='local' to reduce once per step)")
                self._told_sharded = True
            yield
            return
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    def record_graph_roots(self, output: object, *, replace: bool = False) -> None:
        """Remember the autograd nodes of ``output`` (a forward's outputs, or with ``replace`` the loss
        about to be back-propagated), to find unused parameters when the backward pass starts."""
        if not self.find_unused or not torch.is_grad_enabled():
            return
        roots = [t.grad_fn for t in iter_tensors(output) if t.grad_fn is not None]
        if replace:
            self._graph_roots, self._roots_complete = roots, True
        elif len(self._graph_roots) + len(roots) > _MAX_GRAPH_ROOTS:
            # many forwards without a backward (evaluation with grad enabled?): keep no graph alive
            self._graph_roots, self._roots_complete = [], False
        elif self._roots_complete:
            self._graph_roots.extend(roots)

    # ---- hooks ----------------------------------------------------------------------------------
    def defer_hooks(self) -> None:
        """Stage 3: replace each parameter's Python hook by ``list.append`` of ``_arrived``; the gradients are
        taken by ``collect`` at the scheduler's points. See [Note: gradients collected at rank-independent points]."""
        for handle in self._hook_handles:
            handle.remove()
        append = self._arrived.append  # holds the list only: no path back to the reducer (See [Note: engine lifetime])
        self._hook_handles = [slot.param.register_post_accumulate_grad_hook(append) for slot in self.layout.slots.values()]

    def collect(self) -> None:
        """Take the gradients that arrived since the last call, in order (deferred hooks: stage 3's scheduler calls it
        when the backward pass is done with a unit, before its buckets launch, and at the pass's end)."""
        arrived = self._arrived
        if not arrived:
            return
        if self._in_backward and graph_task_id() != self._graph_task:  # once for the batch: all arrived in this task
            raise RuntimeError(FAILED_PASS_MESSAGE)
        preset_of, hooked, fired, awaiting, pending = self._preset, self._hooked, self._fired, self._awaiting, self._pending
        # nothing appends while this runs (no AccumulateGrad does); cleared after, so a raise leaves the whole batch
        # to zero_grad (``zero``), which clears every .grad in it
        for param in arrived:
            # ``_on_grad``'s in-place case inlined (one Python call fewer per parameter): the gradient is in its slot,
            # the pass is running, the parameter's first gradient of the pass; anything else takes ``_on_grad``
            key = id(param)
            preset = preset_of.get(key)
            if preset is not None and preset is param.grad and self._in_backward:
                slot = hooked[key][0]
                if slot not in fired and slot not in self._assumed_unused:
                    del preset_of[key]
                    param.grad = None
                    awaiting[slot.bucket] -= 1
                    pending[slot.bucket] -= 1
                    fired.add(slot)
                    self.used.add(slot)
                    continue
            self._on_grad(param, True)
            pending = self._pending  # (a pass begun by the first gradient has new counts)
        arrived.clear()
        self._dirty = True

    def has_arrivals(self) -> bool:
        """Deferred gradients wait to be taken (``collect`` / ``flush``)."""
        return bool(self._arrived)

    def flush(self) -> None:
        """Take, as a reducer pass of their own, deferred gradients that no backward pass collected (a backward that
        reached no stage-3 unit: the scheduler saw nothing of it). Called at rank-independent points: the next
        backward's start, the step."""
        if not self._arrived:
            return
        if self._in_backward:  # a pass is running (or one raised: the collect below says so)
            self.collect()
            return
        self._begin_backward(queue=False, check=False)  # (fp16: it may have been scaled; the engine checks the clip case)
        self.collect()
        self._end_backward()

    def _on_grad(self, param: nn.Parameter, deferred: bool = False) -> None:
        # the hot path: one call per parameter per backward, so no work here that a parameter does not need
        grad = param.grad
        if grad is None:
            if deferred and self._in_backward and self._hooked[id(param)][0] in self._fired:
                raise RuntimeError(_TWO_GRADIENTS)  # it arrived twice: the first collect took both sums
            return
        param.grad = None
        if type(grad) is not torch.Tensor:  # a DTensor's gradient (tensor parallelism): its local shard
            grad = local_tensor(grad)
        if grad.requires_grad:  # backward(create_graph=True): the stores must never join a graph
            grad = grad.detach()
        if self._in_backward and not deferred and graph_task_id() != self._graph_task:  # (collect checks once)
            raise RuntimeError(FAILED_PASS_MESSAGE)
        if not self._in_backward:
            self._begin_backward(param)
        preset = self._preset.pop(id(param), None) if self._preset else None
        slot, view = self._hooked[id(param)]
        if preset is not None:
            self._awaiting[slot.bucket] -= 1
        counted = slot in self._assumed_unused  # the graph lookup missed it: its bucket did not wait
        if counted:
            self._assumed_unused.discard(slot)
        elif slot in self._fired:
            raise RuntimeError(_TWO_GRADIENTS)
        self._fired.add(slot)
        first = slot not in self.used  # its first gradient since zero(): See [Note: gradient stores]
        self.used.add(slot)
        self._dirty = True
        index = slot.bucket
        if preset is grad:
            pass  # autograd added it into its staging slot: See [Note: gradients in place]
        elif self.sync and index < self._next_launch:  # its reduction already left: a late gradient
            bucket = self.layout.buckets[index]
            if self.launch_on_fill:
                raise RuntimeError(
                    f"hfzero: parameter {slot.name!r} received its gradient after its bucket was reduced: it was "
                    "used outside the graph of the model's forward outputs. Call optimizer.backward(loss) "
                    "(the engine then looks up unused parameters from the loss itself).")
            late = self._late.get(bucket.index)
            if late is None:
                late = self._late[bucket.index] = self._take_buffer(bucket.padded)
            late[slot.offset: slot.offset + slot.numel].add_(grad.reshape(-1))
            return
        elif view is not None and (self.grad_full is not None or (self.sync and self.accumulator is None)):
            if first and not self._valid[index]:
                view.copy_(grad)
            else:
                view.add_(grad)
        elif self.grad_full is None and self.accumulator is None and self.sync:
            # a staging buffer, zeroed when taken: each slot is written once a pass; one view op (``as_strided``,
            # shaped like the gradient) instead of two slices and a reshape
            staging = self._staging.get(index)
            if staging is None:
                staging = self._fill_target(self.layout.buckets[index])
            staging.as_strided(slot.shape, slot.stride, staging.storage_offset() + slot.offset).copy_(grad)
        else:
            dest = self._fill_target(self.layout.buckets[index])[slot.offset: slot.offset + slot.numel]
            dest.add_(grad.reshape(-1))  # the "local" accumulator: sums over backward passes
        if not counted:
            self._pending[index] -= 1
            if self._pending[index] == 0 and self.sync and self.overlap and self.launch_on_fill:
                self._launch_ready()

    def _begin_backward(self, first: nn.Parameter | None = None, queue: bool = True, check: bool = True) -> None:
        """Start the reducer's pass at its first gradient (``first``'s); ``queue``: end it when autograd's backward
        pass ends (else the caller ends it: ``flush``); ``check``: run ``before_first_grad``."""
        if check and self.before_first_grad is not None:
            self.before_first_grad()
        self._zero_before_new_sums()
        if self.state is GradState.EMPTY and self.on_step_begin is not None:
            self.on_step_begin()  # before any bucket of the step: See [Note: step agreement]
        self._in_backward = True
        self._graph_task = graph_task_id()
        self._pending = [len(b.slots) for b in self.layout.buckets]
        self._forced = [False] * len(self.layout.buckets)
        self._fired.clear()
        self._assumed_unused.clear()
        self._next_launch = 0
        if queue:
            queue_backward_callback(self._end_backward)
        roots, self._graph_roots = self._graph_roots, []
        complete, self._roots_complete = self._roots_complete, True
        if self.find_unused and roots and complete:
            reachable = _reachable_params(roots)
            for param, slot in self.layout.slots.items():
                if param not in reachable:  # this backward cannot produce it: do not wait for it
                    self._assumed_unused.add(slot)
                    self._pending[slot.bucket] -= 1
            if self.sync and self.overlap and self.launch_on_fill:
                self._launch_ready()
        expected, self._expected = self._expected, []
        if expected:
            self._point_at_slots(expected, skip=first)

    def _zero_before_new_sums(self, every_bucket: bool = False) -> None:
        """After a reduction, before new gradients are added to the store of the active buckets (``every_bucket``:
        all of them): at stage 0 every rank but rank 0 zeroes them, so only rank 0 keeps the sum S;
        at stage 1 every rank zeroes the slices it does not own, so only the owner keeps S (See [Note: gradient
        sums]); the other buckets keep S."""
        if self.state is not GradState.REDUCED:
            return
        indices = None if every_bucket else self.active
        if self.stage == 0:
            self._zero_off_root(indices)
        elif self.stage == 1:
            for index in range(len(self.layout.buckets)) if indices is None else indices:
                bucket = self.layout.buckets[index]
                lo, hi = bucket.mine()
                if lo:
                    self.grad_full[bucket.offset: bucket.offset + lo].zero_()
                if hi < bucket.padded:
                    self.grad_full[bucket.offset + hi: bucket.offset + bucket.padded].zero_()

    def _zero_off_root(self, indices: Iterable[int] | None) -> None:
        """Stage 0: zero buckets ``indices`` (None: all) where this rank is not rank 0 of the bucket's partition
        group, which alone keeps the sum (See [Note: gradient sums] and [Note: bucket partitions])."""
        off_root = [c.rank != 0 for c in self.comms]
        if not any(off_root):
            return
        if indices is None and all(off_root):
            self.grad_full.zero_()
            self._valid = [True] * len(self.layout.buckets)
            return
        for index in range(len(self.layout.buckets)) if indices is None else indices:
            bucket = self.layout.buckets[index]
            if off_root[bucket.partition]:
                self.grad_full[bucket.offset: bucket.offset + bucket.padded].zero_()
                self._valid[index] = True

    def _is_active(self, index: int) -> bool:
        return self.active is None or index in self.active

    def _end_backward(self) -> None:
        try:
            if self.sync:
                self._launch_all_remaining()
                self._wait_all()  # late gradients (stage 3) wait for the step: See [Note: stage-3 step check]
                if self.sink is not None:  # before the accumulator is freed: See [Note: offload copies]
                    self.sink.drain()
                self.accumulator = None
                self._trim_pool()
                self.state = GradState.REDUCED
            else:
                self.state = GradState.LOCAL
            # keep looking unused parameters up only while there are some (a graph walk per backward)
            self.find_unused = self.always_find_unused or len(self._fired) < len(self.layout.slots)
        finally:
            self._in_backward = False
        for hook in list(self.backward_end_hooks.values()):
            hook()

    def force_ready(self, buckets: Iterable[Bucket]) -> None:
        """Treat ``buckets`` as complete for this backward (stage 3: their unit's backward is over on
        every rank) and launch what the fixed order allows. See [Note: collective order across ranks]."""
        if not self._in_backward:
            if self._expected:  # done before the reducer's pass started: its unit may be released now
                done = {bucket.index for bucket in buckets}
                self._expected = [b for b in self._expected if b.index not in done]
            return
        for bucket in buckets:
            self._forced[bucket.index] = True
        if self.sync and self.overlap:
            self._launch_ready()

    # ---- gradients in place (stage 3) ------------------------------------------------------------
    def expect(self, buckets: list[Bucket], new_pass: bool = False) -> None:
        """The backward pass reached the unit of ``buckets`` (stage 3, the unit gathered; ``new_pass``: a backward
        pass starts, ``buckets`` being the persistent parameters'): point their parameters' ``.grad`` at their
        staging slots, so autograd accumulates into them in place. Before the reducer's pass has started (no
        gradient yet) the buckets are remembered until it does. See [Note: gradients in place]."""
        if new_pass:
            self._expected = []
        if not buckets:
            return
        if not self._in_backward:
            self._expected.extend(buckets)
            return
        if graph_task_id() != self._graph_task:
            raise RuntimeError(FAILED_PASS_MESSAGE)
        self._point_at_slots(buckets)

    def _point_at_slots(self, buckets: list[Bucket], skip: nn.Parameter | None = None) -> None:
        if not self.sync or self.accumulator is not None or self.grad_full is not None:
            return  # gradients go to the "local" accumulator or the full store: copied by the hook
        preset, awaiting = self._preset, self._awaiting
        for bucket in buckets:
            index = bucket.index
            if index < self._next_launch or self._direct[index] or not self._is_active(index):
                continue
            staging = self._fill_target(bucket)
            views = self._slot_views.get(staging.data_ptr())
            slots = None if views is None else views.get(index)
            if slots is None:
                slots = self._make_slot_views(staging, bucket)
            for param, slot_view in slots:
                if param.grad is None and param is not skip:
                    param.grad = slot_view
                    preset[id(param)] = slot_view
                    awaiting[index] += 1

    def _make_slot_views(self, staging: torch.Tensor, bucket: Bucket) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """The slot views of ``bucket`` in ``staging`` for the parameters that can accumulate in place (plain
        tensors of the buffer's dtype), kept while the buffer is pooled or open."""
        origin = staging.storage_offset()
        slots = [(slot.param, staging.as_strided(slot.shape, slot.stride, origin + slot.offset)) for slot in bucket.slots
                 if local_tensor(slot.param) is slot.param and slot.param.dtype == staging.dtype]  # no DTensor
        self._slot_views.setdefault(staging.data_ptr(), {})[bucket.index] = slots
        return slots

    def _unset(self, bucket: Bucket) -> None:
        """Clear the ``.grad`` of ``bucket``'s parameters still pointing at their slots (before its reduction
        leaves, or when a pass is abandoned): a later gradient then takes the copy path."""
        for slot in bucket.slots:
            view = self._preset.pop(id(slot.param), None)
            if view is not None and slot.param.grad is view:
                slot.param.grad = None
        self._awaiting[bucket.index] = 0

    def _unset_all(self) -> None:
        """``_unset`` every bucket with parameters still pointing at their slots."""
        for bucket in self.layout.buckets:
            if self._awaiting[bucket.index]:
                self._unset(bucket)
        self._preset.clear()

    # ---- buffers --------------------------------------------------------------------------------
    def _take_buffer(self, numel: int) -> torch.Tensor:
        """A zeroed staging buffer of ``numel`` elements, from the pool when one fits (the same size
        first, else the smallest larger one). See [Note: staging pool]."""
        fit = -1  # the smallest pooled buffer that fits: the pool is sorted largest first
        for i, t in enumerate(self._pool):
            if t.numel() < numel:
                break
            fit = i
        if fit >= 0:
            flat = self._pool.pop(fit)
            self._pooled -= flat.numel()
            if self.sink is not None:  # See [Note: offload copies]
                self.sink.order_after(self._reuse_after.pop(id(flat), None))
        else:  # none fits: free pooled ones (smallest first) that the high-water mark cannot also hold
            while self._pool and self._live + numel + self._pooled > self._live_high:
                self._drop_pooled(self._pool.pop())
            flat = torch.empty(numel, dtype=self.dtype, device=self.device)
            self.allocations += 1
        self.peak_staging_bytes = max(self.peak_staging_bytes, self.staging_bytes() + flat.numel() * self._element)
        self._live += flat.numel()
        self._live_high = max(self._live_high, self._live)
        return (flat if flat.numel() == numel else flat[:numel]).zero_()  # a pooled buffer of the size: no view

    def _drop_pooled(self, buffer: torch.Tensor) -> None:
        """Forget a buffer leaving the pool (the caller takes it out of ``_pool``; its memory is freed once nothing
        else holds it), with its slot views and its offload copy's event."""
        self._pooled -= buffer.numel()
        self._slot_views.pop(buffer.data_ptr(), None)
        self._reuse_after.pop(id(buffer), None)

    def _give_back(self, buffer: torch.Tensor, copied: torch.cuda.Event | None = None) -> None:
        """Return a staging buffer to the pool, within the high-water mark (see [Note: staging pool]);
        ``copied``: the offload copy still reading it, which its next user must wait for."""
        base = view_base(buffer)
        self._live -= base.numel()
        self._pooled += base.numel()
        self._pool.append(base)
        if len(self._pool) > 1 and self._pool[-2].numel() < base.numel():
            self._pool.sort(key=torch.Tensor.numel, reverse=True)
        if copied is not None:
            self._reuse_after[id(base)] = copied
        self._trim_pool()

    def _fill_target(self, bucket: Bucket) -> torch.Tensor:
        """The bucket-shaped buffer this backward's gradients for ``bucket`` are added into."""
        if self.grad_full is not None:
            return self.grad_full[bucket.offset: bucket.offset + bucket.padded]
        if self.accumulator is not None or not self.sync:
            if self.accumulator is None:
                self.accumulator = torch.zeros(self.layout.total_padded, dtype=self.dtype, device=self.device)
            return self.accumulator[bucket.offset: bucket.offset + bucket.padded]
        if self._direct[bucket.index]:  # the shard slice is the whole bucket: See [Note: gradient stores]
            return self._store_region(bucket)
        staging = self._staging.get(bucket.index)
        if staging is None:
            staging = self._staging[bucket.index] = self._take_buffer(bucket.padded)
        return staging

    def _fills_store(self, bucket: Bucket) -> bool:
        """Whether this backward's gradients for ``bucket`` go straight into the store (``_fill_target``)."""
        return self.grad_full is not None or (self._direct[bucket.index] and self.sync and self.accumulator is None)

    def _store_region(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's region of the gradient store: the whole bucket in ``grad_full`` (stages 0-1), this rank's
        slice in ``grad_shard`` (stages 2-3). A view made once per bucket (no memory; the stores are never
        replaced): a slice op saved per reduction and per settle."""
        region = self._regions[bucket.index]
        if region is None:
            region = self._regions[bucket.index] = self._region_of(bucket)
        return region

    def _region_of(self, bucket: Bucket) -> torch.Tensor:
        if self.grad_full is not None:
            return self.grad_full[bucket.offset: bucket.offset + bucket.padded]
        return self.grad_shard[bucket.shard_offset: bucket.shard_offset + bucket.chunk]

    def _settle(self, index: int) -> None:
        """Make bucket ``index``'s region of the store hold sums everywhere before it is read: zero what no
        gradient wrote since ``zero()`` (the slots of parameters no backward reached, in a bucket the hooks
        fill; the whole region otherwise). See [Note: gradient stores]."""
        if self._valid[index]:
            return
        bucket = self.layout.buckets[index]
        region = self._store_region(bucket)
        if self._direct[index] and any(slot in self.used for slot in bucket.slots):
            for slot in bucket.slots:
                if slot not in self.used:
                    region[slot.offset: slot.offset + slot.numel].zero_()
        else:
            region.zero_()
        self._valid[index] = True

    def settle_store(self) -> None:
        """Every bucket's region of the store holds sums (or zeros): before the store is read whole (HSDP's
        all-reduce of the shard)."""
        for index in range(len(self.layout.buckets)):
            self._settle(index)

    def _trim_pool(self) -> None:
        """Keep pooled buffers while pooled + open + late elements stay within the high-water mark of open
        + late elements (the largest pooled first). See [Note: staging pool]."""
        room = self._live_high - self._live
        if self._pooled > room:  # else every pooled buffer is kept
            kept = 0
            for index, buffer in enumerate(self._pool):
                if kept + buffer.numel() > room:
                    for dropped in self._pool[index:]:
                        self._drop_pooled(dropped)
                    del self._pool[index:]
                    break
                kept += buffer.numel()

    def _live_numel(self) -> int:
        """Elements of the open staging and late buffers (their whole allocations)."""
        return self._live

    # ---- reduction ------------------------------------------------------------------------------
    def _launch_ready(self) -> None:
        buckets = self.layout.buckets
        while self._next_launch < len(buckets):
            index = self._next_launch
            if self._is_active(index):
                if not (self._forced[index] or (self.launch_on_fill and self._pending[index] <= 0)):
                    break
                self._launch(buckets[index])
            self._next_launch += 1

    def _launch_all_remaining(self) -> None:
        while self._next_launch < len(self.layout.buckets):
            if self._is_active(self._next_launch):
                self._launch(self.layout.buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: Bucket, source: torch.Tensor | None = None) -> None:
        if self._awaiting[bucket.index]:  # See [Note: gradients in place]
            self._unset(bucket)
        while len(self._inflight) >= self.max_inflight:
            self._complete(*self._inflight.popleft())
        into = _ADD  # what the owned slice becomes at stages 2-3: See [Note: gradient stores]
        if source is None:
            source = self._fill_target(bucket)
            if self._fills_store(bucket):
                self._settle(bucket.index)
                into = _STORE
        comm = self.comms[bucket.partition]  # See [Note: bucket partitions] in layout.py
        if self.stage == 0:
            handle = comm.all_reduce(source, async_op=True)
        else:
            if self.grad_shard is not None and into == _ADD and not self._valid[bucket.index]:
                output, into = self._store_region(bucket), _DIRECT  # the first sums since zero(): no add
                self._valid[bucket.index] = True
            else:
                lo, hi = bucket.mine()
                output = source[lo:hi]
            scatter = self.scatter if bucket.partition == 0 else comm  # qgZ covers partition 0 (EP refuses qgZ)
            keyed = {} if scatter is comm else {"key": bucket.index}  # qgZ's error feedback
            handle = scatter.reduce_scatter(output, source, async_op=True, **keyed)
        self._inflight.append((bucket, handle, source, into))

    def _complete(self, bucket: Bucket, handle: Handle, source: torch.Tensor, into: str = _ADD) -> None:
        handle.wait()
        lo, hi = bucket.mine()
        if self.replicate is not None and self._late.get(bucket.index) is source:
            self.replicate.all_reduce(source[lo:hi])
        copied = self.sink.push(bucket, source[lo:hi]) if self.sink is not None else None
        if self.stage < 2:
            return
        if self.sink is None and into == _ADD:
            self._store_region(bucket).add_(source[lo:hi])
        staging = self._staging.get(bucket.index)
        if staging is not None and staging.data_ptr() == source.data_ptr():
            self._give_back(self._staging.pop(bucket.index), copied)
        elif self._late.get(bucket.index) is source:
            self._give_back(self._late.pop(bucket.index), copied)
        # (an accumulator is dropped whole once every bucket is reduced)

    def _wait_all(self) -> None:
        while self._inflight:
            self._complete(*self._inflight.popleft())

    def late_buckets(self) -> list[int]:
        """Buckets holding this rank's gradients that arrived after their bucket was launched (stage 3,
        rare): kept, summed over the step's backward passes, until ``reduce_late`` at the step."""
        return sorted(self._late)

    def reduce_late(self, indices: list[int]) -> None:
        """Reduce the late gradients of buckets ``indices`` into the store (collective: ``indices`` must be
        the same on every rank, the step check's flags; a rank without late gradients for one of them
        contributes zeros). See [Note: stage-3 step check] in stage3/step_check.py."""
        for index in indices:
            bucket = self.layout.buckets[index]
            source = self._late.get(index)
            if source is None:
                source = self._late[index] = self._take_buffer(bucket.padded)
            self._launch(bucket, source)
        self._wait_all()
        if indices and self.sink is not None:
            self.sink.drain()
        self._trim_pool()

    def reduce_pending(self) -> None:
        """Reduce whatever backward passes under ``no_sync`` left local (before a step or clip)."""
        if self._in_backward:
            self.abort_pass()
            raise RuntimeError(FAILED_PASS_MESSAGE)
        self.flush()
        if self.state is not GradState.LOCAL:
            return
        for bucket in self.layout.buckets:
            self._launch(bucket)
        self._wait_all()
        if self.sink is not None:
            self.sink.drain()
        self.accumulator = None
        self._trim_pool()
        self.state = GradState.REDUCED

    def add_local(self, grads: list[tuple[ParamSlot, torch.Tensor]]) -> None:
        """Add gradients computed outside autograd's accumulation (a zero-bubble weight pass) to the
        local store, to be reduced by the next ``reduce_pending()``. See [Note: gradient sums]."""
        if self._in_backward:
            raise RuntimeError("hfzero: gradients can be added by hand only between backward passes")
        self._zero_before_new_sums(every_bucket=True)
        if self.grad_full is None and self.accumulator is None:
            self.accumulator = torch.zeros(self.layout.total_padded, dtype=self.dtype, device=self.device)
        store = self.grad_full if self.grad_full is not None else self.accumulator
        for slot, grad in grads:
            start = self.layout.buckets[slot.bucket].offset + slot.offset
            self._write(store[start: start + slot.numel], grad, slot, store is self.grad_full)
        self._dirty = True
        self.state = GradState.LOCAL

    def reduce_added(self, grads: list[tuple[ParamSlot, torch.Tensor]]) -> None:
        """Reduce gradients computed outside autograd's accumulation (a zero-bubble weight pass) now, as a
        synchronizing backward pass would ("sharded": no full gradient is kept across micro-batches): every
        active bucket is filled from ``grads`` (zeros elsewhere) and reduced into the store, in bucket order.
        Collective over the dp group; every rank calls it at the same point of the schedule."""
        if self._in_backward:
            raise RuntimeError("hfzero: gradients can be added by hand only between backward passes")
        if self.state is GradState.LOCAL:
            raise RuntimeError("hfzero: local gradients are pending; reduce_pending() them before reduce_added()")
        if self.before_first_grad is not None:
            self.before_first_grad()
        self._zero_before_new_sums()
        if self.state is GradState.EMPTY and self.on_step_begin is not None:
            self.on_step_begin()
        by_bucket: dict[int, list[tuple[ParamSlot, torch.Tensor]]] = collections.defaultdict(list)
        for slot, grad in grads:
            if not self._is_active(slot.bucket):
                raise RuntimeError(f"hfzero: a gradient for {slot.name!r} arrived outside the buckets being reduced")
            by_bucket[slot.bucket].append((slot, grad))
        for bucket in self.layout.buckets:
            if not self._is_active(bucket.index):
                continue
            dest = self._fill_target(bucket)
            store = self._fills_store(bucket)
            for slot, grad in by_bucket.get(bucket.index, ()):
                self._write(dest[slot.offset: slot.offset + slot.numel], grad, slot, store)
            self._launch(bucket)
        self._wait_all()
        if self.sink is not None:
            self.sink.drain()
        self._trim_pool()
        self._dirty = True
        self.state = GradState.REDUCED

    def _write(self, dest: torch.Tensor, grad: torch.Tensor, slot: ParamSlot, store: bool) -> None:
        """Add a gradient computed by hand into its flat slot ``dest`` (copy it where ``dest`` is in the store
        and holds nothing of this step yet: See [Note: gradient stores])."""
        if store and slot not in self.used and not self._valid[slot.bucket]:
            dest.copy_(grad.reshape(-1))
        else:
            dest.add_(grad.reshape(-1))
        self.used.add(slot)

    # ---- recovery -------------------------------------------------------------------------------
    def abort_pass(self) -> None:
        """Forget a backward pass that raised before its end (its end-of-backward never ran) and every
        gradient of this step; wait for reductions already launched (each rank launched the same ones
        when every rank failed at the same point)."""
        self._wait_all()
        self._unset_all()
        self._expected = []
        for buffers in (self._staging, self._late):
            for buffer in buffers.values():
                self._give_back(buffer)
            buffers.clear()
        self._fired.clear()
        self._graph_roots, self._roots_complete = [], True
        self._in_backward = False
        self._dirty = True
        self.zero()

    # ---- access ---------------------------------------------------------------------------------
    def owned_grad(self, bucket: Bucket) -> torch.Tensor:
        """This rank's reduced gradient SUM for ``bucket`` (a view; valid in the REDUCED state): on the
        host, in fp32, when offloaded (the device keeps no copy at stages 2-3)."""
        if self.sink is not None:
            return self.sink.gradient(bucket)
        self._settle(bucket.index)
        if self.grad_shard is not None:
            return self.grad_shard[bucket.shard_offset: bucket.shard_offset + bucket.chunk]
        lo, hi = bucket.mine()
        return self.grad_full[bucket.offset + lo: bucket.offset + hi]

    def settled_shard(self) -> torch.Tensor | None:
        """The whole shard store (stages 2-3, not offloaded), every bucket's region settled (valid in the REDUCED
        state): the buckets' ``owned_grad`` views side by side at their ``shard_offset``; None at stages 0-1 or
        offloaded."""
        if self.sink is not None or self.grad_shard is None:
            return None
        self.settle_store()
        return self.grad_shard

    def zero(self) -> None:
        """Forget all gradients (the state becomes EMPTY); buffers stay allocated.

        Called while a backward pass that raised is still marked as running (``zero_grad()`` after an
        exception), it first aborts that pass, so training can go on with the next batch.
        """
        if self._in_backward:
            if graph_task_id() != -1:
                raise RuntimeError("hfzero: zero_grad() called during backward")
            self.abort_pass()
            return
        self.used.clear()
        self._graph_roots, self._roots_complete = [], True
        for param in self._arrived:  # deferred gradients no pass took: forgotten like every other
            param.grad = None
        self._arrived.clear()
        for buffer in self._late.values():  # late gradients of an abandoned step (stage 3)
            self._give_back(buffer)
        self._late.clear()
        if self.sink is not None:
            self.sink.reset()
        if not self._dirty:  # already zero (e.g. zero_grad() right after step(), which zeroed)
            return
        self._dirty = False
        if self.grad_full is not None or self.grad_shard is not None:  # no pass: See [Note: gradient stores]
            self._valid = [False] * len(self.layout.buckets)
        self.accumulator = None
        self.state = GradState.EMPTY

    def staging_bytes(self) -> int:
        """Bytes of staging buffers: pooled, open and late (GRAD_BUCKET)."""
        return (self._pooled + self._live) * self._element

    def accumulator_bytes(self) -> int:
        """Bytes of the full local accumulator held across micro-batches (GRAD_ACCUM), if any."""
        return 0 if self.accumulator is None else self.accumulator.numel() * self.accumulator.element_size()


_TWO_GRADIENTS = (
    "hfzero: a parameter received two gradients in one backward pass. Reentrant activation checkpointing "
    "(torch.utils.checkpoint with use_reentrant=True) does this; use use_reentrant=False (e.g. "
    "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})).")


def _reachable_params(roots: list[torch.autograd.graph.Node]) -> set[torch.Tensor]:
    """Leaf tensors whose AccumulateGrad nodes the autograd graph below ``roots`` reaches."""
    seen: set[torch.autograd.graph.Node] = set()
    params: set[torch.Tensor] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            params.add(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return params
