"""Stage3Engine: ZeRO stage 3 (P_os+g+p): parameters, gradients and optimizer states partitioned.

Memory held per rank (bf16 + Adam, Ψ trainable parameters of which P are persistent, N ranks):
- ``param_shard``: this rank's slice of every gathered bucket (PARAM_SHARD, 2(Ψ - P)/N).
- ``frozen_shard``: this rank's slice of the frozen parameters' buckets (PARAM_SHARD, 2Ψ_f/N); frozen
  parameters below the threshold stay whole model tensors (PARAM_FULL).

[Note: stage-3 frozen parameters]
Frozen parameters (``requires_grad=False``: a LoRA fine-tune's base weights) are partitioned like
trainable ones: they belong to the unit whose module holds them, are laid out in a layout of their
own (``frozen_layout``, per unit, padded like the trainable buckets) and gathered into the unit's full
buffer together with its trainable buckets, for forward and backward. They have no gradient, master
or optimizer state: the reducer and the optimizer only ever see ``layout``. Parameters below
``param_persistence_threshold`` stay whole on every rank, as trainable ones do. A unit is released in
backward when the backward pass reaches the next unit (a rank-independent point, after the gradients of
the unit's inputs, which its frozen weights serve, are computed), never when its gradient buckets
happen to be full; see scheduler.py.
- ``persistent_flat``: parameters below ``param_persistence_threshold``, whole on every rank
  (PARAM_FULL, 2P); the model's persistent parameters are views of it. Their gradients and
  optimizer states are sharded like the others'; after a step they are all-gathered.
- full buffers of the units gathered right now (PARAM_GATHERED, transient): the unit running
  forward or backward, the root (the whole forward and the whole backward), and prefetched units
  (the next unit whatever its size, more within ``prefetch_numel`` elements; at most
  ``config.stage3_gathered_numel`` in all); see unit.py and scheduler.py. Each unit's buffer keeps
  its storage for the engine's lifetime and has memory only while gathered (``gather_buffers``: see
  [Note: stage-3 gather buffers] in buffers.py).
- gradients, master weights, optimizer states: as at stage 2 (GRAD_SHARD 2Ψ/N, MASTER_SHARD 4Ψ/N,
  OPTIM_STATE 8Ψ/N, GRAD_BUCKET staging), the same code (engine.py, reducer.py, optimizer.py).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hfzero.comm.collectives import Communicator
from hfzero.config import ZeroConfig
from hfzero.logging import get_logger
from hfzero.comm.quantized import QuantizedReduceScatter
from hfzero.roles import MemoryRole
from hfzero.runtime.engine import ZeroEngine
from hfzero.runtime.layout import Bucket, FlatLayout
from hfzero.runtime.lifetime import WeakHook
from hfzero.runtime.stage3.buffers import GatherBuffers
from hfzero.runtime.stage3.scheduler import Phase, UnitScheduler
from hfzero.runtime.stage3.step_check import StepCheck
from hfzero.runtime.stage3.unit import GatherUnit, UnitState
from hfzero.runtime.stage3.units import UnitSpec, resolve_units
from hfzero.runtime.stage3.weights import WeightSource
from hfzero.runtime.tensors import local_tensor
from hfzero.runtime.torch_api import graph_task_id

logger = get_logger(__name__)

_PERSISTENT = -1
"""Unit key of the persistent parameters' buckets (they are never gathered)."""


