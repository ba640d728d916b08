"""Pipeline training runs shared by the pipeline tests and benchmarks/pipeline_zero.py.

``train_pipeline`` runs one PipeSpec on the calling rank (every rank of the world is in the pp x dp
mesh); ``reference`` trains the same model single-process on the full batch with plain torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

import torch
import torch.distributed as dist

import hfzero
from hfzero.parallel.mesh import build_mesh
from hfzero.parallel.pipeline import PipelineConfig, pipeline
from hfzero.testing.models import tiny_causal_lm, token_batches
from hfzero.testing.workloads import _schedule, param_groups, reference_run


@dataclasses.dataclass(frozen=True)
class PipeSpec:
    """One pipeline training run."""

    model: str = "llama"
    layers: int = 4
    hidden: int = 32
    pp: int = 2
    stage: int = 2
    accumulation: str = "local"
    schedule: str = "1F1B"
    n_micro: int = 4
    stage3_gather: str = "step"
    cross_prefetch: bool = True
    """PipelineConfig.stage3_cross_prefetch."""
    dtype: str = "fp32"
    steps: int = 10
    global_batch: int = 16
    seq_len: int = 16
    lr: float = 1e-3
    max_grad_norm: float | None = 1.0
    bucket_size: int = 4096
    extra_config: tuple[tuple[str, Any], ...] = ()
    """Extra ZeroConfig fields, e.g. (("param_persistence_threshold", 0),)."""
    measure_activations: bool = False
    """Record the peak of saved activations (ActivationMeter; slows the step a little)."""
    profile: bool = False
    """Run ``ZeroProfiler`` over the pipeline (custom-loop API) into ``<profile_root>/<spec index>``."""


class ActivationMeter:
    """Peak bytes of tensors autograd saved for backward (parameters excluded), via saved_tensors_hooks.

    A saved tensor counts from its pack until autograd drops it; tensors sharing a parameter's
    storage (weights saved by matmuls, stage-3 gathered buffers) are not activations and do not count.
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.live = 0
        self.peak = 0

    def _pack(self, tensor: torch.Tensor):
        params = {p.untyped_storage().data_ptr() for p in self.module.parameters()}
        if tensor.untyped_storage().data_ptr() in params:
            return tensor
        return _Counted(self, tensor)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Counted) else packed

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


class _Counted:
    def __init__(self, meter: ActivationMeter, tensor: torch.Tensor):
        self.meter, self.tensor = meter, tensor
        self.nbytes = tensor.numel() * tensor.element_size()
        meter.live += self.nbytes
        meter.peak = max(meter.peak, meter.live)

    def __del__(self):
        self.meter.live -= self.nbytes


def reference(spec: PipeSpec) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process, full-batch fp32 training of ``spec``'s model: per-step losses, final parameters."""
    return reference_run(tiny_causal_lm(spec.model, layers=spec.layers, hidden=spec.hidden), spec)


def stage_params(pipe) -> dict[str, torch.Tensor]:
    """This rank's stage parameters, whole, fp32, under their HF names (stage 3 gathers them)."""
    if pipe.engine.stage < 3:
        return {pipe.hf_name(n): p.detach().float().clone() for n, p in pipe.module.named_parameters()}
    full = hfzero.full_state_dict(pipe.module, rank0_only=False)
    return {pipe.hf_name(n): full[n].float() for n, _ in pipe.module.named_parameters()}


def train_pipeline(rank: int, world_size: int, spec: PipeSpec, profile_dir: str | None = None) -> dict[str, Any]:
    """Train ``spec`` on this rank; return losses, final stage parameters, memory, comm and times per step.
    With ``spec.profile`` and a ``profile_dir``, ZeroProfiler records the run there."""
    with contextlib.ExitStack() as stack:
        return _train_pipeline(spec, stack, profile_dir if spec.profile else None)


