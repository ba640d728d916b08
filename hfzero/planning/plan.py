"""``hfzero plan``: every configuration of a model on some hardware, with per-rank peak memory and an
estimated step time, ranked by estimated throughput among those that fit. See ``docs/plan.md``.

[Note: plan cost model]
Memory per rank reuses the estimator, never a copy of it:
- model states: ``estimate.model_states_bytes`` (pp = 1; Ψ / tp per rank) or the pipeline cost model's
  roles (``parallel.pipeline.cost.estimate_pipeline``, the worst pp rank) with Ψ / tp split evenly;
- transient: at stages 2-3 ``max_inflight_buckets`` + 1 gradient staging buckets (``ZeroConfig.bucket_numel``,
  g bytes each; stages 0-1 reduce in place in the full gradient, a model state); at stage 3 with the config's
  units known, their gradient staging instead (``estimate.stage3_grad_staging_bytes``: the root's and the two
  largest units' full gradients, what the GRAD_BUCKET pool holds) and the gathered units
  (``estimate.stage3_gathered_bytes``), else the buckets and the prefetch budget ``ZeroConfig.prefetch_numel`` twice;
- activations: the activation model (``estimate.decoder_activation_bytes`` or, for encoders and
  encoder-decoders, ``estimate_activations.encoder_activation_bytes``) for one micro-batch, times the
  micro-batches a pipeline rank holds (``cost.activation_in_flight``), with the layers divided over pp;
- runtime: a constant per process for what the framework itself keeps resident (``--runtime-bytes``;
  on CPU ranks the RSS of a process that imported torch and transformers, measured once).
A configuration fits when the sum is at most (1 - headroom) of the device's memory.

Step time (seconds per optimizer step, per rank; nothing assumed to overlap, so it is an upper bound):
- compute: FLOPs / (devices x sustained FLOP/s). FLOPs = 6 Ψ T + 12 L h s T (dense and attention
  matmuls, forward + backward, T tokens per step; Narayanan et al. 2021), x 4/3 with checkpointing
  (one more forward); multiplied by 1 + the pipeline bubble ``cost.bubble_fraction``;
- data-parallel communication: the elements ``estimate.comm_elements_per_step`` (pp = 1) or
  ``cost.comm_elements`` (pp > 1) count, in p / g bytes, through a ring ((N - 1) / N of them cross each
  link) at the link bandwidth of the dp group (intra-node when tp x dp fits in a node);
- tensor parallelism: 4 all-reduces of s b h per layer and micro-batch (6 with checkpointing), each
  2 (t - 1) / t of its bytes, at the intra-node bandwidth;
- pipeline: activation and gradient of every micro-batch across each of the P - 1 boundaries;
- offload: gradients down and parameters up over PCIe (2 x p Ψ / N_d bytes) plus the host's Adam
  (Ψ / N_d elements at ``HOST_ADAM_ELEMENTS_PER_S``).
Ties (step times equal to 4 significant digits: stages 0-2 move the same 2Ψ) go to the lower stage, then
to fewer, larger micro-batches (better device utilization, which the FLOP count does not see), then to the
lower peak. Not modelled: per-collective latency, kernel efficiency at small sizes, overlap of communication
with compute. On CPU ranks tensor parallelism is left out unless asked for (``max_tp``): its per-layer
all-reduces are latency-bound on gloo, which this model does not count.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

from hfzero.planning import estimate as est

LINK_BYTES_PER_S: dict[str, float] = {
    "nvlink": 300e9,     # NVLink 3/4 per direction per GPU, order of magnitude
    "pcie": 16e9,        # PCIe 4.0 x16 per direction
    "ib": 25e9,          # InfiniBand HDR 200 Gb/s
    "ethernet": 3.1e9,   # 25 GbE
    "shm": 2e9,          # gloo over loopback on one host (CPU ranks)
}
"""Default link bandwidths (bytes/s) by name; ``--intra`` / ``--inter`` take a name or a number."""

DEFAULT_GPU_TFLOPS = 150.0
"""Sustained 16-bit TFLOP/s per GPU by default (about half an A100's dense peak)."""

DEFAULT_CPU_GFLOPS = 8.0
"""Sustained fp32 GFLOP/s per CPU rank by default (one core of this machine's class)."""

HOST_ADAM_ELEMENTS_PER_S = 1e9
"""Elements per second a host steps with CPU Adam (ZeRO-Offload's figure, order of magnitude)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hardware:
    """Where the job runs.

    Attributes:
        devices_per_node: accelerators (or CPU ranks) per node.
        nodes: nodes.
        memory_bytes: memory per device (per CPU rank: the host's memory divided by the ranks).
        flops: sustained FLOP/s per device.
        intra_bytes_per_s: bandwidth of a link inside a node.
        inter_bytes_per_s: bandwidth between nodes.
        pcie_bytes_per_s: device <-> host bandwidth (offload).
        cpu: CPU ranks (no offload: the host is the device).
        runtime_bytes: memory each process keeps for the framework itself (counted in every peak).
    """

    devices_per_node: int
    nodes: int = 1
    memory_bytes: float
    flops: float
    intra_bytes_per_s: float
    inter_bytes_per_s: float
    pcie_bytes_per_s: float = LINK_BYTES_PER_S["pcie"]
    cpu: bool = False
    runtime_bytes: float = 0.0

    @property
    def devices(self) -> int:
        return self.devices_per_node * self.nodes


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """What is trained.

    Attributes:
        params: Ψ, trainable parameters.
        seq_len: tokens per sequence.
        global_batch: sequences per optimizer step over all replicas.
        dtype: "bf16" | "fp16" | "fp32".
        optimizer: "adam" | "adamw" | "sgd_momentum" | "sgd".
        shape: the activation model's shape (``DecoderShape`` or ``EncoderShape``), None with --params.
        stage3_units: (root, other units) elements for stage 3's gathered bytes, None: the prefetch rule.
        device: "cuda" or "cpu" for the activation model's dropout masks.
    """

    params: float
    seq_len: int
    global_batch: int
    dtype: str = "bf16"
    optimizer: str = "adam"
    shape: Any = None
    stage3_units: tuple[int, list[int]] | None = None
    device: str = "cuda"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
    """One configuration.

    Attributes:
        stage: ZeRO stage 0-3.
        dp, tp, pp: data / tensor / pipeline parallel degrees (dp x tp x pp = devices).
        micro_batch: sequences per micro-batch per replica.
        accumulation_steps: micro-batches per optimizer step (pipeline: micro-batches in flight).
        accumulation: "sharded" | "local" (what runs; ZeroConfig.accumulation).
        offload: ZeRO-Offload of the optimizer side.
        checkpointing: one activation checkpoint per layer.
        partition_activations: P_a (tp > 1 with checkpointing).
    """

    stage: int
    dp: int
    tp: int = 1
    pp: int = 1
    micro_batch: int
    accumulation_steps: int
    accumulation: str
    offload: bool = False
    checkpointing: bool = False
    partition_activations: bool = False

    def label(self) -> str:
        parts = [f"stage {self.stage}", f"dp {self.dp}"]
        parts += [f"tp {self.tp}"] if self.tp > 1 else []
        parts += [f"pp {self.pp}"] if self.pp > 1 else []
        parts.append(f"mb {self.micro_batch} x {self.accumulation_steps}")
        if self.accumulation_steps > 1 and self.stage >= 2:
            parts.append(self.accumulation)
        parts += ["offload"] if self.offload else []
        parts += ["ckpt" + ("+P_a" if self.partition_activations else "")] if self.checkpointing else []
        return ", ".join(parts)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanRow:
    """A candidate with its per-rank peak (bytes by part), step time (seconds by part) and verdict."""

    candidate: Candidate
    memory: dict[str, float]
    time: dict[str, float]
    tokens_per_s: float
    fits: bool
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"config": dataclasses.asdict(self.candidate), "label": self.candidate.label(), "memory": self.memory,
                "peak_bytes": self.memory["total"], "time": self.time, "step_s": self.time["total"],
                "tokens_per_s": self.tokens_per_s, "fits": self.fits, "reason": self.reason}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(work: Workload, hw: Hardware, *, max_tp: int | None = None, max_pp: int = 8,
               layers: int | None = None) -> list[Candidate]:
    """Every (stage, dp x tp x pp, micro-batch, accumulation policy, offload, checkpointing, P_a) for the
    hardware: tp within a node (a power of two dividing the node), pp up to ``max_pp`` and the layer count,
    the micro-batch a power of two dividing the per-replica batch (pp needs as many micro-batches as stages)."""
    out = []
    if max_tp is None:
        max_tp = 1 if hw.cpu else hw.devices_per_node
    tps = [t for t in _divisors(hw.devices_per_node) if t & (t - 1) == 0 and t <= max_tp]
    if work.shape is None:
        tps = [1]  # without the shape the tensor-parallel traffic is unknown
    for tp, pp in itertools.product(tps, _divisors(hw.devices)):
        if pp > max_pp or (layers and pp > layers) or hw.devices % (tp * pp):
            continue
        dp = hw.devices // (tp * pp)
        if work.global_batch % dp:
            continue
        per_replica = work.global_batch // dp
        for mb in (m for m in _divisors(per_replica) if m & (m - 1) == 0):
            steps = per_replica // mb
            if pp > 1 and steps < pp:
                continue
            checkpointing = (False, True) if work.shape is not None else (False,)  # no activations without a shape
            for stage, ckpt, offload in itertools.product(est.STAGES, checkpointing, (False, True)):
                if offload and (hw.cpu or pp > 1 or stage == 0):
                    continue
                policies = ("sharded", "local") if stage >= 2 and steps > 1 else (est.resolve_accumulation(stage),)
                for policy in policies:
                    for pa in ((False, True) if ckpt and tp > 1 and not _is_encoder(work.shape) else (False,)):
                        out.append(Candidate(stage=stage, dp=dp, tp=tp, pp=pp, micro_batch=mb, accumulation_steps=steps,
                                             accumulation=policy, offload=offload, checkpointing=ckpt,
                                             partition_activations=pa))
    return out


def _is_encoder(shape: Any) -> bool:
    """Encoders and encoder-decoders: their activation model has no P_a."""
    from hfzero.planning.activations import EncoderShape

    return isinstance(shape, EncoderShape)


def _model_states(c: Candidate, work: Workload) -> float:
    p, g, k = est.precision_bytes(work.dtype, work.optimizer)
    if c.pp == 1:
        return est.model_states_bytes(work.params, c.dp, c.stage, mp=c.tp, param_bytes=p, grad_bytes=g,
                                      optimizer_k=k, offload_optimizer=c.offload,
                                      accumulation_steps=c.accumulation_steps, accumulation=c.accumulation)
    from hfzero.parallel.pipeline.cost import StageShape, estimate_pipeline

    shapes = [StageShape(int(work.params / c.tp) // c.pp, 0, 0)] * c.pp
    result = estimate_pipeline(shapes, pp=c.pp, dp=c.dp, stage=c.stage, n_micro=c.accumulation_steps,
                               dtype=work.dtype, optimizer=work.optimizer, accumulation=c.accumulation)
    return max(rank["model_states_bytes"] for rank in result["ranks"])


def _transient(c: Candidate, work: Workload) -> float:
    from hfzero.config import ZeroConfig

    p, g, _ = est.precision_bytes(work.dtype, work.optimizer)
    per_rank = int(work.params / (c.tp * c.pp))
    zero = ZeroConfig()
    # stages 0-1 reduce in place in the full gradient (a model state); stages 2-3 stage buckets
    buckets = (zero.max_inflight_buckets + 1) * g * zero.bucket_numel(per_rank, c.dp) if c.stage >= 2 else 0.0
    if c.stage < 3 or c.pp > 1:  # pipeline stage 3 keeps its gathered parameters as a model-state role
        return float(buckets)
    if work.stage3_units is not None and c.pp == 1:  # the units' full gradients, not in-flight buckets
        root, units = work.stage3_units
        return (est.stage3_grad_staging_bytes(root, units, c.dp, grad_bytes=g, mp=c.tp)
                + est.stage3_gathered_bytes(root, units, c.dp, param_bytes=p, mp=c.tp))
    return buckets + 2.0 * p * min(per_rank, zero.prefetch_numel(per_rank, c.dp))


def _activations(c: Candidate, work: Workload) -> float:
    from hfzero.parallel.pipeline.cost import activation_in_flight

    if work.shape is None:
        return 0.0
    estimate = activation_estimate(work.shape, work.seq_len, c.micro_batch, dtype=work.dtype,
                                   checkpointing=c.checkpointing, tp=c.tp, partition=c.partition_activations,
                                   device=work.device)
    if c.pp == 1:
        return float(estimate.total)
    in_flight = activation_in_flight("1F1B", c.pp, 0, c.accumulation_steps)
    stored = (estimate.layers + estimate.checkpoints) / c.pp
    return float(in_flight * stored + estimate.recompute + estimate.head)


def activation_estimate(shape: Any, seq_len: int, batch: int, **kwargs: Any) -> Any:
    """The activation model for ``shape``: the encoder model for an ``EncoderShape``, else the decoder's."""
    from hfzero.planning.activations import EncoderShape, encoder_activation_bytes

    if isinstance(shape, EncoderShape):
        kwargs.pop("partition", None)
        return encoder_activation_bytes(shape, seq_len, batch, **kwargs)
    return est.decoder_activation_bytes(shape, seq_len, batch, **kwargs)


def peak_memory(c: Candidate, work: Workload, hw: Hardware) -> dict[str, float]:
    """Per-rank bytes by part: model states, transient, activations, runtime, and their total."""
    parts = {"model_states": _model_states(c, work), "transient": _transient(c, work),
             "activations": _activations(c, work), "runtime": float(hw.runtime_bytes)}
    return {**parts, "total": sum(parts.values())}


def _layers_hidden(work: Workload) -> tuple[int, int]:
    shape = work.shape
    if shape is None:
        return 0, 0
    return getattr(shape, "num_layers", 0) + getattr(shape, "num_decoder_layers", 0), shape.hidden_size


def step_time(c: Candidate, work: Workload, hw: Hardware) -> dict[str, float]:
    """Seconds per optimizer step by part (see [Note: plan cost model])."""
    from hfzero.parallel.pipeline.cost import bubble_fraction, comm_elements

    p, g, _ = est.precision_bytes(work.dtype, work.optimizer)
    tokens = work.global_batch * work.seq_len
    layers, hidden = _layers_hidden(work)
    flops = (6 * work.params * tokens + 12 * layers * hidden * work.seq_len * tokens) * (4 / 3 if c.checkpointing else 1)
    bubble = bubble_fraction(c.pp, c.accumulation_steps)
    compute = flops / (hw.devices * hw.flops) * (1 + bubble)
    per_rank = work.params / (c.tp * c.pp)
    if c.pp == 1:
        elements = est.comm_elements_per_step(per_rank, c.dp, c.stage, accumulation_steps=c.accumulation_steps,
                                              accumulation=c.accumulation)
    else:
        elements = sum(comm_elements(per_rank, c.dp, c.stage, c.accumulation_steps, accumulation=c.accumulation).values())
    dp_link = hw.intra_bytes_per_s if c.tp * c.dp <= hw.devices_per_node else hw.inter_bytes_per_s
    dp_comm = elements * max(p, g) * (c.dp - 1) / c.dp / dp_link if c.dp > 1 else 0.0
    e = 2 if work.dtype != "fp32" else 4
    replica_tokens = tokens / c.dp
    tp_comm = ((6 if c.checkpointing else 4) * (layers / c.pp) * replica_tokens * hidden * e * 2 * (c.tp - 1) / c.tp
               / hw.intra_bytes_per_s) if c.tp > 1 else 0.0
    pp_link = hw.intra_bytes_per_s if hw.devices_per_node >= c.tp * c.dp * c.pp else hw.inter_bytes_per_s
    pp_comm = 2 * replica_tokens * hidden * e / c.tp / pp_link if c.pp > 1 else 0.0
    offload = (2 * p * per_rank / c.dp / hw.pcie_bytes_per_s + per_rank / c.dp / HOST_ADAM_ELEMENTS_PER_S
               if c.offload else 0.0)
    parts = {"compute": compute, "dp_comm": dp_comm, "tp_comm": tp_comm, "pp_comm": pp_comm, "offload": offload}
    return {**parts, "bubble_fraction": bubble, "total": sum(parts.values())}


def _reason(memory: dict[str, float], budget: float) -> str:
    if memory["total"] <= budget:
        return "fits"
    biggest = max(("model_states", "transient", "activations", "runtime"), key=lambda k: memory[k])
    return (f"needs {memory['total'] / 1e9:.2f} GB per rank, budget {budget / 1e9:.2f} GB "
            f"({biggest.replace('_', ' ')} {memory[biggest] / 1e9:.2f} GB the largest part)")


def plan(work: Workload, hw: Hardware, *, headroom: float = est.DEFAULT_HEADROOM, max_tp: int | None = None,
         max_pp: int = 8) -> list[PlanRow]:
    """Every candidate with its peak, step time and verdict: those that fit first, fastest first (ties: lower
    stage, then lower peak), then those that do not, smallest peak first."""
    if not 0 <= headroom < 1:
        raise est.EstimateError(f"headroom must be in [0, 1), got {headroom!r}")
    budget = (1 - headroom) * hw.memory_bytes
    layers, _ = _layers_hidden(work)
    rows = []
    for c in candidates(work, hw, max_tp=max_tp, max_pp=max_pp, layers=layers or None):
        memory, time = peak_memory(c, work, hw), step_time(c, work, hw)
        fits = memory["total"] <= budget
        rows.append(PlanRow(candidate=c, memory=memory, time=time, tokens_per_s=work.global_batch * work.seq_len
                            / time["total"], fits=fits, reason=_reason(memory, budget)))
    rows.sort(key=lambda r: (not r.fits, -float(f"{r.tokens_per_s:.4g}") if r.fits else r.memory["total"],
                             r.candidate.stage, r.candidate.accumulation_steps, r.memory["total"]))
    return rows


def stage_memory_table(params: float, dp: int, memory_bytes: float, *, dtype: str = "bf16",
                       optimizer: str = "adam") -> list[dict[str, Any]]:
    """The paper's Table 1 row for one model and N_d: model states per stage and whether they fit."""
    p, g, k = est.precision_bytes(dtype, optimizer)
    rows = []
    for stage in est.STAGES:
        value = est.model_states_bytes(params, dp, stage, param_bytes=p, grad_bytes=g, optimizer_k=k)
        rows.append({"stage": stage, "name": est.STAGE_NAMES[stage], "model_states_bytes": value,
                     "fits": value <= memory_bytes})
    return rows


def link_bytes(value: str) -> float:
    """A link bandwidth from a name in ``LINK_BYTES_PER_S`` or a number of bytes/s (e.g. 25e9)."""
    if value.lower() in LINK_BYTES_PER_S:
        return LINK_BYTES_PER_S[value.lower()]
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number) or number <= 0:
        raise est.EstimateError(f"link bandwidth must be one of {sorted(LINK_BYTES_PER_S)} or bytes/s > 0, got {value!r}")
    return number


def workload_from_config(source: Any, *, seq_len: int, global_batch: int, dtype: str = "bf16",
                         optimizer: str = "adam", device: str = "cuda") -> Workload:
    """A workload from a Hugging Face config: Ψ counted on the meta device, the activation model's shape
    (encoder or decoder) and the stage-3 units."""
    config = est.load_hf_config(source)
    shape_cls = est.EncoderShape if est.is_encoder_config(config) else est.DecoderShape
    try:
        units: tuple[int, list[int]] | None = est.stage3_unit_numels(config)
    except est.EstimateError:  # no default units for this model: stage 3 falls back to the prefetch budget
        units = None
    return Workload(params=float(est.params_from_config(config)), seq_len=seq_len, global_batch=global_batch,
                    dtype=dtype, optimizer=optimizer, shape=shape_cls.from_hf_config(config),
                    stage3_units=units, device=device)


def runtime_bytes() -> float:
    """What this process keeps resident for the framework once torch (with torch.distributed), transformers
    and hfzero's engine and profiler are imported (RSS, measured once per process): the ``runtime`` part of a
    CPU rank's peak. A rank also holds its process group's threads and buffers, which this leaves out."""
    import psutil
    import torch.distributed  # noqa: F401  (the measurement is of the process with them loaded)
    import transformers  # noqa: F401

    import hfzero.runtime.engine  # noqa: F401
    import hfzero.profiler  # noqa: F401

    return float(psutil.Process().memory_info().rss)


def summary(rows: list[PlanRow], work: Workload, hw: Hardware, *, headroom: float) -> dict[str, Any]:
    """The JSON-ready plan: inputs, the paper's model states per stage at N_d = devices, every row."""
    budget = (1 - headroom) * hw.memory_bytes
    work_dict = {k: v for k, v in dataclasses.asdict(work).items() if k not in ("shape", "stage3_units")}
    work_dict["shape"] = type(work.shape).__name__ if work.shape is not None else None
    return {"workload": work_dict, "hardware": {**dataclasses.asdict(hw), "devices": hw.devices},
            "devices": hw.devices, "headroom": headroom, "budget_bytes": budget,
            "stages": stage_memory_table(work.params, hw.devices, hw.memory_bytes, dtype=work.dtype,
                                         optimizer=work.optimizer),
            "best": next((r.to_dict() for r in rows if r.fits), None),
            "configurations": [r.to_dict() for r in rows]}
