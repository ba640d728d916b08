"""ZeroConfig: the single source of hfzero's options, validated once.

Field names are the option names everywhere else: the Trainer and the launcher expose field ``x``
as ``--zero_x``, the accelerate integration reads ``HFZERO_X`` from the environment.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Literal

import torch

DtypeName = Literal["fp32", "bf16", "fp16"]
AccumulationName = Literal["auto", "sharded", "local"]

STAGE_AUTO = "auto"
"""``ZeroConfig.stage`` value asking the estimator to pick the stage (see hfzero/planning/autostage.py)."""

_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ConfigError(ValueError):
    """A ZeroConfig value is invalid; the message names the field and what to do."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """Options of the ZeRO engine.

    Attributes are documented one by one below; every one is validated in ``__post_init__``.
    """

    stage: int | Literal["auto"] = 2
    """ZeRO stage: 0 = DDP-equivalent baseline, 1 = optimizer states sharded (P_os), 2 = + gradients
    (P_os+g), 3 = + parameters (P_os+g+p). "auto": the lowest stage whose per-rank memory (model
    states, accumulation buffer, activation estimate) fits ``memory_budget_bytes`` or the device's
    memory, chosen by the Trainer/accelerate integration when the model is prepared
    (``hfzero.planning.autostage.resolve_auto_stage``); it is an int afterwards."""

    memory_budget_bytes: int = 0
    """stage="auto" only: bytes one rank may use. 0 = measure: free CUDA memory, or on a CPU the
    available RAM divided by the ranks on the host, each less 20% headroom."""

    dtype: DtypeName = "fp32"
    """Parameter and gradient dtype on the device: "fp32", "bf16" or "fp16". With 16-bit dtypes the
    optimizer steps fp32 master weights of the rank's shard (the paper's 2 + 2 + 12 bytes per
    parameter with Adam); "fp16" adds dynamic loss scaling."""

    reduce_bucket_size: int = 0
    """Elements per gradient bucket; 0 (default): sized to the model (``bucket_numel``: Ψ / (8N) within
    [2^18, 25M], Ψ trainable parameters, N ranks). Buckets are the unit of reduction and of sharding:
    each bucket is padded to a multiple of the world size and every rank owns an equal slice of it.
    Stage 2 holds at most ``max_inflight_buckets`` + 1 of them as staging, whatever the model size
    (ZeRO-R CB); bounding them by the model's size per rank keeps that staging a small fraction of the
    gradients stage 2 saves, for small models too."""

    allgather_bucket_size: int = 0
    """Stage 3: elements of prefetched (gathered ahead of use) parameters allowed in flight beyond the
    next unit, which is always prefetched whatever its size; 0 (default): sized to the model
    (``prefetch_numel``: Ψ / (2N) within [2^18, 25M]). Stages 1-2 gather updated parameters one reduce
    bucket per collective."""

    overlap_comm: bool = True
    """Launch each bucket's reduction asynchronously as soon as it is full, overlapping backward."""

    accumulation: AccumulationName = "auto"
    """When gradients of accumulation micro-batches (backward passes inside ``no_sync()``, or the
    micro-batches of a pipeline schedule) are reduced. "sharded": every backward pass reduce-scatters
    its gradients into the rank's shard (bucketed, overlapped with backward), so no full gradient is
    ever held across micro-batches: the stage's memory, n_micro x Ψ reduction traffic per step.
    "local": full local gradients accumulate across micro-batches and are reduced once at the
    synchronizing backward (or step): one reduction per step, but stages 2-3 then hold a full
    gradient buffer across micro-batches (a model state, GRAD_ACCUM: 2Ψ in bf16). "auto" picks
    "sharded" at stages 2-3 (memory is why they are chosen) and "local" at stages 0-1 (which hold full
    gradients anyway). See docs/engine.md for the memory/traffic table."""

    max_inflight_buckets: int = 2
    """Bucket reductions allowed in flight at once; launching one more waits for the oldest."""

    reduce_scatter_impl: Literal["auto", "native", "all_reduce"] = "auto"
    """How a reduce-scatter is carried out. "native" calls the backend's reduce_scatter; "all_reduce"
    all-reduces and keeps the owned slice; "auto" picks per backend by measurement (gloo:
    all-reduce, 100 MB in ~70 ms against ~125 ms for reduce_scatter; NCCL: native, half the bytes)."""

    param_persistence_threshold: int = 100_000
    """Stage 3: parameters with fewer elements stay whole on every rank (counted as PARAM_FULL). The
    default was chosen with benchmarks/persistence_threshold.py: on a 5.3M-parameter GPT-2 at world 2
    it keeps 5.8% of the parameters whole (+1.4% model states) for a 2.6% faster step than 0, while
    1e6 keeps 60% whole (+15%) for 5.8%."""

    stage3_buffers: str = "resized"
    """Stage 3: how each unit's full buffer gets and loses its memory (see [Note: stage-3 gather buffers] in
    runtime/stage3/buffers.py). "resized" (the default, any device): release resizes the storage to 0 bytes
    and a gather resizes it back through the allocator (CUDA's caching allocator is the pool; on the host,
    glibc). "mapped" (CPU ranks on Linux only): the storage wraps a private mapping whose pages go back to
    the kernel at every release, so the process's resident memory drops by the unit at once; it pays a
    page fault per 4 KiB page on every gather (13% more step time on a 5.3M GPT-2 on 2 CPU ranks, for the same
    peak; docs/stage3.md)."""

    find_unused_parameters: bool = False
    """As in DDP: before each step, agree across ranks (one all-reduce of a flag per parameter) on which
    parameters received no gradient on any rank since the last step, and leave those parameters and
    their optimizer states untouched by the step (otherwise weight decay and momentum still move them).
    Adam's per-slice step counter still advances for them."""

    host_mmap_threshold: int = 0
    """CPU engines: bytes from which glibc malloc maps blocks of their own (``mallopt(M_MMAP_THRESHOLD)``,
    set once per process by ``prepare``); 0 (the default) leaves glibc's dynamic threshold alone, as
    DDP runs: hfzero pools what it allocates itself, so the peak is DDP's and the step pays nothing.
    1048576 (1 MiB) with ``host_trim`` gives the lowest peak (0.8x DDP's on GPT-2 5.3M, batch 8 x 128)
    at ~1.5x the step time: every larger activation block is mapped and zero-filled each step. See
    [Note: host allocator] in runtime/hostmem.py."""

    host_trim: bool = False
    """CPU engines: after an optimizer step hand the heap's free pages back to the system (glibc
    ``malloc_trim(0)``), after every step or, with ``host_trim_slack`` above 0, only when the resident
    memory grew past its settled level by more than that (glibc's own trim of the heap's top is then
    turned off). Off by default: trimmed pages fault in again at the next step. See [Note: host allocator]."""

    host_trim_slack: float = 0.0
    """CPU engines with ``host_trim``: 0 trims after every step; above 0, the fraction of the
    settled resident memory by which the resident memory after a step may exceed it before the heap is
    trimmed (each trim makes the next step fault its heap pages in again)."""

    offload_optimizer: bool = False
    """ZeRO-Offload: keep the shard's fp32 master weights, optimizer states and (stages 2-3) fp32
    gradients in host memory, pinned, with asynchronous copies overlapped with backward and the
    all-gather, and step on the host (fused CPU AdamW where torch has it); the parameters stay on their
    device. On a CPU device there is nothing to offload: said once, the ordinary path runs. See
    docs/engine.md, "ZeRO-Offload"."""

    loss_scale: float = 0.0
    """fp16 only: a fixed loss scale, or 0 for dynamic loss scaling."""

    initial_loss_scale: float = 2.0**16
    """fp16 dynamic scaling: the starting scale."""

    loss_scale_window: int = 1000
    """fp16 dynamic scaling: steps without overflow before the scale doubles."""

    loss_scale_hysteresis: int = 2
    """fp16 dynamic scaling: overflows tolerated before the scale halves."""

    min_loss_scale: float = 1.0
    """fp16 dynamic scaling: the scale never drops below this."""

    tp_size: int = 1
    """Tensor-parallel degree: ZeRO runs over the data-parallel group of a (world / tp_size) x tp_size
    mesh; the model's parameters are sharded over the TP group by transformers' tp_plan or
    parallelize_module (see hfzero/parallel/tensor.py). 1: data parallelism alone."""

    ep_size: int = 1
    """Expert-parallel degree for mixture-of-experts models: each MoE layer's experts are split over groups of
    ep_size ranks by the model's transformers ``base_model_ep_plan``, tokens travel to their experts by
    all-to-all, and every rank still reads its own batch; dense parameters are ZeRO-sharded over the whole
    world, experts over the world / ep_size ranks holding the same experts (see hfzero/parallel/expert.py,
    docs/moe.md). 1: no expert parallelism."""

    sp_size: int = 1
    """Sequence-parallel degree (Ulysses-style): each sequence is split over sp_size ranks and attention
    runs on all heads of the whole sequence through an all-to-all; ZeRO shards the model states over all
    world ranks (dp x sp) and averages gradients over the world / sp_size data-parallel replicas (see
    hfzero/parallel/sequence/). 1: no sequence parallelism. Not combined with tp_size or pipelines yet."""

    loss_tiles: int = 1
    """Tiled logits + loss: a causal LM's vocabulary projection and cross entropy run over this many slices of
    the sequence, each recomputed in backward, so one slice's logits are alive instead of the sequence's
    (hfzero/parallel/sequence/tiled_loss.py). Applied by prepare_sequence_parallel, ZeroTrainer and
    ZeroAccelerator; by hand: hfzero.parallel.sequence.enable_tiled_loss. 1: the model's own loss."""

    mlp_tiles: int = 1
    """Tiled MLP: every decoder layer's ``mlp`` runs over this many slices of the sequence, each recomputed in
    backward, so one slice's intermediate activations (B x T/mlp_tiles x intermediate_size) are alive instead
    of the sequence's and none are kept across the forward (hfzero/runtime/activations/tiled_mlp.py). Applied
    by hfzero.prepare (every entry point). 1: the model's own MLP."""

    shard_size: int = 0
    """HSDP / MiCS: shard model states over groups of ``shard_size`` consecutive data-parallel ranks and
    replicate them across the dp_world / shard_size groups (a 2-D DeviceMesh dp_replicate x dp_shard).
    Gradients are reduce-scattered inside the shard group, then all-reduced across the replicate group on
    the shard only; stage 3 gathers parameters inside the shard group; averaging still divides by the whole
    data-parallel world. 0 (default): the whole data-parallel world is one shard group (flat ZeRO). Must be
    at least 2 and divide the data-parallel world; stages 1-3. Pick ranks per node (or a divisor of it) so
    that gathers and reduce-scatters stay inside a node. See docs/multinode.md."""

    secondary_partition: bool = False
    """hpZ (ZeRO++), stage 3: when a unit is released after a training forward, keep a secondary copy of its
    parameters sharded over this rank's node (1/ranks_per_node of the unit, PARAM_SECONDARY) so the backward
    pass gathers it inside the node instead of across the whole group; dropped when the backward is done with
    the unit (and at every step). Costs (Ψ - P)/ranks_per_node parameter elements per rank from the end of a
    forward to the backward. Does nothing when the group lies inside one node (e.g. HSDP with shard_size <=
    ranks per node). See docs/multinode.md."""

    ranks_per_node: int = 0
    """Ranks per node, for the intra-/inter-node split of every collective's bytes (see [Note: node
    traffic] in hfzero/comm/collectives.py). 0 (default): detected from LOCAL_WORLD_SIZE (torchrun, ``hfzero run
    --nnodes``), else the whole world is one node. Set it to simulate several nodes on one host (e.g. 2
    on a 4-rank run: ranks 0-1 form node 0, ranks 2-3 node 1). Must divide the world size."""

    quantize_weights: str | None = None
    """qwZ (ZeRO++): "int8" all-gathers parameters block-quantized (symmetric int8, one fp32 scale per
    ``quantize_block`` elements, decoded into the compute dtype): stage 3's gathers and the post-step all-gather
    at stages 1-2; the owner's chunk keeps its exact value, master weights and optimizer states stay fp32, hpZ's
    intra-node backward gathers stay unquantized. Error per element <= scale / 2, scale = max|x| / 127 of its
    block. None (default): unquantized. Stages 1-3. See docs/multinode.md."""

    quantize_gradients: str | None = None
    """qgZ (ZeRO++): "int8" or "int4" replaces the gradient reduce-scatter by a hierarchical quantized one: an
    all-to-all inside each node, then one across nodes, each hop quantized per ``quantize_block`` (int4: two
    codes per byte, scale = max|x| / 7), decoded and summed in fp32 (error feedback: ``quantize_error_feedback``).
    A block holding an inf/NaN decodes to NaN, so fp16 overflow still skips the step on every rank. None (default):
    unquantized. Stages 1-3, over any data-parallel group layout: the whole world, HSDP shard groups, a pipeline
    stage's dp ranks, a tensor-parallel dp group (not with ep_size or sp_size > 1). See docs/multinode.md."""

    quantize_error_feedback: bool = False
    """qgZ error feedback: each rank keeps, per bucket and hop, the quantization residual of what it sent (value
    minus its decoded code, fp32) and adds it to the next reduction of that bucket before quantizing, so the error
    does not accumulate over steps. Held across steps, so a model state (QUANT_RESIDUAL): per rank, fp32, the
    padded parameter count for the intra-node hop (when the group has more than one rank per node) plus 1/L of it
    for the inter-node hop (when it spans nodes; L = the group's ranks per node). Saved in checkpoints with the
    rank's shard and restored on a resume into the same layout (world size, stage, groups, ranks per node, bucket
    sizes); dropped, with a warning, on any other. Needs ``quantize_gradients``."""

    quantize_block: int = 256
    """Elements per quantization block (one fp32 scale each) for ``quantize_weights`` / ``quantize_gradients``:
    smaller blocks bound the error tighter and cost 4 / block bytes per element more. Even with int4."""

    partition_activations: bool = False
    """ZeRO-R P_a: keep each activation checkpoint as a 1/tp_size slice on each TP rank and all-gather it
    for the recomputation in backward (needs tp_size > 1 and activation checkpointing)."""

    cpu_checkpointing: bool = False
    """ZeRO-R P_a+cpu: keep the activation checkpoints in host memory (pinned, asynchronous copies)."""

    contiguous_checkpoints: bool = False
    """ZeRO-R MD: copy activation checkpoints into per-layer buffers allocated once and reused every step."""

    auto_resume: bool = True
    """ZeroTrainer only: when torchelastic restarted the workers (``TORCHELASTIC_RESTART_COUNT`` > 0, e.g.
    ``hfzero run --max_restarts 1`` after a rank died), resume from the newest complete ``checkpoint-N``
    in ``output_dir`` if the script passed no ``resume_from_checkpoint``. A fresh start never resumes
    on its own. false: restarted workers train from step 0 as the script says (docs/integrations.md)."""

    async_save: bool = False
    """Asynchronous checkpoint saves (``hfzero.checkpoint.save_checkpoint``, and so ZeroTrainer's and
    ZeroAccelerator's saves): the save blocks the step only for a few small collectives and copying the
    persistent buffers; a background thread copies the rank's shard into a host staging buffer (kept and
    reused from save to save: a model state, CKPT_STAGING; the next optimizer step waits for that copy),
    then writes, fsyncs and renames the files into place. The next save, a load, the end of ZeroTrainer.train or
    ZeroAccelerator.end_training, destroy_process_group and process exit wait for it; a background failure
    is raised there on every rank. See docs/checkpoints.md."""

    def __post_init__(self) -> None:
        _check((_is_int(self.stage) and self.stage in (0, 1, 2, 3)) or self.stage == STAGE_AUTO, "stage", self.stage,
               'must be 0, 1, 2, 3 or "auto"')
        _check(isinstance(self.memory_budget_bytes, int) and self.memory_budget_bytes >= 0, "memory_budget_bytes",
               self.memory_budget_bytes, "must be an integer >= 0 (0 = measure the device)")
        _check(self.dtype in _DTYPES, "dtype", self.dtype, 'must be "fp32", "bf16" or "fp16"')
        for name in ("reduce_bucket_size", "allgather_bucket_size"):
            value = getattr(self, name)
            _check(isinstance(value, int) and not isinstance(value, bool) and value >= 0, name, value,
                   "must be a positive integer, or 0 to size it to the model")
        for name in ("max_inflight_buckets", "loss_scale_window",
                     "loss_scale_hysteresis"):
            value = getattr(self, name)
            _check(_is_int(value) and value > 0, name, value, "must be a positive integer")
        _check(_is_int(self.param_persistence_threshold) and self.param_persistence_threshold >= 0,
               "param_persistence_threshold", self.param_persistence_threshold, "must be an integer >= 0")
        _check(_is_int(self.host_mmap_threshold) and 0 <= self.host_mmap_threshold <= 1 << 25,
               "host_mmap_threshold", self.host_mmap_threshold,
               "must be an integer in [0, 33554432] (glibc's largest; 0 = glibc's dynamic threshold)")
        _check(isinstance(self.host_trim_slack, (int, float)) and not isinstance(self.host_trim_slack, bool)
               and 0 <= self.host_trim_slack <= 1, "host_trim_slack", self.host_trim_slack,
               "must be a number in [0, 1] (0 = trim after every step)")
        _check(self.stage3_buffers in ("resized", "mapped"), "stage3_buffers", self.stage3_buffers,
               'must be "resized" or "mapped"')
        _check(self.accumulation in ("auto", "sharded", "local"), "accumulation", self.accumulation,
               'must be "auto", "sharded" or "local"')
        _check(self.reduce_scatter_impl in ("auto", "native", "all_reduce"), "reduce_scatter_impl",
               self.reduce_scatter_impl, 'must be "auto", "native" or "all_reduce"')
        for name in ("overlap_comm", "offload_optimizer", "find_unused_parameters", "host_trim"):
            _check(isinstance(getattr(self, name), bool), name, getattr(self, name), "must be true or false")
        for name in ("loss_scale", "initial_loss_scale", "min_loss_scale"):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value), name,
                   value, "must be a finite number")
        _check(self.loss_scale >= 0, "loss_scale", self.loss_scale, "must be >= 0 (0 = dynamic)")
        _check(self.initial_loss_scale > 0, "initial_loss_scale", self.initial_loss_scale, "must be > 0")
        _check(self.min_loss_scale > 0, "min_loss_scale", self.min_loss_scale, "must be > 0")
        for name in ("partition_activations", "cpu_checkpointing", "contiguous_checkpoints", "auto_resume",
                     "async_save"):
            _check(isinstance(getattr(self, name), bool), name, getattr(self, name), "must be true or false")
        _check(_is_int(self.tp_size) and self.tp_size > 0, "tp_size", self.tp_size, "must be a positive integer")
        _check(_is_int(self.ep_size) and self.ep_size > 0, "ep_size", self.ep_size, "must be a positive integer")
        _check(self.ep_size == 1 or self.tp_size == 1, "ep_size", self.ep_size,
               "cannot be combined with tp_size > 1 yet (expert x tensor parallelism is not built); use one of them")
        _check(self.ep_size == 1 or self.dtype != "fp16", "ep_size", self.ep_size,
               'cannot be combined with dtype="fp16" yet (loss scaling under expert parallelism is not built or '
               'tested); use dtype="bf16" or "fp32"')
        _check(self.ep_size == 1 or not self.offload_optimizer, "ep_size", self.ep_size,
               "cannot be combined with offload_optimizer yet (the host step of a shard sharded over two groups, "
               "dense and expert, is not built or tested); drop one of them")
        _check(_is_int(self.sp_size) and self.sp_size > 0, "sp_size", self.sp_size, "must be a positive integer")
        _check(_is_int(self.loss_tiles) and self.loss_tiles > 0, "loss_tiles", self.loss_tiles,
               "must be a positive integer (1: untiled)")
        _check(_is_int(self.mlp_tiles) and self.mlp_tiles > 0, "mlp_tiles", self.mlp_tiles,
               "must be a positive integer (1: untiled)")
        _check(self.sp_size == 1 or self.tp_size == 1, "sp_size", self.sp_size,
               "cannot be combined with tp_size > 1 yet (tensor x sequence parallelism is not built); use one of them")
        _check(self.sp_size == 1 or self.ep_size == 1, "sp_size", self.sp_size,
               "cannot be combined with ep_size > 1 yet (expert x sequence parallelism is not built); use one of them")
        _check(not self.partition_activations or self.tp_size > 1, "partition_activations", True,
               "partitions activation checkpoints over the tensor-parallel group, where every rank holds the same "
               "checkpoint; with tp_size=1 (data parallelism alone) each rank's checkpoints are of its own batch, "
               "so there is nothing to partition: set tp_size > 1 or drop partition_activations"
               + (" (under sp_size each rank's checkpoints are already its 1/sp_size of the sequence: they are "
                  "partitioned over the SP group by construction; cpu_checkpointing offloads them)"
                  if self.sp_size > 1 else ""))
        for name in ("shard_size", "ranks_per_node"):
            value = getattr(self, name)
            _check(_is_int(value) and value >= 0, name, value, "must be an integer >= 0 (0 = the default)")
        _check(self.shard_size != 1, "shard_size", 1,
               "must be 0 (the whole data-parallel world) or at least 2; a shard group of one rank replicates "
               "everything: use stage 0 for plain data parallelism")
        _check(isinstance(self.secondary_partition, bool), "secondary_partition", self.secondary_partition,
               "must be true or false")
        _check(not self.secondary_partition or self.stage == 3, "secondary_partition", True,
               "keeps a node-local copy of stage 3's partitioned parameters for backward; set stage=3 (below "
               "stage 3 parameters are not partitioned, so there is nothing to gather in backward)")
        _check(not self.shard_size or self.stage != 0, "shard_size", self.shard_size,
               "shards model states, which stage 0 does not: use stage 1, 2 or 3 (or drop shard_size)")
        for other, what in (("ep_size", "expert"), ("sp_size", "sequence")):
            _check(getattr(self, other) == 1 or not (self.shard_size or self.secondary_partition),
                   "shard_size" if self.shard_size else "secondary_partition", self.shard_size or True,
                   f"cannot be combined with {other} > 1 yet (HSDP / hpZ x {what} parallelism is not built); "
                   f"use one of them")
        _check(self.quantize_weights in (None, "int8"), "quantize_weights", self.quantize_weights,
               'must be "int8" or unset (None: unquantized all-gathers)')
        _check(self.quantize_gradients in (None, "int8", "int4"), "quantize_gradients", self.quantize_gradients,
               'must be "int8", "int4" or unset (None: unquantized reduce-scatter)')
        _check(_is_int(self.quantize_block) and self.quantize_block >= 1, "quantize_block", self.quantize_block,
               "must be an integer >= 1 (elements per scale; e.g. 256)")
        quantized = self.quantize_weights or self.quantize_gradients
        _check(not quantized or self.stage != 0, "quantize_weights" if self.quantize_weights else "quantize_gradients",
               quantized, "quantizes ZeRO's all-gathers / reduce-scatters, which stage 0 (an all-reduce) does not run: "
               "use stage 1, 2 or 3, or drop the quantization")
        _check(self.quantize_gradients != "int4" or self.quantize_block % 2 == 0, "quantize_block",
               self.quantize_block, "must be even with quantize_gradients=\"int4\" (two codes per byte): e.g. 256")
        _check(not self.quantize_error_feedback or bool(self.quantize_gradients), "quantize_error_feedback",
               self.quantize_error_feedback, "keeps the residual of quantized gradients: set quantize_gradients "
               '("int8" or "int4") too, or drop it')
        _check(not self.quantize_gradients or self.ep_size == 1 and self.sp_size == 1,
               "quantize_gradients", self.quantize_gradients, "cannot be combined with ep_size or sp_size > 1 yet "
               "(not built or tested with expert or sequence parallelism; tp_size and pipelines work); drop one")
        _check(self.min_loss_scale <= self.initial_loss_scale, "min_loss_scale", self.min_loss_scale,
               f"must not exceed initial_loss_scale ({self.initial_loss_scale})")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of parameters and gradients on the device."""
        return _DTYPES[self.dtype]

    @property
    def accumulation_policy(self) -> Literal["sharded", "local"]:
        """The accumulation policy that runs: ``accumulation`` with "auto" resolved by stage."""
        if self.accumulation != "auto":
            return self.accumulation  # type: ignore[return-value]
        return "sharded" if self.stage >= 2 else "local"

    def bucket_numel(self, num_params: int, world_size: int) -> int:
        """Elements per gradient bucket: ``reduce_bucket_size``, or with 0 the model-sized default
        Ψ / (8N), within [2^18, 25M] (large models keep constant-size buckets, ZeRO-R CB)."""
        if self.reduce_bucket_size:
            return self.reduce_bucket_size
        return _bounded(num_params, 8 * world_size)

    def prefetch_numel(self, num_params: int, world_size: int) -> int:
        """Stage-3 prefetch budget in elements: ``allgather_bucket_size``, or with 0 the model-sized
        default Ψ / (2N), within [2^18, 25M] (at least one decoder block for usual models)."""
        if self.allgather_bucket_size:
            return self.allgather_bucket_size
        return _bounded(num_params, 2 * world_size)

    @property
    def mixed_precision(self) -> bool:
        """True when parameters are 16-bit and the optimizer steps fp32 master weights."""
        return self.dtype != "fp32"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def field_doc(cls, name: str) -> str:
        """The docstring written under field ``name`` (used for generated CLI help)."""
        return _FIELD_DOCS.get(name, "")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "ZeroConfig":
        """Build a config from a mapping, rejecting unknown keys with the list of valid ones."""
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise ConfigError(f"unknown ZeroConfig option(s) {unknown}; valid options are {cls.field_names()}")
        return cls(**values)

    @classmethod
    def from_strings(cls, values: dict[str, str]) -> "ZeroConfig":
        """Build a config from string values (command line, environment), converting each by its field type."""
        converted: dict[str, Any] = {}
        defaults = cls()
        for key, raw in values.items():
            if key not in cls.field_names():
                raise ConfigError(f"unknown ZeroConfig option {key!r}; valid options are {cls.field_names()}")
            converted[key] = _convert(key, raw, type(getattr(defaults, key)))
        return cls.from_dict(converted)


_BUDGET_MIN = 2**18
_BUDGET_MAX = 25_000_000
"""Bounds of the model-sized transient buffers (``bucket_numel``, ``prefetch_numel``), in elements."""


def stage3_gathered_numel(root: int, others: "list[int] | tuple[int, ...]", prefetch: int) -> int:
    """Most elements stage 3 holds gathered at once: the root (gathered for the whole pass), the unit in
    use and what is prefetched ahead of it: the next unit whatever its size, further ones within
    ``prefetch``. Bounded by root + largest + max(second largest, prefetch), at most every unit; when every
    unit is larger than the budget, the root and the two largest other units (See [Note: stage-3 gather
    order] in runtime/stage3/scheduler.py). Shared by the estimator and the profile header."""
    ordered = sorted(others, reverse=True)
    largest = ordered[0] if ordered else 0
    ahead = max(ordered[1] if len(ordered) > 1 else 0, min(prefetch, sum(ordered[1:])))
    return root + largest + ahead


def _bounded(num_params: int, divisor: int) -> int:
    return min(_BUDGET_MAX, max(_BUDGET_MIN, -(-num_params // divisor)))


def _convert(name: str, raw: str, kind: type) -> Any:
    if name == "stage" and raw.strip().lower() == STAGE_AUTO:
        return STAGE_AUTO
    if kind is type(None):  # an optional text field (quantize_*): "none" / "" unset it
        return None if raw.strip().lower() in ("", "none", "off") else raw.strip().lower()
    try:
        if kind is bool:
            lowered = raw.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind is int:
            if "e" not in raw.lower():
                return int(raw)
            value = float(raw)  # 25e6: an integer written in exponent form, nothing else
            if not value.is_integer():
                raise ValueError(raw)
            return int(value)
        if kind is float:
            return float(raw)
        return raw
    except (ValueError, OverflowError):
        raise ConfigError(f"ZeroConfig.{name}: cannot read {raw!r} as {kind.__name__}") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, name: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"ZeroConfig.{name}={value!r} is invalid: {name} {rule}.")


def _read_field_docs() -> dict[str, str]:
    """Collect the string literal under each field (the torchtitan convention) from this module's source."""
    import ast
    import inspect

    docs: dict[str, str] = {}
    tree = ast.parse(inspect.getsource(ZeroConfig))
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


_FIELD_DOCS = _read_field_docs()
