"""The ZeRO paper's memory model: model-state bytes per device, the largest model that fits, Ψ from a
Hugging Face config, an activation-memory estimate, and the smallest stage that fits.

Model states (see ``docs/estimate.md`` and the "model states" section of the architecture note) are
parameters, gradients and optimizer states in the form a stage keeps them. With Ψ parameters per
model-parallel rank (Ψ = num_params / mp), N_d data-parallel ranks, ``p`` bytes per parameter,
``g`` bytes per gradient and ``K`` bytes of optimizer state per parameter, one device holds
(Rajbhandari et al., arXiv 1910.02054, Section 5 and Figure 1)::

    stage 0 (baseline)    (p + g + K) Ψ
    stage 1 (P_os)        (p + g) Ψ + K Ψ / N_d
    stage 2 (P_os+g)      p Ψ + (g + K) Ψ / N_d
    stage 3 (P_os+g+p)    (p + g + K) Ψ / N_d

With bf16/fp16 and Adam (p = g = 2, K = 12) these are the paper's 16Ψ, 4Ψ + 12Ψ/N_d,
2Ψ + 14Ψ/N_d and 16Ψ/N_d. Each of the three parts starts being sharded at one stage
(``_SHARDED_FROM_STAGE``); the formulas above are that single policy written out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch


from hfzero.logging import get_logger
from hfzero.planning.shapes import EstimateError, TransformerShape, load_hf_config

logger = get_logger(__name__)

STAGES: tuple[int, ...] = (0, 1, 2, 3)
"""The ZeRO stages: 0 = baseline data parallelism, 1 = P_os, 2 = P_os+g, 3 = P_os+g+p."""

STAGE_NAMES: dict[int, str] = {0: "baseline", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}
"""The paper's name for each stage."""

_SHARDED_FROM_STAGE: dict[str, int] = {"params": 3, "grads": 2, "optimizer": 1}
"""The first stage at which each part of the model states is divided over the N_d ranks."""

DEFAULT_HEADROOM: float = 0.2
"""Fraction of device memory ``choose_stage`` keeps free for what the formula does not count:
gradient buckets, gathered stage-3 units, communication buffers, the allocator's caching and
fragmentation (the paper reports OOMs with over 30% of memory free before ZeRO-R's MD)."""


class PrecisionBytes(NamedTuple):
    """Bytes per parameter of each model-state part for one dtype and optimizer.

    Attributes:
        param_bytes: the parameter as the device holds it (2 for bf16/fp16, 4 for fp32).
        grad_bytes: its gradient, in the parameter's dtype.
        optimizer_k: the paper's K: fp32 master copy (mixed precision only) plus optimizer states.
    """

    param_bytes: int
    grad_bytes: int
    optimizer_k: int


class ModelStateBytes(NamedTuple):
    """Per-device bytes of each model-state part (wherever it lives, device or CPU).

    Attributes:
        params: parameters (full, or the rank's shard plus persistent parameters at stage 3).
        grads: gradients (full, or the rank's shard from stage 2).
        optimizer: the K part: fp32 master weights (mixed precision) and optimizer states.
    """

    params: float
    grads: float
    optimizer: float


_DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}

def checkpoint_staging_bytes(num_params: float, dp: int, *, mp: int = 1, param_bytes: int = 2,
                             optimizer_k: int = 12) -> float:
    """Host bytes per rank of an asynchronous checkpoint save's staging buffer (``ZeroConfig.async_save``,
    the engine's CKPT_STAGING, a model state once the first save allocated it): the fp32 master weights and
    fp32 optimizer states of the rank's slice, (K + 4)Ψ/N_d when the parameters are fp32 (their own master,
    not in K) else KΨ/N_d, at every stage (at stage 0 each rank writes 1/N_d of every bucket). RNG states
    (KiB) and the persistent buffers rank 0 stages are not counted."""
    _check_count("num_params", num_params)
    per_element = optimizer_k + (4 if param_bytes >= 4 else 0)
    return per_element * num_params / mp / dp


_OPTIMIZER_STATES: dict[str, int] = {"adam": 2, "adamw": 2, "sgd_momentum": 1, "sgd": 0}
"""fp32 state tensors per parameter: Adam's exp_avg and exp_avg_sq, SGD's momentum buffer, none."""