def _gather_group_comms(comm: Communicator) -> tuple[Communicator, Communicator | None]:
    """The communicator for parameter gathers (the data-parallel one itself) and one for order checks
    (same group, its own ledger: checks are bookkeeping, not volume).

    [Note: one communicator per data-parallel group]
    Stage 3 runs its parameter all-gathers, its gradient reduce-scatters and its small checks on the
    data-parallel group's one process group, hence one NCCL communicator. Two communicators used at the
    same time are unsafe (NCCL documents it: their kernels may be scheduled in different orders on two
    ranks and wait on each other forever, even when every rank issues the same sequence), and the second
    group used to be made with local synchronization (``use_local_synchronization``), which hangs once
    the default group is bound to a device and split. FSDP2 made the same choice: one process group, the all-gathers and
    reduce-scatters ordered on their streams. On one communicator every collective runs in issue order,
    and the issue order is already the same on every rank (gathers at the recorded order's points,
    reductions at rank-independent points: [Note: collective order across ranks] in reducer.py), so the
    order on the wire is the same too. The cost: a prefetch gather issued after a unit's reduce-scatter
    waits for it (both still overlap compute, which runs on the compute stream). No process group is
    created here, so no rank can skip one (tests/test_stage3_comm_order.py). The one exception is expert
    parallelism, whose expert buckets are gathered and reduced over the edp group beside the world's dense ones
    ([Note: bucket partitions] in layout.py): both groups see their collectives in the one bucket and unit
    order every rank shares, but they are two communicators (run on gloo only so far).
    """
    if comm.world_size == 1:
        return comm, None
    return comm, comm.on_group(comm.group, share_stats=False)


