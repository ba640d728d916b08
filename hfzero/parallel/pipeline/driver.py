"""The pipeline driver: split a HF decoder over a pp x dp mesh, run ZeRO inside each stage's dp group,
drive a torch.distributed.pipelining schedule, and finish each step across pp x dp.

[Note: pipeline x ZeRO step]
One call of ``forward_backward(batch)`` is one optimizer step's worth of gradients:
1. The schedule runs n_micro forwards and backwards. The loss of a micro-batch is its mean token
   loss / n_micro (``scale_grads=False``), so a replica's gradients are its batch-mean gradients and
   the engine's division by the dp size gives the global-batch mean: a PP run equals a non-PP run.
2. Accumulation policy (``ZeroConfig.accumulation``, the engine's): the schedule runs inside
   ``engine.no_sync()``; under "local" the backwards accumulate full local gradients, reduced once at
   the stage's end-of-step action; under "sharded" no_sync does not defer and every backward
   reduce-scatters into the shard (ZeRO-2/3 memory, n_micro reductions).
   Zero-bubble schedules: a weight pass writes ``.grad`` by hand (no hook fires); the stage's weight
   action takes it right after (``engine.absorb_manual_grads``): "sharded" reduce-scatters it then, per
   micro-batch like the hooks do, "local" adds it to the accumulator. A rank running several stages
   reduces, per backward, only the buckets of the stage back-propagated ([Note: active buckets]).
3. End-of-step action (``ZeroPipelineStage.perform_reduce_grad``, after this rank's last backward):
   absorb any hand-written ``.grad`` left, finish pending reductions, then sum the tied embedding's
   reduced gradient between the first and last stage (see [Note: tied embeddings]).
4. After the schedule: materialize the fp32 gradients, vote fp16 overflow over pp (the engine voted
   over dp), average the loss over dp and broadcast it over pp. Clipping sums squared norms over
   dp and pp, counting the tied embedding once.

[Note: tied embeddings]
The first and the last stage each hold the tied embedding. The driver gives it an optimizer param
group of its own (same hyper-parameters), so on both stages it is alone in its bucket(s), padded
alike: dp rank r owns the same elements of it in both stages. After the dp reduction each owner
all-reduces its owned slice with its peer (same dp rank, other end of the pipeline): both stages
then hold the full sum and take identical optimizer steps, so the two copies stay equal.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from hfzero.comm.collectives import Communicator
from hfzero.config import ConfigError, ZeroConfig
from hfzero.logging import get_logger
from hfzero.parallel.mesh import PipelineMesh, build_mesh
from hfzero.parallel.pipeline.config import PipelineConfig
from hfzero.parallel.pipeline.schedule import ZeroPipelineStage, resolve_schedule
from hfzero.parallel.pipeline.split import DecoderStage, family_of, split_model, tied_embeddings
from hfzero.parallel.pipeline.timeline import StageClock
from hfzero.runtime.optimizer import _rebuild
from hfzero.runtime.pending import find_pending
from hfzero.runtime.pending import release as release_pending
from hfzero.runtime.tensors import scale_

logger = get_logger(__name__)


class StageChunks(nn.ModuleList):
    """The stages one rank runs under a multi-stage schedule, prepared as one engine."""


# [Note: stage-only builds]
# A model loaded through hfzero's loading hook (``from_pretrained`` under ``hfzero run --zero_pp_size``,
# ZeroTrainingArguments with ``zero_pp_size``, or ``hfzero.sharded_init``; see docs/loading.md) arrives here
# with every parameter on the meta device and a PendingWeights naming each one's file and key. Splitting needs
# no values (blocks are balanced by element counts, ties are object identities), so the stage modules are cut
# from the meta model; the PendingWeights is attached to this rank's stage module, whose ``prepare`` reads only
# its own parameters (its shard of them at ZeRO-3; the tied embedding on the first and on the last stage, each
# from the same key); the model is then released from pending, so the other stages' parameters stay on meta on
# this rank, never read, and ``release_other_stages`` only tags them (no bytes to free). A rank thus never
# holds more than its stages, from ``from_pretrained`` on.


class Pipeline:
    """This rank's stage(s) of a pipeline, the ZeRO engine over its dp group, and the schedule.

    Attributes: ``mesh`` (PipelineMesh), ``module`` (the prepared stage module, or StageChunks),
    ``stages`` (DecoderStage list), ``optimizer`` (the ZeroOptimizer of this rank's parameters),
    ``engine``, ``accumulation`` ("sharded"/"local"), ``config`` (PipelineConfig).
    See [Note: pipeline x ZeRO step].
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, zero_config: ZeroConfig,
                 config: PipelineConfig, *, mesh: PipelineMesh | None = None):
        from hfzero.parallel.data_parallel import prepare
        from hfzero.runtime.engine import get_engine

        family_of(model)
        self.config = config
        self.zero_config = zero_config
        self.kind = resolve_schedule(config.schedule)
        if zero_config.stage == 3 and self.kind.v_shape and tied_embeddings(model):
            # both ends (and the one tied parameter) on pp rank 0, in two stage-3 chunk units: not supported
            raise ConfigError(f"hfzero pipeline: schedule {self.kind.name} at ZeRO stage 3 with tied input/output "
                              "embeddings is not supported (both ends run on one rank, in two gathering units); "
                              "use InterleavedZeroBubble or Interleaved1F1B, or ZeRO stage 0-2")
        self.mesh = mesh or build_mesh(config.pp_size)
        if self.kind.stages_per_rank > 1 and self.mesh.pp_size == 1:
            raise ConfigError(f"hfzero pipeline: schedule {self.kind.name} needs pp_size >= 2")
        self.num_stages = self.mesh.pp_size * self.kind.stages_per_rank
        stage_ids = self.kind.stage_ids(self.mesh.pp_rank, self.mesh.pp_size)
        self.stages: list[DecoderStage] = split_model(model, stage_ids, self.num_stages, config.layers_per_stage)
        self.module: nn.Module = self.stages[0] if len(self.stages) == 1 else StageChunks(self.stages)
        tied = self._tied_param()
        self.tied_numel = tied.numel() if tied is not None else 0
        """Elements of the tied embedding this rank's stages hold (0 if none); counted before ZeRO shards it."""
        self.shared_numel = self.tied_numel if sum(s.tied_name is not None for s in self.stages) > 1 else 0
        """Elements of the parameter two of this rank's stages hold (the tied embedding with both ends here,
        V-shaped schedules): both stages' backwards reduce it under "sharded" (see cost.rank_params)."""
        is_tied = tied_embeddings(model)
        stage_optimizer, self._tied_group, self.tied_user_group = _stage_optimizer(optimizer, self.module, tied)
        self.generation_config = getattr(model, "generation_config", None)
        self.tied_names: tuple[str, str] | None = None
        """(canonical, copy): the tied embedding's names on the first and the last stage when they sit on
        different ranks (a checkpoint writes the canonical one; see [Note: pipeline checkpoints])."""
        if is_tied and self._holder_ranks(0) != self._holder_ranks(self.num_stages - 1):
            self.tied_names = (self.stages[0].family.first[0] + ".weight", "lm_head.weight")
        prepare_kwargs: dict[str, Any] = {}
        if zero_config.stage == 3 or len(self.stages) > 1:  # chunks never share a bucket: [Note: active buckets]
            prepare_kwargs["units"] = self._units()
        pending = find_pending(model)
        if pending is not None:  # See [Note: stage-only builds]
            pending.attach(self.module)
        shard_group = self.mesh.dp_group
        if zero_config.shard_size and zero_config.shard_size != self.mesh.dp_size:  # HSDP inside each stage
            from hfzero.parallel.mesh import build_pipeline_shard_groups

            shard_group, prepare_kwargs["replicate_group"] = build_pipeline_shard_groups(self.mesh,
                                                                                         zero_config.shard_size)
        self.module, self.optimizer = prepare(self.module, stage_optimizer, zero_config,
                                                     process_group=shard_group, **prepare_kwargs)
        if pending is not None:
            release_pending(model)  # other stages' parameters stay on meta, never read here
        self.engine = get_engine(self.module)
        self.accumulation = self.engine.accumulation
        self._chunk_buckets: dict[int, frozenset[int]] = {}
        """Per stage index, the buckets holding its parameters, when this rank runs several stages."""
        if len(self.stages) > 1:
            chunks = self.module if isinstance(self.module, StageChunks) else self.stages
            for stage in chunks:
                mine = set(stage.parameters())
                self._chunk_buckets[stage.stage_index] = frozenset(
                    slot.bucket for p, slot in self.engine.layout.slots.items() if p in mine)
        if zero_config.stage == 3:
            self.engine.scheduler.keep_gathered = config.stage3_gather == "step"
        # scalars (loss, norms, overflow flags) on ledgers of their own: engine.comm.stats() counts
        # the gradient and parameter traffic the estimator models (the tied-embedding sum included)
        self.pp_comm = self.engine.comm.on_group(self.mesh.pp_group, share_stats=False)
        self.dp_scalars = self.engine.comm.on_group(self.mesh.dp_group, share_stats=False)
        self.shard_scalars = self.engine.comm.on_group(self.engine.comm.group, share_stats=False)
        """The norm's sum over the stage's shards: the dp group, or (HSDP) the shard group alone, whose replicas hold
        the same elements (summing over the whole dp group would count each of them once per replica)."""
        if is_tied and self.engine.offload is not None and self.engine.device.type == "cuda":
            # every rank decides alike (model, config and device agree), so all raise together
            raise ConfigError("hfzero pipeline: offload_optimizer with tied input/output embeddings is not supported "
                              "on CUDA (the tied-gradient sum would run on host tensors); untie the embeddings "
                              "(tie_word_embeddings=False) or train without offload_optimizer")
        self.tied_comm = self._tied_pair_comm(is_tied, tied is not None)
        self._schedules: dict[tuple, Any] = {}
        self._n_micro, self._divisor = config.n_microbatches, None
        _PIPELINES[self.optimizer] = self
        self._reduced_stages = 0
        self._pass_observers: collections.OrderedDict[int, Callable[[str, int, int, str], None]] = \
            collections.OrderedDict()
        self.clock = StageClock(self.engine.device)
        """Times this rank's stage actions and counts its P2P bytes in each training step; ``clock.last``
        is the last step's summary (the profiler's ``pipeline`` figures; see [Note: measuring the bubble])."""
        self._losses_computed = 0
        self._pass_plans: dict[Any, list] = {}
        """Per schedule, the kinds of the stage-3 passes its last step ran (see [Note: prefetch across
        micro-batches])."""
        self.micro_shape: tuple[int, int] | None = None
        """(rows, seq) of one micro-batch of the last batch run."""
        self.step_roles: dict[Any, int] = {}
        """Peak bytes by MemoryRole over the last forward_backward, sampled after the last backward
        (before the deferred reduction frees local accumulators) and at its end."""

    # ---- construction ---------------------------------------------------------------------------
    def _tied_param(self) -> nn.Parameter | None:
        names = [s.tied_name for s in self.stages if s.tied_name is not None]
        if not names:
            return None
        holder = next(s for s in self.stages if s.tied_name is not None)
        return holder.get_parameter(holder.tied_name)

    def _units(self) -> list[str]:
        if len(self.stages) == 1:
            return self.stages[0].block_names
        return [str(i) for i in range(len(self.stages))]  # chunk units: their forward is what runs

    def _holder_ranks(self, stage_index: int) -> int:
        """The pp rank holding global stage ``stage_index``."""
        for pp_rank in range(self.mesh.pp_size):
            if stage_index in self.kind.stage_ids(pp_rank, self.mesh.pp_size):
                return pp_rank
        raise AssertionError(stage_index)

    def _tied_pair_comm(self, is_tied: bool, holds_tied: bool) -> Communicator | None:
        """A communicator over (first-stage rank, last-stage rank) of this dp index; see [Note: tied embeddings].

        Collective: every rank creates every pair's group, in dp order.
        """
        first, last = self._holder_ranks(0), self._holder_ranks(self.num_stages - 1)
        if first == last or not is_tied:
            return None
        mine = None
        for dp_rank in range(self.mesh.dp_size):
            ranks = [self.mesh.global_rank(first, dp_rank), self.mesh.global_rank(last, dp_rank)]
            group = dist.new_group(ranks)
            if dp_rank == self.mesh.dp_rank and holds_tied:
                mine = self.engine.comm.on_group(group)
        return mine

    def hf_name(self, name: str) -> str:
        """The HF model's name of a parameter or buffer named ``name`` in ``self.module``."""
        return name.split(".", 1)[1] if isinstance(self.module, StageChunks) else name

    # ---- schedule -------------------------------------------------------------------------------
    def _schedule(self, rows: int, seq: int, train: bool, n_micro: int):
        """The schedule for ``n_micro`` micro-batches of (rows, seq) tokens (static shapes: one per shape)."""
        key = (rows, seq, train, n_micro)
        if key not in self._schedules:
            device = self.engine.device
            dtype = self.zero_config.torch_dtype
            hidden = self.hidden_size
            vocab = self.stages[0].config.vocab_size
            chunks = self.module if isinstance(self.module, StageChunks) else [self.module]
            pipeline_stages = []
            for stage in chunks:
                # static shapes: no metadata-inference forward (it would run the engine's hooks)
                inputs = (torch.zeros(rows, seq, dtype=torch.long, device=device) if stage.is_first
                          else torch.empty(rows, seq, hidden, dtype=dtype, device=device).requires_grad_(train))
                outputs = torch.empty(rows, seq, vocab if stage.is_last else hidden, dtype=dtype, device=device)
                outputs.requires_grad_(train)
                pipeline_stages.append(ZeroPipelineStage(
                    stage, stage.stage_index, self.num_stages, device, input_args=inputs, output_args=outputs,
                    group=self.mesh.pp_group, on_reduce_grad=self._on_reduce_grad, clock=self.clock,
                    backward_pass=self._backward_pass))
            target = pipeline_stages[0] if len(pipeline_stages) == 1 else pipeline_stages
            self._schedules[key] = self.kind.cls(target, n_microbatches=n_micro,
                                                 loss_fn=self._loss_fn, scale_grads=False)
        return self._schedules[key]

    def _loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean token loss of a micro-batch / n_micro, or its token-loss sum / the step's token divisor (times
        the fp16 loss scale); see [Note: pipeline x ZeRO step]."""
        vocab = logits.shape[-1]
        self._losses_computed += 1
        with self.clock.span("loss", self.num_stages - 1, self._losses_computed - 1):
            # (B * (T - 1), V) against (B * (T - 1),)
            flat, target = logits[:, :-1].reshape(-1, vocab).float(), labels[:, 1:].reshape(-1)
            scale = self.engine.scaler.scale if self.engine.scaler.enabled else 1.0
            if self._divisor is None:
                return F.cross_entropy(flat, target, ignore_index=-100) * (scale / self._n_micro)
            return F.cross_entropy(flat, target, ignore_index=-100, reduction="sum") * (scale / self._divisor)

    @property
    def hidden_size(self) -> int:
        """Width of the activations passed between stages."""
        config = self.stages[0].config
        return config.hidden_size if hasattr(config, "hidden_size") else config.n_embd

    @property
    def holds_first(self) -> bool:
        return any(s.is_first for s in self.stages)

    @property
    def holds_last(self) -> bool:
        return any(s.is_last for s in self.stages)

    def _inputs(self, input_ids: torch.Tensor, labels: torch.Tensor | None, train: bool, n_micro: int | None,
                divisor: float | None = None):
        """The schedule for this batch's micro-batch shape, the first stage's args, the last stage's target."""
        if input_ids.ndim != 2:
            raise ConfigError(f"hfzero pipeline: input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
        n_micro = self.config.n_microbatches if n_micro is None else n_micro
        if input_ids.shape[0] % n_micro:
            raise ConfigError(f"hfzero pipeline: n_microbatches={n_micro} does not divide this "
                              f"replica's batch of {input_ids.shape[0]} rows; use a batch that is a multiple of it")
        labels = input_ids if labels is None else labels
        self._n_micro, self._divisor = n_micro, divisor
        self.micro_shape = (input_ids.shape[0] // n_micro, input_ids.shape[1])
        schedule = self._schedule(*self.micro_shape, train, n_micro)
        device = self.engine.device
        args = (input_ids.to(device),) if self.holds_first else ()
        return schedule, args, labels.to(device) if self.holds_last else None

    # ---- a step ---------------------------------------------------------------------------------
    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *,
                         n_microbatches: int | None = None, token_divisor: float | None = None) -> float:
        """Run the schedule over this replica's batch (B, T) in ``n_microbatches`` (default: the config's)
        and finish its gradients; return the mean loss of the global batch (every rank returns it).
        Every rank of a pipeline passes the same batch. The loss is the mean of the micro-batches' mean token
        losses, or with ``token_divisor`` the replica's token-loss sum / ``token_divisor`` (the Trainer's
        convention: its token count over the global batch / dp, so the dp average is sum / count)."""
        schedule, args, target = self._inputs(input_ids, labels, train=True, n_micro=n_microbatches,
                                              divisor=token_divisor)
        losses: list[torch.Tensor] = []
        self._reduced_stages = 0
        self._losses_computed = 0
        self.step_roles = {}
        planned = self._planned_scheduler()
        if planned is not None:  # See [Note: prefetch across micro-batches]
            planned.begin_planned_step(self._pass_plans.get(schedule))
        with self.engine.no_sync(), self._scaled():  # defers only under the "local" policy
            self.clock.begin()
            try:
                schedule.step(*args, target=target, losses=losses if self.holds_last else None)
            finally:
                self.clock.end(n_micro=self._n_micro, micro_shape=self.micro_shape)
                if planned is not None:
                    self._pass_plans[schedule] = planned.end_planned_step()
        self.engine.materialize_grads()
        self._sample_roles()
        self._vote_overflow()
        return self._global_loss(losses)

    def _planned_scheduler(self) -> Any:
        """The stage-3 unit scheduler when it gathers per micro-batch on a single-stage rank (the units'
        passes follow the schedule: it prefetches across micro-batches) and ``stage3_cross_prefetch`` is on,
        else None."""
        if (self.zero_config.stage != 3 or self.config.stage3_gather != "micro" or len(self.stages) > 1
                or not self.config.stage3_cross_prefetch):
            return None
        return self.engine.scheduler

    @torch.no_grad()
    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *, over_dp: bool = True,
                 token_divisor: float | None = None) -> float:
        """Forward-only mean loss of the global batch (every rank returns it); ``over_dp=False``: of this
        replica's batch (every rank of the pipeline returns it). Any batch size: the micro-batches are
        the config's number when it divides the rows, else fewer."""
        n_micro = math.gcd(input_ids.shape[0], self.config.n_microbatches) if input_ids.ndim == 2 else None
        schedule, args, target = self._inputs(input_ids, labels, train=False, n_micro=n_micro, divisor=token_divisor)
        losses: list[torch.Tensor] = []
        schedule.eval(*args, target=target, losses=losses if self.holds_last else None)
        if self.zero_config.stage == 3:
            self.engine.scheduler.release_all()
        return self._global_loss(losses, over_dp=over_dp)

    def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                   max_grad_norm: float | None = None) -> float:
        """forward_backward, optional clipping, optimizer step, zero_grad; returns the global mean loss."""
        loss = self.forward_backward(input_ids, labels)
        if max_grad_norm is not None:
            self.clip_grad_norm_(max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss

    @contextlib.contextmanager
    def _scaled(self) -> Iterator[None]:
        if self.engine.scaler.enabled:  # backward runs inside the schedule; the loss_fn applies the scale
            with self.engine._scaling():
                yield
        else:
            yield

    def add_pass_observer(self, fn: Callable[[str, int, int, str], None]) -> RemovableHandle:
        """Call ``fn(edge, stage_index, micro, part)`` at the "begin" and "end" of every backward action of this
        rank's stages (``micro`` from 1; ``part``: "full", "input" or "weight"); the profiler's backward phases.
        Returns a handle whose ``remove()`` unregisters ``fn``."""
        handle = RemovableHandle(self._pass_observers)
        self._pass_observers[handle.id] = fn
        return handle

    @contextlib.contextmanager
    def _backward_pass(self, stage_index: int, chunk_id: int, part: str) -> Iterator[None]:
        """Around a backward action (``part``: "full", "input" or a zero-bubble "weight" pass) of stage
        ``stage_index``: on a rank running several stages, reduce only that stage's buckets ([Note: active
        buckets] in reducer.py); after a weight pass, take the ``.grad`` it wrote by hand: reduced now under
        "sharded", added to the local accumulator under "local" (see [Note: pipeline x ZeRO step])."""
        for fn in list(self._pass_observers.values()):
            fn("begin", stage_index, chunk_id + 1, part)
        reducer = self.engine.reducer
        reducer.active = self._chunk_buckets.get(stage_index)
        try:
            yield
            if part == "weight":  # stage 0's weight pass is a full backward (hooks): nothing written by hand
                self.engine.absorb_manual_grads(collective=stage_index != 0)
        finally:
            reducer.active = None
            for fn in list(self._pass_observers.values()):
                fn("end", stage_index, chunk_id + 1, part)

    def _on_reduce_grad(self) -> None:
        """End-of-step action of one of this rank's stages; the last one finishes the reduction."""
        self._reduced_stages += 1
        if self._reduced_stages < len(self.stages):
            return
        self._sample_roles()
        if self.kind.zero_bubble:
            self.engine.absorb_manual_grads()
        self.engine.reduce_pending()
        if self.tied_comm is not None:
            for bucket in self.engine.layout.group_buckets(self._tied_group):
                self.tied_comm.all_reduce(self.engine.reducer.owned_grad(bucket))

    def _sample_roles(self) -> None:
        for role, size in self.engine.memory_by_role().items():
            self.step_roles[role] = max(size, self.step_roles.get(role, 0))

    def _vote_overflow(self) -> None:
        if not self.engine.scaler.enabled or self.mesh.pp_size == 1:
            return
        flag = torch.tensor([1.0 if self.engine.overflow else 0.0], device=self.pp_comm.device)
        self.pp_comm.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.engine.overflow = bool(flag.item() > 0)

    def _global_loss(self, losses: list[torch.Tensor], over_dp: bool = True) -> float:
        """Mean over the dp replicas (or this replica's) of the sum of micro-batch losses, from the last stage
        to every rank."""
        total = torch.zeros(1, dtype=torch.float32, device=self.pp_comm.device)
        if self.holds_last:
            scale = self.engine.scaler.scale if self.engine.scaler.enabled else 1.0
            total += sum(float(l.detach()) for l in losses) / scale
            if over_dp:
                self.dp_scalars.all_reduce(total)
                total /= self.mesh.dp_size
        last = self._holder_ranks(self.num_stages - 1)
        self.pp_comm.broadcast(total, src_rank=last)
        return float(total.item())

    # ---- whole-model weights ---------------------------------------------------------------------
    def release_other_stages(self, model: nn.Module) -> int:
        """Free, in ``model`` (the HF model this pipeline was split from), the parameters and buffers no stage
        of this rank holds: each becomes an empty tensor of its dtype and device (its whole numel stays known
        to ``released_numel``). Returns the bytes freed. The model object stays (its config, its class for
        ``save_pretrained``); whole weights come from ``full_state_dict``, which gathers from the stage owners.
        """
        mine = {id(t) for stage in self.stages for t in (*stage.parameters(), *stage.buffers())}
        freed = 0
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, tensor in table.items():
                    if tensor is None or id(tensor) in mine or tensor.numel() == 0:
                        continue
                    if tensor.device.type != "meta":  # a stage-only build never read it: nothing to free
                        freed += tensor.numel() * tensor.element_size()
                    if isinstance(tensor, nn.Parameter):
                        tensor.hfzero_released_numel = tensor.numel()  # See released_numel
                        tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
                    else:
                        table[name] = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        logger.info("freed %d bytes of other stages' parameters and buffers in the source model", freed)
        return freed

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The whole model's state dict (CPU copies, HF names, the tied embedding once), assembled from every
        stage: a collective over the world. ``rank0_only``: other ranks get ``{}``."""
        from hfzero.runtime.stage3.state_dict import full_state_dict

        if self.zero_config.stage == 3:  # a collective of the stage's dp group
            mine = full_state_dict(self.module, rank0_only=False)
        else:
            mine = {n: t.detach().cpu().clone() for n, t in self.module.state_dict().items()}
        skip = {self.tied_names[1]} if self.tied_names is not None else set()
        mine = {self.hf_name(n): t for n, t in mine.items() if self.hf_name(n) not in skip or self.holds_first}
        world = self.engine.comm.on_group(dist.group.WORLD, share_stats=False)
        sender = self.mesh.dp_rank == 0
        described = [json.loads(b) for b in world.all_gather_bytes(json.dumps(
            [[n, list(t.shape), str(t.dtype).removeprefix("torch.")] for n, t in mine.items()] if sender else [])
            .encode())]
        out: dict[str, torch.Tensor] = {}
        for rank, entries in enumerate(described):  # in pp order: the first stage's names first
            for name, shape, dtype in entries:
                tensor = mine[name] if rank == dist.get_rank() else torch.empty(shape, dtype=getattr(torch, dtype))
                tensor = tensor.to(world.device)
                world.broadcast(tensor, src_rank=rank)
                out.setdefault(name, tensor.cpu())
        return {} if rank0_only and dist.get_rank() != 0 else out

    # ---- clipping -------------------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradient norm of the whole model (all stages, all shards; the tied embedding once)
        to ``max_norm``; return the norm before clipping (equal on every rank)."""
        engine = self.engine
        engine.materialize_grads()
        skip = set()
        if self.tied_comm is not None and not self.holds_first:  # the first stage counts the tied embedding
            skip = {b.index for b in engine.layout.group_buckets(self._tied_group)}
        grads = [m.grad for b, m in zip(engine.layout.buckets, engine.master_views) if b.index not in skip]
        norm_type = float(norm_type)
        device = engine.comm_device
        if norm_type == math.inf:
            local = max((float(g.abs().max()) for g in grads if g.numel()), default=0.0)
            total = torch.tensor([local], dtype=torch.float32, device=device)
            if engine.layout.shard_world > 1:
                self.shard_scalars.all_reduce(total, op=dist.ReduceOp.MAX)
            self.pp_comm.all_reduce(total, op=dist.ReduceOp.MAX)
            norm = total[0]
        else:
            local = sum((torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) ** norm_type for g in grads),
                        torch.zeros((), dtype=torch.float32))
            total = local.to(device).reshape(1)
            if engine.layout.shard_world > 1:
                self.shard_scalars.all_reduce(total)
            self.pp_comm.all_reduce(total)
            norm = total[0].pow(1.0 / norm_type)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        scale_([m.grad for m in engine.master_views if m.grad is not None], coef)
        return norm