def _train_pipeline(spec: PipeSpec, stack: contextlib.ExitStack, profile_dir: str | None) -> dict[str, Any]:
    mesh = build_mesh(spec.pp)
    model = tiny_causal_lm(spec.model, layers=spec.layers, hidden=spec.hidden)
    zero = hfzero.ZeroConfig(stage=spec.stage, dtype=spec.dtype, reduce_bucket_size=spec.bucket_size,
                             accumulation=spec.accumulation, **dict(spec.extra_config))
    config = PipelineConfig(pp_size=spec.pp, schedule=spec.schedule, n_microbatches=spec.n_micro,
                            stage3_gather=spec.stage3_gather, stage3_cross_prefetch=spec.cross_prefetch)
    pipe = pipeline(model, torch.optim.AdamW(param_groups(model), lr=spec.lr), zero, config, mesh=mesh)
    released_bytes = pipe.release_other_stages(model)  # as the Trainer does: training needs only the stages
    held = {id(t) for t in (*pipe.module.parameters(), *pipe.module.buffers())}
    source = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    not_freed = sorted(n for n, t in source if t.numel() and id(t) not in held)  # other stages' tensors left whole
    del model
    scheduler = _schedule(pipe.optimizer)
    engine = pipe.engine
    if profile_dir is not None:
        from hfzero.profiler import ZeroProfiler

        stack.enter_context(ZeroProfiler(pipe, None, profile_dir))
    losses, norms, comm_steps, inter_steps, times, step_roles, activation_peak = [], [], [], [], [], {}, 0
    for batch in token_batches(spec.steps, spec.global_batch, spec.seq_len):
        local = batch.chunk(mesh.dp_size)[mesh.dp_rank]  # (B / dp, T): this replica's rows
        before = engine.comm.stats()
        dist.barrier()
        started = time.perf_counter()
        meter = ActivationMeter(pipe.module) if spec.measure_activations else contextlib.nullcontext()
        with meter:
            loss = pipe.forward_backward(local)
        activation_peak = max(activation_peak, getattr(meter, "peak", 0))
        step_roles = {k.value: v for k, v in pipe.step_roles.items()}
        if spec.max_grad_norm is not None:
            norms.append(float(pipe.clip_grad_norm_(spec.max_grad_norm)))
        pipe.optimizer.step()
        pipe.optimizer.zero_grad()
        times.append(time.perf_counter() - started)
        scheduler.step()
        after = engine.comm.stats()
        comm_steps.append({k: after[k].elements - (before[k].elements if k in before else 0) for k in after})
        inter_steps.append(sum(after[k].inter_node_bytes - (before[k].inter_node_bytes if k in before else 0)
                               for k in after))
        losses.append(loss)
    return {
        "coords": (mesh.pp_rank, mesh.dp_rank),
        "losses": losses,
        "norms": norms,  # the gradient norm before clipping, per step (empty without clipping)
        "params": stage_params(pipe),
        "roles": {k.value: v for k, v in engine.memory_by_role().items()},
        "step_roles": step_roles,
        "activation_peak_bytes": activation_peak,
        "comm_per_step": comm_steps,
        "inter_node_bytes_per_step": inter_steps,
        "step_seconds": times,
        "num_params": engine.num_params,
        "num_params_padded": engine.num_params_padded,
        "zero_world": engine.world_size,
        "replicas": engine.replicate.world_size if engine.replicate is not None else 1,
        "cross_prefetches": getattr(getattr(engine, "scheduler", None), "cross_prefetches", 0),
        "released_bytes": released_bytes,
        "source_not_freed": not_freed,
    }


def train_pipelines(rank: int, world_size: int, specs: list[PipeSpec],
                    profile_root: str | None = None) -> list[dict[str, Any]]:
    """Run several specs in one spawned process group (spawning is the expensive part); specs with
    ``profile=True`` are profiled into ``<profile_root>/<their index>``."""
    return [train_pipeline(rank, world_size, spec, f"{profile_root}/{i}" if profile_root else None)
            for i, spec in enumerate(specs)]
