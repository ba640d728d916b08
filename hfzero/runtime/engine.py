"""ZeroEngine: one data-parallel group's parameters, gradients and master shard for stages 0-2.

Memory held (bf16 + Adam, Ψ trainable parameters, N ranks), matching the paper:
- ``param_flat``: all trainable parameters, full, in the device dtype (PARAM_FULL, 2Ψ); the model's
  parameters are views into it (contiguous pre-allocated storage, ZeRO-R MD).
- gradients: see reducer.py (GRAD_FULL 2Ψ at stages 0-1, GRAD_SHARD 2Ψ/N at stage 2; under the
  "local" accumulation policy at stage 2, also GRAD_ACCUM 2Ψ while micro-batches accumulate).
- ``master_flat``: fp32 master weights of this rank's slice (MASTER_SHARD, 4Ψ/N; 4Ψ at stage 0),
  only when a separate master copy is needed (mixed precision or offload).
- optimizer states of the inner optimizer over the master slices (OPTIM_STATE, 8Ψ/N with Adam).
- ``master_grad_flat``: fp32 gradients of the slice between the end of accumulation and the end of
  the step (GRAD_FP32, transient, 4Ψ/N).
- with ``offload_optimizer`` on an accelerator (``offload``): master weights, optimizer states and the
  slice's fp32 gradients live in (pinned) host memory, and stages 2-3 keep no gradient shard on the
  device; see runtime/offload.py and [Note: offload copies]. ``host_memory_by_role`` says which bytes.

[Note: average_over]
The reducer stores gradient SUMS over the engine's group ([Note: gradient sums] in reducer.py); the step
divides them by ``average_over``, the number of data-parallel ranks whose batches the step averages. By
default that is the group's size (times the replicas under HSDP, whose replicate group sums them further).
Under expert parallelism (parallel/expert.py) the engine's group is the whole world, every rank
reading its own batch, and the experts (``expert_comm``) are a second partition of the layout, sharded and
reduced over the expert-data-parallel group ([Note: bucket partitions] in layout.py): a dense gradient is
the world's reduce-scatter (or all-reduce), a sum over the world; an expert's gradient is the sum over the
world of its tokens' contributions too (the all-to-all brought it the tokens of its EP group's ranks and the
edp reduction adds the other EP groups'), so both are divided by the world size, the default. Under
sequence parallelism the divisor is smaller than the group: the engine shards over the whole world, but
the S ranks of an SP group train on parts of the same sequences, so the step averages over world / S
replicas ([Note: sequence-parallel gradients] in parallel/sequence/loss.py).

[Note: hierarchical sharding]
With a ``replicate`` communicator (HSDP / MiCS, ``ZeroConfig.shard_size``; the groups
resolved by ``hfzero.prepare`` in parallel/data_parallel.py) ``comm`` is the rank's shard group: the layout, the buckets, the
reduce-scatters, stage 3's gathers and the post-step all-gather all run inside it, exactly as flat ZeRO
over a world of G ranks, so each rank holds 1/G of the sharded model states. The replicate group joins the
ranks holding the same shard; once per optimizer step (``materialize_grads``, after every micro-batch's
reduction into the shard, whatever the accumulation policy) the owned gradient sums are all-reduced over
it, so each shard holds the sum over the whole data-parallel world. Stage 3's late gradients (reduced at
the step check) are all-reduced over it as they are added (reducer.py). Hence:
- ``average_over`` (the divisor of the summed gradients) is the data-parallel world, G x replicas, not G;
- the initial state is broadcast from shard rank 0 inside each shard group, then from replicate rank 0
  across the replicate group: everyone ends with global dp rank 0's values;
- the step's checks (agreement, fp16 overflow, stage 3's gather order and late flags) MAX-reduce inside the
  shard group, then once more over the replicate group before their one host read: the whole world agrees;
- with the optimizer offloaded (ZeRO-Offload), the owned sums are the host's fp32 copy: they are all-reduced over
  the replicate group there (CPU, gloo) or staged through the device one bucket slice at a time (an accelerator);
- the gradient norm sums inside the shard group only: the replicas' shards are equal, each parameter
  element is counted once;
- checkpoints are written by replicate rank 0's shard group (the other replicas write RNG states only).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hfzero.comm.collectives import Communicator
from hfzero.config import ZeroConfig
from hfzero.logging import get_logger
from hfzero.comm.quantized import QuantizedGather, QuantizedReduceScatter
from hfzero.roles import MODEL_STATE_ROLES, MemoryRole
from hfzero.runtime.agreement import StepAgreement
from hfzero.runtime.compile import eager_hook
from hfzero.runtime.layout import FlatLayout, Partition
from hfzero.runtime.lifetime import Installed, WeakHook
from hfzero.runtime.offload import HostOffload, offload_active
from hfzero.runtime.precision import LossScaler, PrecisionPolicy
from hfzero.runtime.reducer import GradientReducer, GradState
from hfzero.runtime.tensors import is_replicated_over_tp, local_tensor, scale_

logger = get_logger(__name__)

_LATE_BACKWARD = ("hfzero: backward after clip_grad_norm_() and before step(): gradients of this step were already "
                  "finalized; call step() (or zero_grad()) first")


UNPREPARED = ("hfzero: this model was unprepared (hfzero.unprepare): its engine and sharded optimizer are gone. Build "
              "a new optimizer over model.parameters() (and call hfzero.prepare again to train with ZeRO)")
"""The error of any use of an engine, or of its ZeroOptimizer, after ``unprepare``."""


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class ZeroEngine:
    """Flattens, shards and updates the trainable parameters of ``model`` over ``comm``'s group."""

    def __init__(self, model: nn.Module, param_groups: list[list[nn.Parameter]], config: ZeroConfig,
                 comm: Communicator, device: torch.device, *, bucket_units: Sequence[str] | None = None,
                 average_over: int | None = None, expert_comm: Communicator | None = None,
                 replicate: Communicator | None = None, grad_reduce: QuantizedReduceScatter | None = None):
        self.model = model
        self.installed = Installed()
        """Every hook and attribute the engine and ``prepare`` put on the user's objects, undone by ``unprepare``
        (See [Note: engine lifetime] in lifetime.py)."""
        self.replicate = replicate if replicate is not None and replicate.world_size > 1 else None
        """HSDP: the ranks holding the same shard as this one (None: flat). See [Note: hierarchical sharding]."""
        replicas = self.replicate.world_size if self.replicate is not None else 1
        self.average_over = average_over if average_over is not None else comm.world_size * replicas
        """How many data-parallel ranks' summed gradients the step averages: the divisor of the gradient sums.
        Default: every rank the sums span (the group, times its replicas under HSDP); fewer where ranks of the
        group train on the same samples (the S ranks of a sequence-parallel group). See [Note: average_over]."""
        self._bucket_units = bucket_units
        """Stages 0-2: module names whose parameters never share a bucket with another's (prepare's ``units=``)."""
        self.config = config
        self.comm = comm
        self.expert_comm = expert_comm
        """Expert parallelism: the expert-data-parallel group, over which the parameters that are DTensor shards
        (the experts, whose local tensors differ between EP ranks) are sharded and reduced; ``comm`` (the world)
        shards the others. None otherwise. See [Note: bucket partitions] in layout.py."""
        self.partition_comms: list[Communicator] = [comm] if expert_comm is None else [comm, expert_comm]
        """The communicator of each layout partition (``Bucket.partition`` indexes it)."""
        self.param_gathers: list[Communicator | QuantizedGather] = [
            QuantizedGather(c, config.quantize_weights, config.quantize_block) if config.quantize_weights else c
            for c in self.partition_comms]
        """What each partition's parameter all-gathers run through: its communicator, or qwZ's block-quantized
        gather over it (See [Note: quantized collectives] in hfzero/comm/quantized.py)."""
        self.param_gather = self.param_gathers[0]
        self.device = device
        self.stage = config.stage
        self.rank = comm.rank
        self.world_size = comm.world_size
        offload = offload_active(config.offload_optimizer, device, comm.rank)
        self.policy = PrecisionPolicy.from_config(config, device, offload=offload)
        self.scaler = LossScaler(config)
        self.optimizer: torch.optim.Optimizer | None = None  # the inner optimizer, set by ZeroOptimizer
        self.zero_optimizer: Callable[[], Any] | None = None
        """A weak reference to the ZeroOptimizer over this engine (set by it), for ``unprepare``."""
        self._scaled_backward = False
        self._materialized = False
        self.overflow = False
        self._untracked_param_bytes: int | None = None
        self.unused_ranges: list[tuple[int, int, int]] = []
        self.norm_group: Communicator | None = None
        """The tensor-parallel group (set by prepare with a dp x tp mesh): the gradient norm spans it too."""
        self.check_comm = comm
        """The group whose ranks must agree on every step (step agreement, stage 3's step check, fp16's
        overflow flag): the engine's own group (the whole world under expert parallelism)."""
        self.checkpoint_staging: torch.Tensor | None = None
        """Host bytes an asynchronous checkpoint save copies this rank's shard into (hfzero/checkpoint/staging.py):
        allocated at the first such save and reused by the next, so held across steps (CKPT_STAGING)."""
        self.checkpoint_copy: Any = None
        """An asynchronous save's copies of the master and optimizer-state slices still running on its background
        thread (a ``StagedCopies``), or None: the next optimizer step waits for them (``wait_checkpoint_copy``)."""

        self.layout = self._build_layout(param_groups)
        self.num_params = self.layout.num_params
        self.num_params_padded = self.layout.total_padded
        self.param_flat: torch.Tensor | None = None
        self._place_params()

        self.offload: HostOffload | None = None
        """The host side of the shard when the optimizer is offloaded (see runtime/offload.py), else None."""
        if offload:
            self.offload = HostOffload(self.layout, device, self.policy.param_dtype, accumulate=self.stage >= 2,
                                       master_dtype=self.policy.master_dtype)
        self.master_flat: torch.Tensor | None = None
        self.master_grad_flat: torch.Tensor | None = None
        self._factor_cache: tuple[float, torch.Tensor] | None = None
        if self.policy.separate_master:
            if self.offload is not None:
                self.master_flat = self.offload.empty_master(self.layout.shard_numel, self.policy.master_dtype)
            else:
                self.master_flat = torch.empty(self.layout.shard_numel, dtype=self.policy.master_dtype,
                                               device=self.policy.master_device)
            for bucket in self.layout.buckets:
                self._master_view(bucket).copy_(self._owned_param(bucket))
        self.master_views = [self._master_view(b) for b in self.layout.buckets]

        self.accumulation = config.accumulation_policy
        """The accumulation policy that runs ("sharded" or "local"); see [Note: accumulation policy]."""
        self.reducer = GradientReducer(self.layout, comm, self.stage, self.policy.param_dtype, device,
                                       config.overlap_comm, config.max_inflight_buckets, self.accumulation,
                                       sink=self.offload, comms=self.partition_comms)
        self.reducer.before_first_grad = self._before_backward
        self.reducer.always_find_unused = config.find_unused_parameters
        self.reducer.replicate = self.replicate
        if grad_reduce is not None:  # qgZ: See [Note: quantized collectives]
            self.reducer.scatter = grad_reduce
        self.installed.on_undo(self.reducer.remove_hooks)
        # an eager hook: a graph boundary under torch.compile (See [Note: compiled regions] in runtime/compile.py);
        # weak: it never keeps the engine alive (See [Note: engine lifetime] in lifetime.py)
        self.installed.handle(model.register_forward_hook(eager_hook(WeakHook(self._record_graph_roots))))
        self.agreement: StepAgreement | None = None
        if self.stage < 3 and self.check_comm.world_size > 1:  # See [Note: step agreement] in agreement.py
            self.agreement = StepAgreement(model, self.check_comm.on_group(self.check_comm.group, share_stats=False),
                                           replicate=self._check_replicas())
            self.installed.handle(self.agreement.hook)
            self.reducer.on_step_begin = self.agreement.launch
        logger.info("stage %d over %d rank(s): %d trainable parameters in %d bucket(s) of <= %d elements, %d padded, "
                    "dtype %s, accumulation %s", self.stage, self.world_size, self.num_params, len(self.layout.buckets),
                    self.bucket_numel, self.num_params_padded, config.dtype, self.accumulation)
        if self.offload is not None:
            logger.info("optimizer offloaded: master weights, optimizer states and fp32 gradients of the shard in "
                        "host memory; %d bytes pinned (%s); host step on %d thread(s)", self.offload.pinned_bytes(),
                        ", ".join(k for k, v in self.offload.pin_plan.items() if v and self.offload.pinned) or "none",
                        self.offload.step_threads)

    def _record_graph_roots(self, module: nn.Module, args: Any, output: Any) -> None:
        """The model's forward hook: remember the output's autograd roots (the reducer's unused-parameter lookup)."""
        self.reducer.record_graph_roots(output)

    def _check_replicas(self) -> Communicator | None:
        """HSDP: the replicate group with a ledger of its own, for the step's checks (bookkeeping, not volume)."""
        return None if self.replicate is None else self.replicate.on_group(self.replicate.group, share_stats=False)

    # ---- construction steps (overridden by the stage-3 engine) ----------------------------------
    def _backward_positions(self) -> dict[nn.Parameter, int]:
        """Each parameter's expected position in backward: reverse registration order."""
        names: dict[nn.Parameter, str] = {}
        for name, p in self.model.named_parameters():
            names.setdefault(p, name)
        return {p: len(names) - i for i, p in enumerate(names)}

    def _build_layout(self, param_groups: list[list[nn.Parameter]]) -> FlatLayout:
        """Buckets of the trainable parameters; see [Note: bucket sharding] in layout.py."""
        order = self._backward_positions()
        names = {p: n for n, p in self.model.named_parameters()}
        groups = [sorted(((order[p], names[p], p) for p in group if p.requires_grad), key=lambda t: t[0])
                  for group in param_groups]
        shard_world = 1 if self.stage == 0 else self.world_size
        num_params = sum(p.numel() for group in groups for _, _, p in group)
        self.bucket_numel = self.config.bucket_numel(num_params, self.world_size)
        """Elements per gradient bucket (``ZeroConfig.bucket_numel``: sized to the model unless set)."""
        return FlatLayout(groups, self.bucket_numel, shard_world, self.rank,
                          unit_of=self._bucket_unit_of(), **self._partitioning())

    def _partitioning(self) -> dict[str, Any]:
        """The layout's partitions under expert parallelism (dense parameters over ``comm``, the world; DTensor
        shards over ``expert_comm``); none otherwise. See [Note: bucket partitions] in layout.py."""
        if self.expert_comm is None:
            return {}
        return {"partitions": [Partition(c.world_size, c.rank, self.stage > 0) for c in self.partition_comms],
                "partition_of": lambda p: 0 if is_replicated_over_tp(p) else 1}

    def _bucket_unit_of(self) -> Callable[[nn.Parameter], Hashable] | None:
        """The unit of each parameter (buckets never span two units): at stages 0-2 the index of the first of
        ``bucket_units`` holding it (-1 for none), or None without them; stage 3 overrides it."""
        if not self._bucket_units:
            return None
        unit_of: dict[nn.Parameter, int] = {}
        for index, name in enumerate(self._bucket_units):
            for p in self.model.get_submodule(name).parameters():
                unit_of.setdefault(p, index)
        return lambda p: unit_of.get(p, -1)

    def _place_params(self) -> None:
        """Move the trainable parameters into ``param_flat`` (full, PARAM_FULL) and sync them from rank 0."""
        self.param_flat = torch.zeros(self.layout.total_padded, dtype=self.policy.param_dtype, device=self.device)
        for slot in self.layout.slots.values():
            bucket = self.layout.buckets[slot.bucket]
            view = self.param_flat[bucket.offset + slot.offset: bucket.offset + slot.offset + slot.numel]
            local = local_tensor(slot.param)  # See [Note: tensor-parallel parameters] in parallel/tensor.py
            view.copy_(local.detach().reshape(-1))
            local.data = view.view(slot.shape)
        self._broadcast_initial_state()

    # ---- views ----------------------------------------------------------------------------------
    def _owned_param(self, bucket) -> torch.Tensor:
        lo, hi = bucket.mine()
        return self.param_flat[bucket.offset + lo: bucket.offset + hi]

    def _master_view(self, bucket) -> torch.Tensor:
        if self.master_flat is None:
            return self._owned_param(bucket)
        return self.master_flat[bucket.shard_offset: bucket.shard_offset + bucket.chunk]

    def _broadcast(self, tensor: torch.Tensor, partition: int = 0) -> None:
        """``tensor`` from data-parallel rank 0 to every rank: inside the shard group, then (HSDP) across the
        replicate group (See [Note: hierarchical sharding]); a tensor of another layout partition (an expert)
        from rank 0 of its partition's group (See [Note: bucket partitions] in layout.py)."""
        if partition:
            self.partition_comms[partition].broadcast(tensor)
            return
        self.comm.broadcast(tensor)
        if self.replicate is not None:
            self.replicate.broadcast(tensor)

    def _partition_of(self, param: torch.Tensor) -> int:
        """The layout partition a parameter outside the layout would belong to (0 without expert parallelism)."""
        return 0 if self.expert_comm is None or is_replicated_over_tp(param) else 1

    def _broadcast_initial_state(self) -> None:
        """Start every rank from rank 0's parameters and buffers, as DDP does (each bucket from rank 0 of its
        partition's group)."""
        if self.world_size == 1 and self.replicate is None:
            return
        if self.expert_comm is None:
            self._broadcast(self.param_flat)
        else:
            for bucket in self.layout.buckets:
                self._broadcast(self.param_flat[bucket.offset: bucket.offset + bucket.padded], bucket.partition)
        self._broadcast_untracked()

    def _broadcast_untracked(self) -> None:
        """Broadcast, from rank 0, the parameters outside the layout (frozen ones) and the buffers."""
        if self.world_size == 1 and self.replicate is None:
            return
        in_layout = set(self.layout.slots)
        for p in self.model.parameters():
            if p not in in_layout:
                self._broadcast(local_tensor(p).data, self._partition_of(p))
        for b in self.model.buffers():
            self._broadcast(b)

    # ---- backward -------------------------------------------------------------------------------
    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Defer gradient reduction for backward passes in the block under the "local" accumulation
        policy; under "sharded" every backward still reduces (see GradientReducer.no_sync)."""
        return self.reducer.no_sync()

    def reduce_pending(self) -> None:
        """Reduce what backward passes under ``no_sync`` left local: the end-of-step reduction a
        pipeline schedule calls after its last micro-batch (``step()`` calls it too)."""
        self.reducer.reduce_pending()

    def absorb_manual_grads(self, *, collective: bool = False) -> int:
        """Take ``.grad`` tensors written by hand into the engine's gradient store; returns how many.

        The zero-bubble pipeline schedules compute weight gradients outside autograd's accumulation,
        so no post-accumulate-grad hook fires for them: the pipeline driver calls this after every
        weight pass. Under the "local" policy, or outside a sharded pass, they are added as one more
        local contribution, reduced by the next ``reduce_pending()`` (or step). Under "sharded" they
        are reduced right away into the shard (``reducer.reduce_added``, a collective: every rank of the
        group calls it at the same point), so no full gradient is held across micro-batches.
        ``collective``: the caller is at such a point for a pass that writes ``.grad`` by hand (a weight
        pass after the first stage); the reduction then runs even where this rank holds no gradient
        (zeros), so whether the collective is issued never depends on this rank's data.
        """
        grads = [(slot, param.grad) for param, slot in self.layout.slots.items() if param.grad is not None]
        for slot, _ in grads:
            slot.param.grad = None
        sharded = self.reducer.policy == "sharded" and self.reducer.state is not GradState.LOCAL
        if not grads and not (collective and sharded):  # e.g. the first stage's weight pass: its hooks reduced it
            return 0
        if sharded:
            self.reducer.reduce_added([(slot, local_tensor(grad)) for slot, grad in grads])
        else:
            self.reducer.add_local([(slot, local_tensor(grad)) for slot, grad in grads])
        return len(grads)

    def add_backward_end_hook(self, fn: Callable[[], None]) -> RemovableHandle:
        """Call ``fn()`` at the end of every backward pass, after its reductions completed.

        Returns a handle whose ``remove()`` unregisters ``fn``.
        """
        handle = RemovableHandle(self.reducer.backward_end_hooks)
        self.reducer.backward_end_hooks[handle.id] = fn
        return handle

    @contextlib.contextmanager
    def _scaling(self) -> Iterator[None]:
        self._scaled_backward = True
        try:
            yield
        finally:
            self._scaled_backward = False

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``loss.backward()`` with the loss scale applied (required for fp16, harmless otherwise)."""
        self.reducer.record_graph_roots(loss, replace=True)
        with self._scaling():
            (loss * self.scaler.scale if self.scaler.enabled else loss).backward(**kwargs)

    def _before_backward(self) -> None:
        if self.scaler.enabled and not self._scaled_backward:
            raise RuntimeError("hfzero: with dtype='fp16' call optimizer.backward(loss) instead of "
                               "loss.backward(), so the loss is scaled and the step can unscale it")
        if self._materialized:
            raise RuntimeError(_LATE_BACKWARD)

    # ---- step -----------------------------------------------------------------------------------
    def materialize_grads(self) -> None:
        """Finish reductions and set each master view's ``.grad`` to its fp32, averaged, unscaled gradient.

        Idempotent until the step ends. With fp16, also decides (across ranks) whether any gradient
        overflowed, in the step's one host read. See [Note: gradient sums] in reducer.py.
        """
        if self._materialized:
            if self.reducer.has_arrivals():  # a backward that reached no stage-3 unit, after clipping
                raise RuntimeError(_LATE_BACKWARD)
            return
        self.reducer.reduce_pending()
        self._reduce_shard_over_replicas()  # HSDP: before the checks, so fp16's overflow flag sees whole sums
        self.overflow = self._check_step(self._overflow_flag())
        if self.offload is not None:  # the host writes master weights next: See [Note: offload copies]
            self.offload.wait_uploads()
        factor = 1.0 / (self.average_over * self.scaler.scale)
        converted = self.policy.separate_master and self.offload is None
        if converted:
            self.master_grad_flat = torch.empty_like(self.master_flat)
        scale = self._factor_tensor(factor) if converted and factor != 1.0 else None
        shard = self.reducer.settled_shard() if converted else None
        if shard is not None and shard.numel() == self.master_grad_flat.numel():  # laid out alike: one kernel
            if scale is None:
                self.master_grad_flat.copy_(shard)
            else:
                torch.mul(shard, scale, out=self.master_grad_flat)
            for bucket, master in zip(self.layout.buckets, self.master_views):
                master.grad = self.master_grad_flat[bucket.shard_offset: bucket.shard_offset + bucket.chunk]
        else:
            for bucket, master in zip(self.layout.buckets, self.master_views):
                grad = self.reducer.owned_grad(bucket)  # offloaded: the host fp32 sum, scaled in place
                if converted:  # one pass: See [Note: one pass to the fp32 gradient]
                    view = self.master_grad_flat[bucket.shard_offset: bucket.shard_offset + bucket.chunk]
                    grad = view.copy_(grad) if scale is None else torch.mul(grad, scale, out=view)
                elif factor != 1.0:
                    grad.mul_(factor)
                master.grad = grad
        self._materialized = True
        self.unused_ranges = self._find_unused_ranges() if self.config.find_unused_parameters else []

    def _factor_tensor(self, factor: float) -> torch.Tensor:
        """``factor`` as a 1-element tensor in the master dtype on the master device, kept while the factor is
        the same (it changes with the fp16 loss scale only). See [Note: one pass to the fp32 gradient].

        [Note: one pass to the fp32 gradient]
        The step's fp32 gradient of a bucket slice is the 16-bit sum times ``factor`` (1 / (world x loss
        scale)), computed in fp32. ``torch.mul(sum16, factor_tensor, out=fp32_view)`` does it in one pass
        (reads 2 bytes, writes 4 per element): the factor is a 1-element *dimensioned* fp32 tensor, so type
        promotion computes in fp32 (a Python scalar or a 0-dim tensor would leave the product in the 16-bit
        dtype and round it there) and every element is ``float32(sum16) * float32(factor)``, bitwise what
        the former copy-then-``mul_`` gave in two passes (10 more bytes per element). A factor of 1 (world
        1, no loss scale) is a plain conversion; fp32 sums that are their own master gradient are scaled in
        place, or not touched when the factor is 1.
        """
        cached = self._factor_cache
        if cached is None or cached[0] != factor:
            cached = self._factor_cache = (factor, torch.full((1,), factor, dtype=self.policy.master_dtype,
                                                              device=self.policy.master_device))
        return cached[1]

    def _owned_ranges(self, bucket, keep: Callable[[torch.Tensor], bool]) -> list[tuple[int, int]]:
        """(start, end) ranges, relative to this rank's owned slice of ``bucket``, of the parameters ``keep``
        accepts."""
        return [span for slot, span in self._slot_ranges(bucket) if keep(slot.param)]

    def _slot_ranges(self, bucket) -> list[tuple[Any, tuple[int, int]]]:
        """(slot, (start, end)) for the slots overlapping this rank's owned slice of ``bucket``, relative to it."""
        lo, hi = bucket.mine()
        out = []
        for slot in bucket.slots:
            start, end = max(slot.offset, lo), min(slot.offset + slot.numel, hi)
            if start < end:
                out.append((slot, (start - lo, end - lo)))
        return out

    def _reduce_shard_over_replicas(self) -> None:
        """HSDP: all-reduce the owned gradient sums over the replicate group (once per step); See [Note:
        hierarchical sharding]. Stages 2-3 hold the shard in one flat buffer: one collective."""
        if self.replicate is None:
            return
        if self.reducer.grad_shard is not None:
            self.reducer.settle_store()  # read whole: See [Note: gradient stores] in reducer.py
            self.replicate.all_reduce(self.reducer.grad_shard)
            return
        grads = [self.reducer.owned_grad(b) for b in self.layout.buckets]
        # on the model's device (which the group serves: gloo moves it itself) or on the scratch device: in place
        if any(g.device not in (self.device, self.replicate.device) for g in grads):
            self._reduce_host_shard_over_replicas(grads)
            return
        handles = [self.replicate.all_reduce(g, async_op=True) for g in grads]
        for handle in handles:
            handle.wait()

    def _reduce_host_shard_over_replicas(self, grads: list[torch.Tensor]) -> None:
        """HSDP with the optimizer offloaded from an accelerator: the gradient sums live on the host (fp32), where
        the replicate group's backend (NCCL) cannot reduce them; each bucket's slice is copied to the device,
        all-reduced there and copied back, one at a time (a transient device buffer of one bucket's slice, fp32;
        a communication buffer, not a model state). On a CPU device, or under gloo (whose scratch device is the
        CPU: See [Note: collective device] in hfzero/devices.py), the caller reduces the sums in place."""
        for grad in grads:
            staged = grad.to(self.replicate.device)  # (bucket chunk,) fp32
            self.replicate.all_reduce(staged)
            grad.copy_(staged)

    def _overflow_flag(self) -> torch.Tensor | None:
        """fp16: a 1-element float32 tensor on the communication device, 1 where a reduced gradient sum this
        rank owns is not finite (not read here: the step reads it with its checks); None otherwise. Checked on
        the sums, before unscaling, so stage 3 can pack it into its step check: a finite sum (fp16 at most
        65504, or fp32) times 1 / (world x scale) stays finite for any loss scale above ~1e-30."""
        if not self.scaler.enabled:
            return None
        sums = [self.reducer.owned_grad(bucket) for bucket in self.layout.buckets]
        if not sums:
            return torch.zeros(1, dtype=torch.float32, device=self.comm_device)
        finite = torch.stack([torch.isfinite(g).all() for g in sums]).all()
        return (~finite).to(self.comm_device, torch.float32).reshape(1)

    def _check_step(self, overflow: torch.Tensor | None) -> bool:
        """The step's checks, before anything is applied, in its one host read: the step agreement (See
        [Note: step agreement]) and, with fp16, the overflow flag all-reduced (MAX) over the group. Returns
        whether any rank's gradients overflowed, the same answer on every rank."""
        if overflow is not None:
            self.check_comm.all_reduce(overflow, op=torch.distributed.ReduceOp.MAX)
        if self.agreement is not None:
            return self.agreement.check(overflow)
        return bool(overflow.item() > 0) if overflow is not None else False  # world 1: the flag alone

    def _find_unused_ranges(self) -> list[tuple[int, int, int]]:
        """(bucket index, start, end) ranges of master views whose parameters no rank used since the
        last step (one all-reduce of a flag per parameter; one more over the replicate group (HSDP) or
        over ``expert_comm`` for the experts (EP))."""
        slots = list(self.layout.slots.values())
        flags = torch.tensor([slot in self.reducer.used for slot in slots], dtype=torch.uint8,
                             device=self.comm_device)
        experts = None
        if self.expert_comm is not None:
            # EP: an expert's slot holds other experts on the other EP ranks, so its flag is its edp group's
            # (the ranks reducing its gradient); a dense parameter's is the world's, as its reduction
            is_expert = torch.tensor([self.layout.buckets[slot.bucket].partition == 1 for slot in slots],
                                     dtype=torch.bool, device=self.comm_device)
            experts = flags.clone()
            self.expert_comm.all_reduce(experts, op=torch.distributed.ReduceOp.MAX)
        self.comm.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        if self.replicate is not None:  # used on any rank of the world
            self.replicate.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        if experts is not None:
            flags = torch.where(is_expert, experts, flags)
        ranges = []
        for slot, used in zip(slots, flags.tolist()):
            if used:
                continue
            bucket = self.layout.buckets[slot.bucket]
            lo, hi = bucket.mine()
            start, end = max(slot.offset, lo), min(slot.offset + slot.numel, hi)
            if start < end:
                ranges.append((bucket.index, start - lo, end - lo))
        return ranges

    @contextlib.contextmanager
    def keep_unused_unchanged(self) -> Iterator[None]:
        """Around the inner optimizer's step: restore master slices and optimizer states of parameters
        no rank used (see ZeroConfig.find_unused_parameters)."""
        saved = []
        for index, start, end in self.unused_ranges:
            master = self.master_views[index]
            state = self.optimizer.state.get(master, {}) if self.optimizer is not None else {}
            tensors = {k: v[start:end].clone() for k, v in state.items()
                       if isinstance(v, torch.Tensor) and v.shape == master.shape}
            saved.append((index, start, end, master[start:end].clone(), tensors))
        yield
        for index, start, end, values, tensors in saved:
            master = self.master_views[index]
            master[start:end].copy_(values)
            for key, value in self.optimizer.state.get(master, {}).items():
                if not isinstance(value, torch.Tensor) or value.shape != master.shape:
                    continue
                if key in tensors:
                    value[start:end].copy_(tensors[key])
                else:  # the state was created by this step: as if it had never been touched
                    value[start:end].zero_()

    @property
    def comm_device(self) -> torch.device:
        return self.comm.device

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm to ``max_norm``; return the norm before clipping.

        Equal to ``torch.nn.utils.clip_grad_norm_`` over the full averaged gradient: each rank sums
        its slice and one small all-reduce combines them (none at stage 0, where slices are whole).
        With tensor parallelism (``norm_group``) the sum also spans the TP group, each parameter
        replicated over it counted once (by TP rank 0). With expert parallelism (layout partitions) it is one
        all-reduce over the world, each rank summing the buckets it counts (``_counted_grads``): each dense
        element and each expert element once.
        """
        self.materialize_grads()
        grads = [m.grad for m in self.master_views]
        norm_type = float(norm_type)
        device = grads[0].device if grads else self.policy.master_device
        outer = self.norm_group if self.norm_group is not None and self.norm_group.world_size > 1 else None
        partitioned = self.expert_comm is not None
        reduced = self.layout.shard_world > 1 or (partitioned and self.world_size > 1)
        if norm_type == float("inf"):
            local = torch.stack([g.abs().max() for g in grads]).max() if grads else torch.zeros((), device=device)
            total = local.to(self.comm_device, torch.float32).reshape(1)
            if reduced:
                self.comm.all_reduce(total, op=torch.distributed.ReduceOp.MAX)
            if outer is not None:
                outer.all_reduce(total, op=torch.distributed.ReduceOp.MAX)
            total = total[0]
        else:
            counted = self._counted_grads() if partitioned else grads
            local = sum((torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) ** norm_type for g in counted),
                        torch.zeros((), device=device))
            if outer is not None and outer.rank > 0:  # replicated over ``outer``: counted once, by its rank 0
                local = local - self._replicated_norm_power(norm_type, device)
            total = local.to(self.comm_device, torch.float32).reshape(1)
            if reduced:
                self.comm.all_reduce(total)
            if outer is not None:
                outer.all_reduce(total)
            total = total[0].pow(1.0 / norm_type)
        scale_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return total

    def _counted_grads(self) -> list[torch.Tensor]:
        """With layout partitions: the gradients of the owned slices this rank counts in the norm. A bucket's
        slice is held by its partition group's ranks; sharded (stages 1-3) each holds a different slice, whole
        (stage 0) all hold the same: it is counted by the first ``shard_world`` ranks of its group, so over the
        world each element of a partition group's buckets is counted once, and the expert groups (ranks with the
        same experts) hold different experts. See [Note: bucket partitions] in layout.py."""
        return [master.grad for bucket, master in zip(self.layout.buckets, self.master_views)
                if self.partition_comms[bucket.partition].rank < bucket.shard_world]

    def _replicated_norm_power(self, norm_type: float, device: torch.device) -> torch.Tensor:
        """Sum of |g|^p over this rank's slice of the parameters replicated over the TP group (tensor
        parallelism)."""
        total = torch.zeros((), device=device, dtype=torch.float32)
        for bucket in self.layout.buckets:
            grad = self.master_views[bucket.index].grad
            for start, end in self._owned_ranges(bucket, is_replicated_over_tp):
                total = total + torch.linalg.vector_norm(grad[start:end], norm_type, dtype=torch.float32) ** norm_type
        return total

    def publish_params(self) -> None:
        """Copy master slices into the device parameters and all-gather them (one collective per bucket).

        Offloaded, bucket by bucket: the asynchronous host-to-device copy of bucket k+1 runs while bucket
        k is all-gathered (see [Note: offload copies])."""
        if self.offload is not None:
            self.offload.begin_upload()
        elif self.policy.separate_master:
            for bucket, master in zip(self.layout.buckets, self.master_views):
                self._owned_param(bucket).copy_(master)
        handles = []
        for bucket, master in zip(self.layout.buckets, self.master_views):
            if self.offload is not None:
                self.offload.upload(bucket, master, self._owned_param(bucket))
            if bucket.shard_world > 1:  # its partition's group: See [Note: bucket partitions] in layout.py
                full = self.param_flat[bucket.offset: bucket.offset + bucket.padded]
                handles.append(self.param_gathers[bucket.partition].all_gather(full, self._owned_param(bucket),
                                                                              async_op=True))
        for handle in handles:
            handle.wait()

    def wait_host_copies(self) -> None:
        """Offloaded: block until the asynchronous copies issued so far are done, before the host writes
        master weights outside a step (loading a state dict or checkpoint). No-op otherwise."""
        if self.offload is not None:
            self.offload.wait_uploads()

    def wait_checkpoint_copy(self) -> None:
        """Block until an asynchronous checkpoint save has copied this rank's master and optimizer-state slices
        (see hfzero/checkpoint/staging.py), before anything changes them. Returns at once without one."""
        if self.checkpoint_copy is not None:
            self.checkpoint_copy.wait()
            self.checkpoint_copy = None

    def finish_step(self) -> None:
        """Drop this step's gradients (the step consumed them) and the transient fp32 gradients."""
        for master in self.master_views:
            master.grad = None
        self.master_grad_flat = None
        self.unused_ranges = []
        self._materialized = False
        if self.agreement is not None:
            self.agreement.forget()
        self.reducer.zero()

    # ---- unprepare ------------------------------------------------------------------------------
    def whole_params(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(the tensor a parameter's values live in, a fresh copy of its whole values) for every parameter whose
        memory the engine holds: here the trainable ones, views of ``param_flat`` (the fp32 master values cast to
        the parameter dtype since the last step). The copies are one more copy of the parameters (transient,
        until ``unprepare`` lets the engine go); stage 3 gathers (a collective, See Stage3Engine)."""
        return [(local, local.detach().clone()) for local in map(local_tensor, self.layout.slots)]

    def release(self) -> None:
        """Forget everything the engine holds (``unprepare``): its buffers are freed with it, and any later use
        raises ``UNPREPARED``. The hooks and attributes on the model must have been undone first."""
        self.__dict__.clear()
        self.__dict__["_released"] = True

    def __getattr__(self, name: str) -> Any:
        if self.__dict__.get("_released"):
            raise RuntimeError(UNPREPARED)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ---- introspection --------------------------------------------------------------------------
    def memory_by_role(self) -> dict[MemoryRole, int]:
        """Bytes of live tensors the engine holds, by role (computed from sizes; no side effects)."""
        if self._untracked_param_bytes is None:  # parameters outside the layout never change size
            in_layout = set(self.layout.slots)
            self._untracked_param_bytes = sum(_nbytes(p) for p in set(self.model.parameters()) if p not in in_layout)
        host = self.host_memory_by_role()
        roles = {
            MemoryRole.PARAM_FULL: _nbytes(self.param_flat) + self._untracked_param_bytes,
            MemoryRole.GRAD_FULL: _nbytes(self.reducer.grad_full),
            MemoryRole.GRAD_SHARD: _nbytes(self.reducer.grad_shard) + host.get(MemoryRole.GRAD_SHARD, 0),
            MemoryRole.GRAD_ACCUM: self.reducer.accumulator_bytes(),
            MemoryRole.MASTER_SHARD: _nbytes(self.master_flat),
            MemoryRole.OPTIM_STATE: self._optim_state_bytes(),
            MemoryRole.GRAD_BUCKET: self.reducer.staging_bytes() + host.get(MemoryRole.GRAD_BUCKET, 0),
            MemoryRole.GRAD_FP32: _nbytes(self.master_grad_flat) + host.get(MemoryRole.GRAD_FP32, 0),
            MemoryRole.CKPT_STAGING: _nbytes(self.checkpoint_staging),
            MemoryRole.COMM_BUFFER: sum(part.buffer_bytes() for part in (self.param_gather, self.reducer.scatter)
                                        if hasattr(part, "buffer_bytes")),  # See [Note: quantized buffers]
            MemoryRole.QUANT_RESIDUAL: getattr(self.reducer.scatter, "residual_bytes", lambda: 0)(),
        }
        return {role: size for role, size in roles.items() if size}

    def host_memory_by_role(self) -> dict[MemoryRole, int]:
        """The part of ``memory_by_role()`` placed in host memory by offload (empty when not offloaded):
        master weights, optimizer states, the fp32 gradients (GRAD_SHARD at stages 2-3, where they are
        the held gradient; GRAD_FP32 at stages 0-1, a copy of the device's) and the host staging; and the
        asynchronous checkpoint saves' staging (CKPT_STAGING, always in host memory)."""
        if self.offload is None:
            staging = _nbytes(self.checkpoint_staging)
            return {MemoryRole.CKPT_STAGING: staging} if staging else {}
        grad_role = MemoryRole.GRAD_SHARD if self.stage >= 2 else MemoryRole.GRAD_FP32
        roles = {
            MemoryRole.MASTER_SHARD: _nbytes(self.master_flat),
            MemoryRole.OPTIM_STATE: self._optim_state_bytes(),
            grad_role: self.offload.grad_bytes(),
            MemoryRole.GRAD_BUCKET: self.offload.staging_bytes(),
            MemoryRole.CKPT_STAGING: _nbytes(self.checkpoint_staging),
        }
        return {role: size for role, size in roles.items() if size}

    def pinned_bytes(self) -> int:
        """Page-locked host bytes the engine holds: the offload's staging and, with fp32 parameters, its
        master weights, at their exact sizes (0 when not offloaded or off CUDA; see runtime/offload.py)."""
        return self.offload.pinned_bytes() if self.offload is not None else 0

    def _optim_state_bytes(self) -> int:
        """Bytes of the inner optimizer's state tensors (0 before it exists)."""
        if self.optimizer is None:
            return 0
        return sum(_nbytes(v) for state in self.optimizer.state.values() for v in state.values()
                   if isinstance(v, torch.Tensor))

    def model_state_bytes(self) -> int:
        """Sum of the model-state roles held right now."""
        return sum(v for k, v in self.memory_by_role().items() if k in MODEL_STATE_ROLES)


ENGINE_ATTR = "hfzero_engine"
"""The attribute ``prepare`` sets on a prepared model: its engine."""


def get_engine(obj: nn.Module | torch.optim.Optimizer) -> ZeroEngine:
    """The engine behind a prepared model or its ZeroOptimizer."""
    engine = getattr(obj, ENGINE_ATTR, None) or getattr(obj, "engine", None)
    if not isinstance(engine, ZeroEngine):
        raise ValueError(f"{type(obj).__name__} was not prepared by hfzero.prepare")
    return engine