def _stage_optimizer(optimizer: torch.optim.Optimizer, module: nn.Module,
                     tied: nn.Parameter | None) -> tuple[torch.optim.Optimizer, int | None, int | None]:
    """The user's optimizer rebuilt over this rank's parameters (same class, hyper-parameters, groups);
    the tied embedding, if held here, in a group of its own (see [Note: tied embeddings]). Returns the
    optimizer, the tied group's index in it and the index of the user's group the tied embedding came from."""
    mine = set(module.parameters())
    groups, tied_group, source = [], None, None
    for index, group in enumerate(optimizer.param_groups):
        options = {k: v for k, v in group.items() if k != "params"}
        params = [p for p in group["params"] if p in mine and p is not tied]
        groups.append({**options, "params": params})
        if tied is not None and any(p is tied for p in group["params"]):
            tied_group, source = len(optimizer.param_groups), index
            tied_options = options
    if tied is not None:
        if tied_group is None:
            raise ConfigError("hfzero pipeline: the tied embedding is not in the optimizer; build the optimizer "
                              "from model.parameters()")
        groups.append({**tied_options, "params": [tied]})
    return _rebuild(type(optimizer), groups, optimizer.defaults), tied_group, source


_PIPELINES: "weakref.WeakKeyDictionary[torch.optim.Optimizer, Pipeline]" = weakref.WeakKeyDictionary()