def precision_bytes(dtype: str = "bf16", optimizer: str = "adam") -> PrecisionBytes:
    """Map a dtype name and an optimizer kind to ``(param_bytes, grad_bytes, K)``.

    Optimizer states are fp32 (4 bytes each). With a 16-bit dtype the optimizer also steps an fp32
    master copy (4 more bytes); in fp32 the parameter is its own master copy::

        dtype      optimizer       p  g  K
        bf16/fp16  adam, adamw     2  2  12  (master 4 + exp_avg 4 + exp_avg_sq 4)
        bf16/fp16  sgd_momentum    2  2  8   (master 4 + momentum 4)
        bf16/fp16  sgd             2  2  4   (master 4)
        fp32       adam, adamw     4  4  8   (exp_avg 4 + exp_avg_sq 4)
        fp32       sgd_momentum    4  4  4   (momentum 4)
        fp32       sgd             4  4  0
    """
    if dtype not in _DTYPE_BYTES:
        raise EstimateError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPE_BYTES)}")
    if optimizer not in _OPTIMIZER_STATES:
        raise EstimateError(f"unknown optimizer {optimizer!r}; use one of {sorted(_OPTIMIZER_STATES)}")
    width = _DTYPE_BYTES[dtype]
    master = 4 if width < 4 else 0
    return PrecisionBytes(width, width, master + 4 * _OPTIMIZER_STATES[optimizer])