class Stage3Engine(ZeroEngine):
    """The stage-0-2 engine with parameters kept as flat shards and gathered per unit around use."""

    def __init__(self, model: nn.Module, param_groups: list[list[nn.Parameter]], config: ZeroConfig,
                 comm: Communicator, device: torch.device, *, units: Sequence[str] | None = None,
                 verify_gather_order: bool = True, weights: WeightSource | None = None,
                 average_over: int | None = None, expert_comm: Communicator | None = None,
                 replicate: Communicator | None = None, secondary: Communicator | None = None,
                 grad_reduce: QuantizedReduceScatter | None = None):
        self._weights = weights  # see [Note: stage-3 sharded construction] in weights.py
        trainable = {p for group in param_groups for p in group if p.requires_grad}
        # See [Note: stage-3 frozen parameters]
        self._frozen = [p for p in dict.fromkeys(model.parameters()) if not p.requires_grad]
        self.unit_specs: list[UnitSpec] = resolve_units(model, units, trainable | set(self._frozen))
        self._unit_of: dict[nn.Parameter, int] = {}
        for spec in self.unit_specs:
            for p in spec.params:
                persistent = local_tensor(p).numel() < config.param_persistence_threshold
                self._unit_of[p] = _PERSISTENT if persistent else spec.index
        self.gather_comm, verify_comm = _gather_group_comms(comm)
        self.secondary = secondary if secondary is not None and secondary.world_size > 1 else None
        """hpZ: the node's communicator for backward gathers from the secondary partition (None: off). See
        [Note: secondary partition] in unit.py."""
        self._verify_gather_order = verify_gather_order
        super().__init__(model, param_groups, config, comm, device, average_over=average_over,
                         expert_comm=expert_comm, replicate=replicate, grad_reduce=grad_reduce)
        self.gather_buffers = GatherBuffers(self.policy.param_dtype, device, config.stage3_buffers)
        """Makes the units' full buffers; ``kind`` says their backing (See [Note: stage-3 gather buffers])."""
        self.units = [self._make_unit(spec) for spec in self.unit_specs]
        partitioned_frozen = set(self.frozen_layout.slots)
        whole = [p for p in dict.fromkeys(model.parameters()) if p not in self.layout.slots and p not in partitioned_frozen]
        self._untracked_param_bytes = sum(p.numel() * p.element_size() for p in whole)  # PARAM_FULL, never resized
        self.num_frozen_params = self.frozen_layout.num_params + sum(p.numel() for p in whole)
        """Parameters outside the optimizer's layout (frozen ones): partitioned, or whole when persistent."""
        self.num_persistent_params = sum(b.numel for b in self._persistent_buckets()) + sum(p.numel() for p in whole)
        """Parameters kept whole on every rank: trainable ones below the threshold (flat) and ``whole``."""
        self.num_frozen_persistent_params = sum(p.numel() for p in whole)
        # sized by everything that is gathered (a LoRA model's trainable count alone would be tiny)
        self.prefetch_numel = config.prefetch_numel(self.num_params + self.frozen_layout.num_params, self.world_size)
        """Stage-3 prefetch budget in elements (``ZeroConfig.prefetch_numel``: sized to the model unless set)."""
        self.scheduler = UnitScheduler(self.units, verify_comm if verify_gather_order else None, self.prefetch_numel)
        self.installed.on_undo(self.scheduler.remove_hooks)
        # See [Note: collective order across ranks] in reducer.py
        self.reducer.launch_on_fill = False
        check = self.check_comm
        self.step_check = None if check.world_size == 1 else StepCheck(check.on_group(check.group, share_stats=False),
                                                                       len(self.layout.buckets),
                                                                       replicate=self._check_replicas())
        """The step's one check collective (gather order, late gradients): See [Note: stage-3 step check]."""
        # See [Note: gradients collected at rank-independent points] and [Note: gradients in place] in reducer.py
        self.reducer.defer_hooks()
        self._persistent = self._persistent_buckets()
        self.scheduler.on_backward_begin = self._backward_begins
        self.scheduler.on_unit_backward = self._unit_reached
        self.scheduler.on_unit_done = self._unit_done
        self.scheduler.on_backward_end = lambda: self.reducer.collect()
        self._partitioned = {p for p, unit in self._unit_of.items() if unit != _PERSISTENT}
        self.allow_partitioned_state_dict = False
        # On every module that owns a partitioned parameter, so a submodule's state_dict() is refused
        # too; a WeakHook, not a bound method (torch tags the hook object; See [Note: engine lifetime]).
        for module in model.modules():
            if any(p in self._partitioned for p in module.parameters(recurse=False)):
                self.installed.handle(module.register_state_dict_post_hook(WeakHook(self._refuse_empty_state_dict)))
        logger.info("stage 3: %d unit(s), %d persistent parameter(s) (< %d elements each kept whole)",
                    len(self.units), self.num_persistent_params, config.param_persistence_threshold)

    def _refuse_empty_state_dict(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        """``model.state_dict()`` would hold 0-element tensors for partitioned parameters: refuse it
        (a saved model must never come out empty). See [Note: stage-3 state_dict]."""
        if self.allow_partitioned_state_dict:
            return
        empty = [prefix + n for n, p in module.named_parameters(recurse=False)
                 if p in self._partitioned and local_tensor(p).numel() == 0]
        if empty:
            raise RuntimeError(
                f"hfzero stage 3: model.state_dict() would return {len(empty)} empty (partitioned) tensor(s), e.g. "
                f"{empty[0]!r}, and a model saved from it would be empty. Call hfzero.full_state_dict(model) on "
                "every rank (rank 0 receives the full tensors) and pass it on, e.g. "
                "model.save_pretrained(dir, state_dict=full_sd) on rank 0.")

    # ---- construction ---------------------------------------------------------------------------
    def _backward_positions(self) -> dict[nn.Parameter, int]:
        """Unit by unit in backward order: the last block first, the root, then the persistent parameters."""
        registration = super()._backward_positions()
        rank_of_unit = {spec.index: len(self.unit_specs) - spec.index for spec in self.unit_specs}
        rank_of_unit[0] = len(self.unit_specs)
        rank_of_unit[_PERSISTENT] = len(self.unit_specs) + 1
        stride = len(registration) + 1
        return {p: rank_of_unit[self._unit_of[p]] * stride + pos if p in self._unit_of else pos
                for p, pos in registration.items()}

    def _bucket_unit_of(self) -> Callable[[nn.Parameter], Hashable]:
        return self._unit_of.__getitem__

    def _backward_begins(self) -> None:
        """A backward pass starts: take, as a pass of their own, gradients of an earlier backward that reached no unit;
        remember the persistent parameters' buckets, pointed at their slots when the reducer's pass starts."""
        self.reducer.flush()
        self.reducer.expect(self._persistent, new_pass=True)

    def _unit_reached(self, unit: GatherUnit) -> None:
        """The backward pass reached ``unit``, gathered: take the gradients that arrived (the first ones start the
        reducer's pass), then point the unit's parameters' gradients at their staging slots."""
        self.reducer.collect()
        self.reducer.expect(unit.buckets)

    def _unit_done(self, unit: GatherUnit) -> None:
        """The backward pass is done with ``unit`` (a rank-independent point): take the gradients that arrived,
        then launch the unit's reductions."""
        self.reducer.collect()
        self.reducer.force_ready(unit.buckets)

    def _persistent_buckets(self) -> list[Bucket]:
        return [b for b in self.layout.buckets if self._unit_of[b.slots[0].param] == _PERSISTENT]

    def _build_frozen_layout(self) -> FlatLayout:
        """Buckets of the partitioned frozen parameters, per unit, in backward order (no gradients: the
        reducer and the optimizer never see this layout); see [Note: stage-3 frozen parameters]."""
        order = self._backward_positions()
        names = {p: n for n, p in self.model.named_parameters()}
        frozen = sorted((order[p], names[p], p) for p in self._frozen if self._unit_of.get(p, _PERSISTENT) != _PERSISTENT)
        return FlatLayout([frozen], self.bucket_numel, self.world_size, self.rank,
                          unit_of=self._unit_of.__getitem__, **self._partitioning())

    def _place_frozen(self) -> None:
        """This rank's slice of every frozen bucket (PARAM_SHARD); the unit gathers the rest when it runs."""
        self.frozen_layout = self._build_frozen_layout()
        self.frozen_shard = torch.zeros(self.frozen_layout.shard_numel, dtype=self.policy.param_dtype,
                                        device=self.device)
        self._frozen_views: dict[int, torch.Tensor] = {}
        for bucket in self.frozen_layout.buckets:
            lo, hi = bucket.mine()
            full = None if self._weights is not None else self._broadcast_bucket(bucket)
            view = self._frozen_views[bucket.index] = self.frozen_shard[bucket.shard_offset: bucket.shard_offset + bucket.chunk]
            self._fill(bucket, lo, hi, view, full)

    def _broadcast_untracked(self) -> None:
        """Rank 0's buffers and whole parameters outside both layouts (frozen ones below the threshold)."""
        if self.world_size == 1 and self.replicate is None:
            return
        placed = set(self.layout.slots) | set(self.frozen_layout.slots)
        for p in dict.fromkeys(self.model.parameters()):
            if p not in placed:
                self._broadcast(local_tensor(p).data, self._partition_of(p))
        for b in self.model.buffers():
            self._broadcast(b)

    def _place_params(self) -> None:
        """Sync each bucket from rank 0, keep this rank's slice (or all of a persistent bucket)."""
        self._place_frozen()
        dtype = self.policy.param_dtype
        persistent = self._persistent_buckets()
        gathered = [b for b in self.layout.buckets if b not in persistent]
        self.param_shard = torch.zeros(sum(b.chunk for b in gathered), dtype=dtype, device=self.device)
        self.persistent_flat = torch.zeros(sum(b.padded for b in persistent), dtype=dtype, device=self.device)
        self._shard_views: dict[int, torch.Tensor] = {}
        self._persistent_full: dict[int, torch.Tensor] = {}
        shard_at = full_at = 0
        for bucket in self.layout.buckets:
            lo, hi = bucket.mine()
            full = None if self._weights is not None else self._broadcast_bucket(bucket)
            if bucket in persistent:
                kept = self.persistent_flat[full_at: full_at + bucket.padded]
                self._fill(bucket, 0, bucket.padded, kept, full)
                for slot in bucket.slots:
                    local_tensor(slot.param).data = kept[slot.offset: slot.offset + slot.numel].view(slot.shape)
                self._persistent_full[bucket.index] = kept
                self._shard_views[bucket.index] = kept[lo:hi]
                full_at += bucket.padded
            else:
                self._shard_views[bucket.index] = self.param_shard[shard_at: shard_at + bucket.chunk]
                self._fill(bucket, lo, hi, self._shard_views[bucket.index], full)
                shard_at += bucket.chunk
        self._broadcast_untracked()

    def _broadcast_bucket(self, bucket: Bucket) -> torch.Tensor:
        """Rank 0's values of the whole bucket (transient, one bucket), over its partition's group."""
        full = torch.zeros(bucket.padded, dtype=self.policy.param_dtype, device=self.device)
        for slot in bucket.slots:
            full[slot.offset: slot.offset + slot.numel].copy_(local_tensor(slot.param).detach().reshape(-1))
        self._broadcast(full, bucket.partition)
        return full

    def _fill(self, bucket: Bucket, lo: int, hi: int, out: torch.Tensor, full: torch.Tensor | None) -> None:
        """Elements [lo, hi) of ``bucket`` into ``out``: from the broadcast bucket or the weight source."""
        if full is None:
            self._weights.fill(bucket, lo, hi, out)
        else:
            out.copy_(full[lo:hi])

    def _make_unit(self, spec: UnitSpec) -> GatherUnit:
        buckets = [b for b in self.layout.buckets if self._unit_of[b.slots[0].param] == spec.index]
        frozen = [b for b in self.frozen_layout.buckets if self._unit_of[b.slots[0].param] == spec.index]
        return GatherUnit(spec.index, spec.name, spec.module, [(b, self._shard_views[b.index]) for b in buckets],
                          [(b, self._frozen_views[b.index]) for b in frozen], self.param_gathers,
                          self.policy.param_dtype, self.device, self.gather_buffers, secondary=self.secondary)

    def _owned_param(self, bucket: Bucket) -> torch.Tensor:
        return self._shard_views[bucket.index]

    def finish_step(self) -> None:
        """As at stages 0-2; a forward or backward pass that raised is forgotten (units released) too."""
        if self.scheduler.phase is not Phase.IDLE and graph_task_id() == -1:
            self.scheduler.abort_pass()
        super().finish_step()

    # ---- step -----------------------------------------------------------------------------------
    def _check_step(self, overflow: torch.Tensor | None) -> bool:
        """One all-reduce and one host read per step (world > 1): every training pass since the last step
        gathered the same units on every rank (else GatherOrderError on every rank), the buckets with late
        gradients on any rank are reduced, and (fp16) whether any rank's gradients overflowed is returned.
        See [Note: stage-3 step check] in step_check.py."""
        late = self.reducer.late_buckets()
        overflowed = None
        if self.step_check is not None:
            agreed, late, overflowed = self.step_check.run(self.scheduler.fingerprint, late, overflow)
            self.scheduler.end_step_check(agreed)
        self.reducer.reduce_late(late)
        if overflow is not None and (overflowed is None or late):  # world 1, or sums the flag did not see
            return super()._check_step(self._overflow_flag() if late else overflow)
        return bool(overflowed)

    def publish_params(self) -> None:
        """Copy master slices into the parameter shard; all-gather only the persistent parameters.

        Partitioned parameters stay sharded after the step: the next forward gathers them. Offloaded,
        the copies into the shard are asynchronous and every later gather is ordered after them (see
        [Note: offload copies]).
        """
        self.scheduler.release_all()
        if self.offload is not None:
            self.offload.begin_upload()
            for bucket, master in zip(self.layout.buckets, self.master_views):
                self.offload.upload(bucket, master, self._owned_param(bucket))
        elif self.policy.separate_master:
            for bucket, master in zip(self.layout.buckets, self.master_views):
                self._owned_param(bucket).copy_(master)
        handles = [self.param_gathers[b.partition].all_gather(  # its partition's group: [Note: bucket partitions]
                       self._persistent_full[b.index], self._shard_views[b.index], async_op=True)
                   for b in self._persistent_buckets()]
        for handle in handles:
            handle.wait()

    # ---- unprepare ------------------------------------------------------------------------------
    def whole_params(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """As at stages 0-2, for the persistent parameters (views of ``persistent_flat``) and every partitioned one,
        trainable and frozen: each unit is gathered (exactly, even with qwZ), its parameters copied, and released
        again, one unit at a time. A collective over the group: every rank calls it at the same point."""
        self.scheduler.release_all()
        out = [(local, local.detach().clone()) for local in (local_tensor(slot.param) for bucket in
                                                              self._persistent_buckets() for slot in bucket.slots)]
        for unit in self.units:
            self.scheduler.gather_now(unit)
            out.extend((local, local.detach().clone()) for local in map(local_tensor, unit.params))
            unit.release()
        return out

    # ---- introspection --------------------------------------------------------------------------
    def memory_by_role(self) -> dict[MemoryRole, int]:
        """Bytes by role; adds PARAM_SHARD, persistent PARAM_FULL and PARAM_GATHERED to the stage-2 roles."""
        roles = super().memory_by_role()
        element = self.param_shard.element_size()
        extra = {
            MemoryRole.PARAM_SHARD: (self.param_shard.numel() + self.frozen_shard.numel()) * element,
            MemoryRole.PARAM_FULL: roles.get(MemoryRole.PARAM_FULL, 0) + self.persistent_flat.numel() * element,
            MemoryRole.PARAM_GATHERED: sum(u.resident_bytes() for u in self.units),
            MemoryRole.PARAM_SECONDARY: sum(u.secondary_bytes() for u in self.units),
        }
        roles.update(extra)
        return {role: size for role, size in roles.items() if size}

    def frozen_shape(self, param: nn.Parameter) -> torch.Size | None:
        """The whole shape of a partitioned frozen parameter (None for any other tensor)."""
        slot = self.frozen_layout.slots.get(param)
        return slot.shape if slot is not None else None

    def load_frozen(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """Write this rank's slice of ``value`` (the whole parameter) into the frozen shard."""
        slot = self.frozen_layout.slots[param]
        bucket = self.frozen_layout.buckets[slot.bucket]
        lo, hi = bucket.mine()
        start, stop = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if start < stop:
            flat = value.reshape(-1)[start - slot.offset: stop - slot.offset]
            self._frozen_views[bucket.index][start - lo: stop - lo].copy_(flat)

    def gather_frozen(self, keep: bool) -> dict[nn.Parameter, torch.Tensor]:
        """CPU copies of the partitioned frozen parameters, gathered one unit at a time (a collective;
        only ranks with ``keep`` get the copies)."""
        whole: dict[nn.Parameter, torch.Tensor] = {}
        for unit in self.units:
            if not unit.has_frozen:
                continue
            was_sharded = unit.state is UnitState.SHARDED
            self.scheduler.gather_now(unit)
            if keep:
                whole.update((p, p.detach().to("cpu", copy=True)) for p in unit.params if p in self.frozen_layout.slots)
            if was_sharded:
                unit.release()
        return whole

    def full_numel(self, param: nn.Parameter) -> int:
        """Elements of ``param`` when whole (a partitioned parameter is a 0-element tensor between uses;
        a DTensor's ``numel()`` is its global size already)."""
        if isinstance(param, DTensor):
            return param.numel()
        slot = self.layout.slots.get(param) or self.frozen_layout.slots.get(param)
        return slot.numel if slot is not None else param.numel()

    def trace(self, enabled: bool = True) -> list[tuple[str, str]] | None:
        """Record gather/release events (see UnitScheduler.events); returns the live event list."""
        self.scheduler.trace(enabled)
        return self.scheduler.events