def released_numel(param: nn.Parameter) -> int | None:
    """The whole numel of a parameter another stage owns (freed here by ``release_other_stages``, which tags
    it), else None."""
    return getattr(param, "hfzero_released_numel", None)


def pipeline_of(optimizer: Any) -> Pipeline | None:
    """The Pipeline whose (stage) optimizer ``optimizer`` is, or None: lets integrations that hold the
    optimizer (checkpoints through the Trainer or accelerate) act on the whole pipeline."""
    try:
        return _PIPELINES.get(optimizer)
    except TypeError:
        return None


def pipeline(model: nn.Module, optimizer: torch.optim.Optimizer, config: ZeroConfig | None = None,
             pipeline_config: PipelineConfig | None = None, **options: Any) -> Pipeline:
    """Split ``model`` over a pp x dp mesh of the whole world and apply ZeRO inside each stage.

    Collective: every rank calls it with the same model (same weights), optimizer and configs.
    ``options`` are PipelineConfig fields (``pp_size=2, schedule="1F1B", n_microbatches=4``) when no
    ``pipeline_config`` is given. Returns the rank's Pipeline: ``train_step(input_ids)`` or
    ``forward_backward`` + ``clip_grad_norm_`` + ``optimizer.step()``; ``evaluate(input_ids)``.
    """
    for name, what in (("sp_size", "sequence"), ("tp_size", "tensor"), ("ep_size", "expert")):
        if config is not None and getattr(config, name) > 1:
            raise ConfigError(f"hfzero.pipeline: pipeline x {what} parallelism ({name} > 1) is not built; use one "
                              "of them")
    mesh = options.pop("mesh", None)
    pipeline_config = pipeline_config or PipelineConfig(**options)
    return Pipeline(model, optimizer, config or ZeroConfig(), pipeline_config, mesh=mesh)