def _check_layout(dp: int, stage: int, mp: int) -> None:
    for name, value in (("dp", dp), ("mp", mp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EstimateError(f"{name} must be a positive integer, got {value!r}")
    if stage not in STAGES:
        raise EstimateError(f"stage must be one of {list(STAGES)}, got {stage!r}")


def _check_count(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise EstimateError(f"{name} must be a finite number >= 0, got {value!r}")


def _shard_divisor(part: str, stage: int, dp: int) -> int:
    """N_d if ``part`` ("params", "grads" or "optimizer") is sharded at ``stage``, else 1."""
    return dp if stage >= _SHARDED_FROM_STAGE[part] else 1


def model_states_breakdown(
    num_params: float,
    dp: int,
    stage: int,
    *,
    mp: int = 1,
    param_bytes: int = 2,
    grad_bytes: int = 2,
    optimizer_k: int = 12,
    persistent_params: float = 0,
    accumulation_steps: int = 1,
    accumulation: str = "auto",
    frozen_params: float = 0,
) -> ModelStateBytes:
    """Per-device bytes of parameters, gradients and the K part, wherever they live.

    Ψ = ``num_params / mp`` (trainable parameters). ``frozen_params`` Ψ_f (``requires_grad=False``:
    a LoRA fine-tune's base weights, also divided by ``mp``) have parameter bytes only, no gradient
    or optimizer state: whole at stages 0-2 (``param_bytes`` each), divided by N_d at stage 3, which
    partitions them too. ``persistent_params`` (a subset of Ψ + Ψ_f, also divided by ``mp``) matters
    at stage 3 only: those parameters stay whole on every rank, so
    params = param_bytes * ((Ψ + Ψ_f - P) / N_d + P) with P = persistent_params / mp. Gradients and
    optimizer states of persistent trainable parameters are sharded like every other one's, so grads
    and the K part use the plain formula. At stages 0-2 all parameters are whole anyway and P changes
    nothing.

    ``accumulation`` ("auto", "sharded", "local"; see ZeroConfig.accumulation) with
    ``accumulation_steps`` > 1: under "local" at stages 2-3 a full gradient buffer (g bytes per
    trainable parameter) is held across the micro-batches, a model state counted with the gradients.
    """
    _check_layout(dp, stage, mp)
    _check_count("num_params", num_params)
    _check_count("persistent_params", persistent_params)
    _check_count("frozen_params", frozen_params)
    if persistent_params > num_params + frozen_params:
        raise EstimateError(f"persistent_params ({persistent_params:g}) exceeds num_params + frozen_params "
                            f"({num_params + frozen_params:g})")
    psi, persistent, frozen = num_params / mp, persistent_params / mp, frozen_params / mp
    if stage >= _SHARDED_FROM_STAGE["params"]:
        params = param_bytes * ((psi + frozen - persistent) / dp + persistent)
    else:
        params = param_bytes * (psi + frozen)
    grads = grad_bytes * psi / _shard_divisor("grads", stage, dp)
    if accumulator_held(stage, accumulation, accumulation_steps):
        grads += grad_bytes * psi
    optimizer = optimizer_k * psi / _shard_divisor("optimizer", stage, dp)
    return ModelStateBytes(params, grads, optimizer)


def resolve_accumulation(stage: int, accumulation: str = "auto") -> str:
    """The accumulation policy that runs: "sharded" at stages 2-3 and "local" at 0-1 for "auto"."""
    if accumulation not in ("auto", "sharded", "local"):
        raise EstimateError(f'accumulation must be "auto", "sharded" or "local", got {accumulation!r}')
    if accumulation != "auto":
        return accumulation
    return "sharded" if stage >= 2 else "local"


def comm_elements_per_step(num_params: float, dp: int, stage: int, *, accumulation_steps: int = 1,
                           accumulation: str = "auto", persistent_params: float = 0) -> float:
    """Communication per rank per optimizer step in the paper's volume (elements), clipping aside.

    Reductions run once per step under "local" accumulation and once per micro-batch under
    "sharded": stage 0 all-reduces (2Ψ each), stages 1-2 reduce-scatter (Ψ each) then all-gather the
    updated parameters once (Ψ), stage 3 reduce-scatters the same way and gathers the parameters for
    every micro-batch's forward and backward (2Ψ each), except the P persistent parameters, kept
    whole and all-gathered once after the update (P). One rank moves nothing.
    """
    _check_layout(dp, stage, 1)
    accumulator_held(stage, accumulation, accumulation_steps)  # validates both
    if dp == 1:
        return 0.0
    local = resolve_accumulation(stage, accumulation) == "local"
    reductions = 1 if local else accumulation_steps
    if stage == 0:
        return 2.0 * num_params * reductions
    if stage < 3:
        gathers = num_params
    else:
        gathers = 2.0 * (num_params - persistent_params) * accumulation_steps + persistent_params
    return num_params * reductions + gathers


def node_comm_elements_per_step(num_params: float, dp: int, stage: int, *, nodes: int = 1, shard_size: int = 0,
                                accumulation_steps: int = 1, accumulation: str = "auto",
                                persistent_params: float = 0, secondary_partition: bool = False) -> tuple[float, float]:
    """(total, inter-node) elements per rank per step, clipping aside, for ``dp`` ranks on ``nodes`` nodes of
    consecutive ranks, flat or (``shard_size`` G) HSDP: ZeRO over the shard group of G consecutive ranks
    (``comm_elements_per_step`` with dp = G) plus one all-reduce of the Ψ/G shard over the dp/G replicas. The
    inter-node part follows [Note: node traffic] in hfzero/comm/collectives.py: a collective's share crossing nodes is its
    ring's crossing hops over its ranks, for rank 0's groups (every group has the same shape).
    ``secondary_partition`` (hpZ, stage 3): the backward gathers, (Ψ - P) per micro-batch, run inside the node."""
    from hfzero.comm.topology import ring_crossings

    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1 or dp % nodes:
        raise EstimateError(f"nodes must be a positive integer dividing dp={dp}, got {nodes!r}")
    shard = shard_size or dp
    if isinstance(shard, bool) or not isinstance(shard, int) or shard < 1 or dp % shard:
        raise EstimateError(f"shard_size must be a positive integer dividing dp={dp}, got {shard_size!r}")
    if shard < dp and stage == 0:
        raise EstimateError("shard_size (HSDP) shards model states, which stage 0 does not")
    per_node = dp // nodes
    total = comm_elements_per_step(num_params, shard, stage, accumulation_steps=accumulation_steps,
                                   accumulation=accumulation, persistent_params=persistent_params)
    inter = total * ring_crossings(range(shard), per_node) / shard
    if secondary_partition and stage == 3:  # the backward half of the gathers never leaves the node
        inter -= (num_params - persistent_params) * accumulation_steps * ring_crossings(range(shard), per_node) / shard
    if shard < dp:
        replicas = list(range(0, dp, shard))
        shard_sum = 2.0 * num_params / shard  # the all-reduce of the gradient shard, counted 2n
        total += shard_sum
        inter += shard_sum * ring_crossings(replicas, per_node) / len(replicas)
    return total, inter


def secondary_partition_bytes(num_params: float, ranks_per_node: int, *, param_bytes: int = 2,
                              persistent_params: float = 0) -> float:
    """hpZ's secondary partition per rank at its peak (PARAM_SECONDARY, after a training forward, before its
    backward): the node-local slice of every partitioned parameter, (Ψ - P) / ranks_per_node parameter
    elements (bucket padding aside). Transient: held within one micro-batch, not across steps."""
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise EstimateError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")
    return param_bytes * (num_params - persistent_params) / ranks_per_node


def accumulator_held(stage: int, accumulation: str = "auto", accumulation_steps: int = 1) -> bool:
    """True when a full local gradient buffer is held across micro-batches on top of the stage's
    gradients: "local" accumulation of more than one micro-batch at stages 2-3."""
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        raise EstimateError(f"accumulation_steps must be a positive integer, got {accumulation_steps!r}")
    policy = resolve_accumulation(stage, accumulation)
    return stage >= 2 and accumulation_steps > 1 and policy == "local"


def model_states_bytes(
    num_params: float,
    dp: int,
    stage: int,
    *,
    mp: int = 1,
    param_bytes: int = 2,
    grad_bytes: int = 2,
    optimizer_k: int = 12,
    persistent_params: float = 0,
    offload_optimizer: bool = False,
    accumulation_steps: int = 1,
    accumulation: str = "auto",
    frozen_params: float = 0,
) -> float:
    """Per-device (accelerator) model-state bytes of the paper's formula for ``stage``.

    Stage 0 (p+g+K)Ψ, stage 1 (p+g)Ψ + KΨ/N_d, stage 2 pΨ + (g+K)Ψ/N_d, stage 3 (p+g+K)Ψ/N_d, with
    Ψ = num_params / mp and N_d = dp, plus p Ψ_f for frozen parameters (p Ψ_f / N_d at stage 3); see
    ``model_states_breakdown`` for ``persistent_params`` and ``frozen_params``.
    With ``offload_optimizer`` (ZeRO-Offload, see runtime/offload.py) the K part lives in host memory
    (``model_states_cpu_bytes``), and so do the gradients from stage 2 (accumulated there in fp32): the
    device keeps the parameters, the full gradients at stages 0-1 and a "local" accumulator.
    """
    parts = model_states_breakdown(
        num_params, dp, stage, mp=mp, param_bytes=param_bytes, grad_bytes=grad_bytes,
        optimizer_k=optimizer_k, persistent_params=persistent_params, frozen_params=frozen_params,
        accumulation_steps=accumulation_steps, accumulation=accumulation,
    )
    if not offload_optimizer:
        return parts.params + parts.grads + parts.optimizer
    if stage < _SHARDED_FROM_STAGE["grads"]:
        return parts.params + parts.grads
    held = accumulator_held(stage, accumulation, accumulation_steps)
    return parts.params + (grad_bytes * num_params / mp if held else 0.0)


class ExpertParallelBytes(NamedTuple):
    """Per-device model-state bytes under expert parallelism, split into the dense and the expert parts."""

    dense: float
    experts: float

    @property
    def total(self) -> float:
        return self.dense + self.experts


def expert_parallel_bytes(dense_params: float, expert_params: float, world: int, ep: int, stage: int,
                          **kwargs: Any) -> ExpertParallelBytes:
    """Per-device model-state bytes of a mixture-of-experts model under expert parallelism (hfzero/parallel/
    expert.py): each rank holds the dense parameters Ψ_d and E / ep of every layer's experts (Ψ_e / ep). ZeRO
    shards the dense parameters over the whole world, as plain ZeRO does, and the experts over the world / ep
    ranks holding the same experts (N_e = world / ep; [Note: bucket partitions] in runtime/layout.py). So
    dense = ``model_states_bytes(Ψ_d, world, stage)`` and experts = ``model_states_bytes(Ψ_e / ep, world / ep,
    stage)``; at stage 3, 16 Ψ_d / world + 16 Ψ_e / world with bf16 + Adam, plain stage 3's bytes (``kwargs``:
    the byte sizes and options of ``model_states_bytes``). Without EP (ep = 1) this is the plain formula.
    """
    _check_count("dense_params", dense_params)
    _check_count("expert_params", expert_params)
    if ep < 1 or world % ep:
        raise EstimateError(f"ep={ep} must be a positive divisor of the world size {world}")
    return ExpertParallelBytes(model_states_bytes(dense_params, world, stage, **kwargs),
                               model_states_bytes(expert_params / ep, world // ep, stage, **kwargs))


def model_states_cpu_bytes(
    num_params: float,
    dp: int,
    stage: int,
    *,
    mp: int = 1,
    param_bytes: int = 2,
    grad_bytes: int = 2,
    optimizer_k: int = 12,
    persistent_params: float = 0,
    offload_optimizer: bool = False,
    accumulation_steps: int = 1,
    accumulation: str = "auto",
) -> float:
    """Host bytes per rank of model states when ``offload_optimizer`` is set, else 0: the K part (KΨ,
    or KΨ/N_d from stage 1), plus 4 bytes of fp32 master weights per element of the slice when K has
    none (``param_bytes`` >= 4: an fp32 parameter is its own master on the device, but the host steps a
    copy), plus from stage 2 the gradients, accumulated on the host in fp32 (4Ψ/N_d). What the engine
    holds in host memory, ``ZeroEngine.host_memory_by_role()``, as model states. Same arguments as
    ``model_states_bytes`` (the accumulation ones change nothing here: an accumulator stays on the device)."""
    if not offload_optimizer:
        _check_layout(dp, stage, mp)
        return 0.0
    parts = model_states_breakdown(
        num_params, dp, stage, mp=mp, param_bytes=param_bytes, grad_bytes=grad_bytes,
        optimizer_k=optimizer_k, persistent_params=persistent_params,
    )
    psi = num_params / mp
    master = 4.0 * psi / _shard_divisor("optimizer", stage, dp) if param_bytes >= 4 else 0.0
    grads = 4.0 * psi / dp if stage >= _SHARDED_FROM_STAGE["grads"] else 0.0
    return parts.optimizer + master + grads


def max_params(
    device_memory_bytes: float,
    dp: int,
    stage: int,
    *,
    mp: int = 1,
    param_bytes: int = 2,
    grad_bytes: int = 2,
    optimizer_k: int = 12,
    persistent_params: float = 0,
    offload_optimizer: bool = False,
    accumulation_steps: int = 1,
    accumulation: str = "auto",
) -> float:
    """The largest total parameter count (across the ``mp`` model-parallel ranks) whose model states
    fit in ``device_memory_bytes`` per device: the inverse of ``model_states_bytes``.

    Device bytes are affine in the parameter count: (bytes of one more parameter) * count + (the
    fixed cost of ``persistent_params`` at stage 3). Returns 0 when even that fixed cost does not fit.
    """
    _check_count("device_memory_bytes", device_memory_bytes)
    kwargs: dict[str, Any] = dict(
        mp=mp, param_bytes=param_bytes, grad_bytes=grad_bytes, optimizer_k=optimizer_k,
        offload_optimizer=offload_optimizer, accumulation_steps=accumulation_steps, accumulation=accumulation,
    )
    # The fixed cost: the persistent parameters' bytes beyond their share of an even shard.
    fixed = model_states_bytes(persistent_params, dp, stage, persistent_params=persistent_params, **kwargs)
    fixed -= model_states_bytes(persistent_params, dp, stage, **kwargs)
    per_param = model_states_bytes(float(mp), dp, stage, **kwargs) / mp
    return max(0.0, (device_memory_bytes - fixed) / per_param)


@dataclass(frozen=True, kw_only=True)
class StageFit:
    """One row of the ``--zero_stage auto`` table: per-device bytes at one stage.

    Attributes:
        stage: the ZeRO stage.
        model_states: ``model_states_bytes`` for the stage (frozen parameters included).
        accumulation: a full gradient buffer held across micro-batches under the "local"
            accumulation policy, beyond the stage's gradient shard (a model state; 0 otherwise).
        activations: the activation estimate (or other reserved bytes), the same at every stage.
        total: the sum of the three.
        fits: ``total`` is at most the budget.
    """

    stage: int
    model_states: float
    accumulation: float
    activations: float
    total: float
    fits: bool


def accumulation_bytes(num_params: float, dp: int, stage: int, *, grad_bytes: int = 2, mp: int = 1,
                       accumulation: str | None = "auto", accumulation_steps: int = 1) -> float:
    """Extra per-device gradient bytes of the accumulation policy beyond the stage's formula.

    "local" accumulation of more than one micro-batch at stages 2-3 holds a full local gradient buffer
    (gΨ, the engine's GRAD_ACCUM) beside the gradient shard until the step; at stages 0-1 the stage's
    full gradient is that buffer (0 extra); "sharded" reduces every micro-batch (0 extra).
    """
    if not accumulator_held(stage, accumulation or "auto", accumulation_steps):
        return 0.0
    return grad_bytes * num_params / mp


def stage_table(num_params: float, dp: int, budget_bytes: float, *, activation_bytes: float = 0.0,
                accumulation: str | None = "auto", accumulation_steps: int = 1, **state_kwargs: Any) -> list[StageFit]:
    """Per-device bytes of every stage against ``budget_bytes`` (``state_kwargs``: the keyword arguments
    of ``model_states_bytes``, e.g. param_bytes, frozen_params, persistent_params)."""
    rows = []
    for stage in STAGES:
        states = model_states_bytes(num_params, dp, stage, **state_kwargs)
        extra = accumulation_bytes(num_params, dp, stage, grad_bytes=state_kwargs.get("grad_bytes", 2),
                                   mp=state_kwargs.get("mp", 1), accumulation=accumulation,
                                   accumulation_steps=accumulation_steps)
        total = states + extra + activation_bytes
        rows.append(StageFit(stage=stage, model_states=states, accumulation=extra, activations=activation_bytes,
                             total=total, fits=total <= budget_bytes))
    return rows


def format_stage_table(rows: list[StageFit], budget_bytes: float) -> str:
    """The table as text, one line per stage, in MB (for logs and errors)."""
    lines = [f"budget {budget_bytes / 1e6:,.1f} MB per rank"]
    for r in rows:
        lines.append(f"stage {r.stage}: model states {r.model_states / 1e6:,.1f} MB + accumulation "
                     f"{r.accumulation / 1e6:,.1f} MB + activations {r.activations / 1e6:,.1f} MB = "
                     f"{r.total / 1e6:,.1f} MB {'fits' if r.fits else 'does not fit'}")
    return "\n".join(lines)


def pick_stage(rows: list[StageFit], budget_bytes: float) -> int:
    """The smallest stage of ``rows`` that fits (smaller stages communicate less: 2Ψ per step at
    stages 0-2, 3Ψ at stage 3).

    Raises:
        EstimateError: no stage fits; the message holds the whole table.
    """
    for row in rows:
        if row.fits:
            return row.stage
    raise EstimateError("no ZeRO stage fits the per-rank memory budget:\n" + format_stage_table(rows, budget_bytes)
                        + "\nadd devices, use offload_optimizer, a 16-bit dtype, a smaller batch or a larger budget")


def choose_stage(
    num_params: float,
    dp: int,
    device_memory_bytes: float,
    *,
    headroom: float = DEFAULT_HEADROOM,
    reserved_bytes: float = 0.0,
    **state_kwargs: Any,
) -> int:
    """The smallest ZeRO stage whose model states fit (``stage_table`` + ``pick_stage``).

    A stage fits when model_states_bytes + ``reserved_bytes`` (e.g. an activation estimate) is at
    most ``(1 - headroom) * device_memory_bytes``; ``headroom`` (default ``DEFAULT_HEADROOM``) is kept
    for buffers and fragmentation the formula does not count. ``state_kwargs`` are the keyword
    arguments of ``model_states_bytes`` (mp, param_bytes, ...) plus ``accumulation`` and
    ``accumulation_steps`` (see ``accumulation_bytes``).

    Raises:
        EstimateError: no stage fits; the message gives every stage's need and the budget.
    """
    if not 0 <= headroom < 1:
        raise EstimateError(f"headroom must be in [0, 1), got {headroom!r}")
    budget = (1 - headroom) * device_memory_bytes
    rows = stage_table(num_params, dp, budget, activation_bytes=reserved_bytes, **state_kwargs)
    stage = pick_stage(rows, budget)
    logger.debug("stage %d fits: %.3g bytes of a %.3g-byte budget", stage, rows[stage].total, budget)
    return stage


# --------------------------------------------------------------------------------------------------
# Ψ from a Hugging Face config
# --------------------------------------------------------------------------------------------------


def _meta_model(config: Any) -> torch.nn.Module:
    """Instantiate ``config``'s model on the meta device (no memory, no weights): the causal-LM
    class when there is one, else the base ``AutoModel``."""
    from transformers import AutoModel, AutoModelForCausalLM

    import torch  # deferred: the estimator (and the dashboard's estimator page) work without torch

    with torch.device("meta"):
        try:
            return AutoModelForCausalLM.from_config(config)
        except ValueError:
            logger.debug("no causal-LM class for %s; counting AutoModel", type(config).__name__)
            return AutoModel.from_config(config)


def count_params(model: torch.nn.Module) -> int:
    """Parameters of ``model``, each counted once (tied weights, such as embeddings shared with the
    output layer, are one parameter)."""
    return sum(p.numel() for p in set(model.parameters()))


def params_from_config(source: Any) -> int:
    """Ψ (total parameters, tied weights counted once) of the model a Hugging Face config describes.

    ``source`` is a ``PretrainedConfig``, a ``config.json`` path or a local model directory. The
    model is built on the meta device, so this costs no memory and reads no weights.
    """
    config = load_hf_config(source)
    try:
        model = _meta_model(config)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise EstimateError(f"cannot build a {type(config).__name__} model to count its parameters ({exc})") from None
    return count_params(model)


def stage3_unit_numels(source: Any, *, persistence_threshold: int | None = None) -> tuple[int, list[int]]:
    """(root, other units): elements each stage-3 unit of the model a Hugging Face config describes
    gathers, with the default units (the decoder blocks; the root owns the rest, see [Note: stage-3
    units]) and parameters below ``persistence_threshold`` (default: ZeroConfig's) left out, since they
    stay whole. Built on the meta device: no memory, no weights."""
    from hfzero.config import ZeroConfig
    from hfzero.runtime.stage3.units import resolve_units

    threshold = ZeroConfig().param_persistence_threshold if persistence_threshold is None else persistence_threshold
    config = load_hf_config(source)
    try:
        model = _meta_model(config)
        specs = resolve_units(model, None, set(model.parameters()))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise EstimateError(f"cannot build a {type(config).__name__} model to find its stage-3 units ({exc})") from None
    numels = [sum(p.numel() for p in spec.params if p.numel() >= threshold) for spec in specs]
    return numels[0], numels[1:]


def stage3_gathered_bytes(root: float, others: list[float], dp: int, *, param_bytes: int = 2, mp: int = 1,
                          prefetch_numel: int | None = None) -> float:
    """Bytes of parameters stage 3 holds gathered at once per device (PARAM_GATHERED: transient, not a
    model state): the root, the unit in use and the next one (prefetched whatever its size) or the
    prefetch budget (``prefetch_numel``; default: ZeroConfig's model-sized rule); with every unit larger
    than the budget, the root and the two largest units. Units are divided over ``mp`` model-parallel
    ranks. See ``hfzero.config.stage3_gathered_numel``."""
    from hfzero.config import ZeroConfig, stage3_gathered_numel

    _check_layout(dp, 3, mp)
    units = [int(math.ceil(n / mp)) for n in others]
    if prefetch_numel is None:
        prefetch_numel = ZeroConfig().prefetch_numel(int(root / mp) + sum(units), dp)
    return float(stage3_gathered_numel(int(math.ceil(root / mp)), units, prefetch_numel) * param_bytes)


def stage3_grad_staging_bytes(root: float, others: list[float], dp: int, *, grad_bytes: int = 2,
                              mp: int = 1) -> float:
    """Bytes of gradient staging stage 3 holds at its high-water mark per device (GRAD_BUCKET: transient,
    not a model state, but pooled across steps, see [Note: staging pool] in runtime/reducer.py): the full
    gradients of the root (its buckets stay open for the whole backward: the output projection's gradient
    arrives first, the embedding's last, and the root launches at the backward's end), of the unit whose
    backward runs, and of the unit before it (launched when the backward moved on to the next unit, staged
    until its reductions complete): root + the two largest units. Units divided over ``mp``. Measured: the
    GRAD_BUCKET role equals it to the element on a 2-layer Llama under SP (tests/test_sequence_parallel.py)
    and on benchmarks/long_context.py's 106M Llama (120.8 MiB, 4 ranks)."""
    _check_layout(dp, 3, mp)
    units = sorted((int(math.ceil(n / mp)) for n in others), reverse=True)
    return float((math.ceil(root / mp) + sum(units[:2])) * grad_bytes)


def step_fp32_grad_bytes(num_params: float, dp: int, stage: int, *, mp: int = 1) -> float:
    """Bytes of the fp32 gradients the optimizer step reads with a separate (fp32) master copy (GRAD_FP32:
    the step's transient, ``engine.materialize_grads`` -> ``finish_step``): the rank's slice, 4Ψ/N_d, at
    stages 1-3; 4Ψ at stage 0, whose master copy is whole."""
    _check_layout(dp, stage, mp)
    return 4.0 * num_params / mp / (dp if stage >= 1 else 1)


# --------------------------------------------------------------------------------------------------
# Activation memory (an estimate)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ActivationEstimate:
    """Estimated activation bytes per device for one forward/backward (see ``activation_bytes``).

    Attributes:
        per_layer: bytes one transformer layer keeps for backward (its working set).
        layers: bytes all layers hold at the peak: L * per_layer, or with checkpointing the L saved
            layer inputs plus one layer's working set during its recomputation.
        head: embedding dropout mask, final layer-norm and output-layer inputs, and fp32 logits.
        total: layers + head.
        checkpointing: whether full activation checkpointing (one checkpoint per layer) is assumed.
    """

    per_layer: float
    layers: float
    head: float
    total: float
    checkpointing: bool


def layer_activation_bytes(
    shape: TransformerShape, seq_len: int, batch_size: int, *, dtype_bytes: int = 2, tp: int = 1,
    fused_attention: bool = False,
) -> float:
    """ESTIMATE of the bytes one transformer layer saves for backward, after Korthikanti et al.,
    "Reducing Activation Recomputation in Large Transformer Models" (arXiv 2205.05198), Section 4.

    Their 16-bit count with a 4h MLP and tensor parallelism t (no sequence parallelism) is
    s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes per layer; with t = 1 the familiar s*b*h*(34 + 5*a*s/h).
    Written by tensors, with e = ``dtype_bytes`` and 1-byte dropout masks:

    - replicated across TP ranks: 4 values of s*b*h (attention and MLP inputs, two layer-norm inputs)
      and 2 dropout masks: s*b*h*(4e + 2);
    - split over TP ranks: Q, K, V, the projection input, and the MLP's two inner tensors
      (2 * ffn/h values; 8 for ffn = 4h): s*b*h*e*(4 + 2*ffn/h)/t;
    - attention scores: softmax output, its dropout mask and dropout output: a*s*s*b*(2e + 1)/t.
      ``fused_attention`` (flash / memory-efficient SDPA kernels) never stores these and drops
      the term.

    Dropout masks are counted even for models without dropout, so this leans high by 2 of 34.
    """
    sbh = seq_len * batch_size * shape.hidden_size
    replicated = sbh * (4 * dtype_bytes + 2)
    split = sbh * dtype_bytes * (4 + 2 * shape.ffn_size / shape.hidden_size) / tp
    scores = 0.0 if fused_attention else shape.num_heads * seq_len**2 * batch_size * (2 * dtype_bytes + 1) / tp
    return replicated + split + scores


def head_activation_bytes(
    shape: TransformerShape, seq_len: int, batch_size: int, *, dtype_bytes: int = 2, tp: int = 1,
) -> float:
    """ESTIMATE of the activations outside the layers (Korthikanti et al., Section 4.3): the input
    embedding's dropout mask (s*b*h), the final layer-norm and output-layer inputs (2 * e*s*b*h),
    and the logits kept in fp32 for the cross-entropy loss (4*s*b*V/t)."""
    sbh = seq_len * batch_size * shape.hidden_size
    return sbh * (1 + 2 * dtype_bytes) + 4 * seq_len * batch_size * shape.vocab_size / tp


def activation_bytes(
    shape: TransformerShape, seq_len: int, batch_size: int, *, checkpointing: bool = False, dtype_bytes: int = 2,
    tp: int = 1, fused_attention: bool = False,
) -> ActivationEstimate:
    """ESTIMATE of activation bytes per device for sequence ``seq_len`` and micro-batch ``batch_size``.

    Without checkpointing every layer keeps its working set: L * ``layer_activation_bytes``.
    With full activation checkpointing (one checkpoint per layer, recomputed in backward) the layers
    keep their e*s*b*h inputs (2*s*b*h in 16 bits, replicated on TP ranks: the redundancy ZeRO-R's
    P_a removes) plus one layer's working set while it is recomputed: L*e*s*b*h + per_layer.
    Both add ``head_activation_bytes``. Not counted: temporaries inside a kernel, the allocator's
    caching and fragmentation, and the gradient of the logits during the loss backward.
    """
    if min(seq_len, batch_size, dtype_bytes, tp) < 1:
        raise EstimateError("seq_len, batch_size, dtype_bytes and tp must be positive")
    per_layer = layer_activation_bytes(
        shape, seq_len, batch_size, dtype_bytes=dtype_bytes, tp=tp, fused_attention=fused_attention
    )
    if checkpointing:
        layers = shape.num_layers * dtype_bytes * seq_len * batch_size * shape.hidden_size + per_layer
    else:
        layers = shape.num_layers * per_layer
    head = head_activation_bytes(shape, seq_len, batch_size, dtype_bytes=dtype_bytes, tp=tp)
    return ActivationEstimate(per_layer=per_layer, layers=layers, head=head, total=layers + head,
                              checkpointing=checkpointing)


# The HF-decoder activation model (tensor by tensor, checked against the profiler's measurement) lives
# in its own module; exported here so ``hfzero.planning.estimate`` stays the one estimator namespace.
from hfzero.planning.activations import (  # noqa: E402, F401
    FUSED_ATTENTION,
    DecoderActivationEstimate,
    DecoderShape,
    EncoderShape,
    decoder_activation_bytes,
    decoder_head_bytes,
    decoder_layer_bytes,
    encoder_activation_bytes,
    encoder_head_bytes,
    is_encoder_config,
)
