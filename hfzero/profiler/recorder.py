"""ZeroProfiler: records what a ZeRO engine holds, per rank, per step and per phase.

The profiler observes and never acts: it reads ``engine.memory_by_role()``, ``engine.comm.stats()``
and allocator counters, and attaches hooks that only read (see STYLE.md, "side effects in
observers"). It never resets allocator statistics, never empties a cache and issues no collective
of the engine's.

Phase boundaries come from hooks:

- forward begin / end: a forward pre-hook (prepended, so it runs before the engine's own) and a
  forward hook (appended, so it runs after) on the top module; forwards under ``torch.no_grad``
  (evaluation, ``generate``) are not recorded;
- backward begin: a gradient hook on the forward's top-level output tensors, the first of which
  fires when backward reaches the model; backward end: ``engine.add_backward_end_hook``, called once
  the pass's gradient reductions are done;
- step begin / end: the optimizer's step pre- and post-hooks. The step post-hook ends a step.

[Note: pipeline backward phases]
Under pipeline parallelism the backward phases come from the pipeline itself, not from gradient
hooks: a zero-bubble schedule's input-only backward reaches no parameter (no reduction, so no
engine backward-end hook) and its weight pass runs outside autograd's accumulation (no hook at
all). ``Pipeline.add_pass_observer`` calls the profiler at the begin and end of every backward
action the schedule runs on this rank's stages, with the stage, the micro-batch and the part
("full": a whole backward, "input": the input-only pass, "weight": the weight pass, its gradient
reduction included). Every backward phase record of a pipeline rank thus has a begin and an end.

Cost per recorded phase boundary: one ``memory_by_role()`` call, one ``comm.stats()`` copy, one
allocator sample (CUDA: ``torch.cuda.memory_stats_as_nested_dict``; CPU: a /proc pread and glibc
``mallinfo2``, whose cost grows with the number of free heap chunks, ~0.1 ms with thousands) and one flushed JSON
line of about 1 KB. A step records six boundaries and one step record. ``every_n_steps`` records
only every n-th step (the others cost one ``comm.stats()`` copy). ``cuda_snapshot=True`` adds one
``torch.cuda.memory_snapshot()`` per recorded step (milliseconds to tens of milliseconds).

On CUDA the phase records' ``t`` and ``seconds`` are host wall times at the hooks (a phase's
``seconds`` covers launching its kernels; the time they still run is billed to whichever later phase
waits for them), while the step record's ``phase_seconds`` and every ``comm`` ``seconds`` are device
times between CUDA events recorded at the same hooks and around each collective (hfzero/comm/timing.py,
[Note: device timing]). Nothing waits for those events until the recorded step's end, where the
profiler waits once for the step's last collective and its own last event: one host synchronization
per recorded step, none per collective or phase (steps that are not recorded add none). Collectives
whose events had not happened by a phase record are counted in a later record's ``comm`` seconds; the
step record's are complete. Step times are exact over a step in steady state. Memory figures are exact
at every boundary: the caching allocator is host-ordered.

Under pipeline parallelism (a ``hfzero.pipeline`` Pipeline, or the optimizer of one) each rank
records its own stage(s): the hooks sit on each stage module (phase records carry the global
``stage``), every record carries the rank's ``pp_rank`` and ``dp_rank`` (and ``tp_rank``, 0 without
tensor parallelism), the header a ``pipeline``
section (mesh, schedule, policy, the cost model per stage; see ``hfzero/profiler/pipeline.py``) and
every step record the stage's measured busy / idle time and P2P bytes (the driver's ``StageClock``:
[Note: measuring the bubble]). ``start()`` then also runs one small all-gather of the ranks' places.
"""

from __future__ import annotations

import functools
import time
import types
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from hfzero.logging import get_logger
from hfzero.profiler.allocator import AllocatorProbe
from hfzero.profiler.decompose import decompose
from hfzero.profiler.format import (EVENT_CUDA_SNAPSHOT, EVENT_START, EVENT_STOP, FORMAT_VERSION, NODE_COMM_FIELDS,
                                    rank_file_name)
from hfzero.profiler.header import activation_prediction, build_header
from hfzero.profiler.writer import RankWriter, remove_stale_rank_files, write_header
from hfzero.roles import MODEL_STATE_ROLES
from hfzero.runtime.activations.accounting import ActivationAccounting
from hfzero.runtime.compile import eager_hook
from hfzero.comm.timing import DeviceTimer

logger = get_logger(__name__)

_MODEL_STATE_KEYS = frozenset(role.value for role in MODEL_STATE_ROLES)
_ROUND = 6  # decimals kept for seconds
_Hook = TypeVar("_Hook", bound=Callable[..., None])


def _costed(hook: _Hook) -> _Hook:
    """Add the wall and CPU time spent in ``hook`` to the profiler's ``overhead_seconds`` and
    ``overhead_cpu_seconds``; the hook runs eagerly, never inside a compiled graph (See [Note: compiled
    regions] in runtime/compile.py)."""
    @functools.wraps(hook)
    def timed(self: "ZeroProfiler", *args: Any) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            hook(self, *args)
        finally:
            self.overhead_seconds += time.perf_counter() - wall
            self.overhead_cpu_seconds += time.thread_time() - cpu
    return eager_hook(timed)  # type: ignore[return-value]


_SNAPSHOT_FIELDS = {"total_free": "total_free", "largest_free_block": "largest_free_block",
                    "reserved_unallocated": "reserved_unallocated", "fragmentation": "snapshot_fragmentation"}
"""Snapshot figures copied into the step record's allocator sample: {snapshot key: sample key}. The snapshot's
fragmentation (1 - largest free block / total free) keeps a key of its own: ``fragmentation`` is the counters'
figure in every sample (profiler/fragmentation.py), so one series never mixes the two."""


class ZeroProfiler:
    """Records a ZeRO run into ``run_dir`` (format: docs/profile-format.md).

    Every rank writes ``rank-<global rank>.jsonl``; global rank 0 also writes ``header.json``. Each
    recorded step yields, per phase (forward, backward, step), a begin and an end record with the
    engine's bytes by memory role, the sum of the model-state roles, allocator statistics, the
    communication since the previous record per collective kind, and (end records) the phase's
    wall time; then one step record with the step's peaks, its communication and its wall time.

    ``start()`` is collective when torch.distributed is initialized (rank 0 shares the run id), so
    call it on every rank, as the context manager does.

    Args:
        model: the model returned by ``hfzero.prepare``; or a ``hfzero.pipeline`` Pipeline (then
            ``optimizer`` may be None), whose stage(s) on this rank are profiled.
        optimizer: the optimizer returned by ``hfzero.prepare`` (its ``engine`` is profiled). A
            pipeline's optimizer selects its Pipeline, whatever ``model`` is (the Trainer passes the
            whole HF model; the stage modules are what runs).
        run_dir: the directory to write; created if missing; files of an earlier run are replaced.
        every_n_steps: record steps 0, n, 2n, ... only.
        cuda_snapshot: on CUDA, take one allocator snapshot per recorded step (at its end) for the
            largest free block and the free memory's scatter (``snapshot_fragmentation``); every sample
            carries the counters' ``fragmentation`` without it. Expensive; off by default.
        activations: measure the bytes saved for backward (role ``activations``) with saved-tensor
            hooks (see [Note: activation accounting]); hfzero's checkpoint function, when the model
            uses it, reports ``act_checkpoint``. Costs one Python call per saved tensor.
    """

    def __init__(self, model: Any, optimizer: torch.optim.Optimizer | None, run_dir: str | Path, *,
                 every_n_steps: int = 1, cuda_snapshot: bool = False, accumulation_steps: int = 1,
                 activations: bool = True) -> None:
        for name, value in (("every_n_steps", every_n_steps), ("accumulation_steps", accumulation_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.accumulation_steps = accumulation_steps
        """Micro-batches per optimizer step: with "local" accumulation at stages 2-3 the prediction
        counts the full gradient accumulator held across them."""
        self.pipeline = _find_pipeline(model, optimizer)
        """The profiled Pipeline, or None (no pipeline parallelism)."""
        if self.pipeline is not None:
            model, optimizer = self.pipeline.module, self.pipeline.optimizer
        self.model = model
        self.optimizer = optimizer
        self.engine = _find_engine(model, optimizer)
        self.run_dir = Path(run_dir)
        self.every_n_steps = every_n_steps
        self.cuda_snapshot = cuda_snapshot
        self.device = _model_device(model)
        self.probe = AllocatorProbe(self.device)
        self._timer = DeviceTimer(self.device)  # phase intervals: wall, or CUDA events (See [Note: device timing])
        self.step = 0
        """Index of the step in progress (steps end at the optimizer's step post-hook)."""
        self.overhead_seconds = 0.0
        """Wall time spent in the profiler's hooks so far (what it adds to training, start/stop excluded)."""
        self.overhead_cpu_seconds = 0.0
        """CPU time of the threads running those hooks: the same cost, not inflated by other processes."""
        self._writer: RankWriter | None = None
        self._handles: list[Any] = []
        # a multi-stage rank's forwards run stage by stage, never its StageChunks container: measure each stage
        entries = list(self.pipeline.stages) if self.pipeline is not None and len(self.pipeline.stages) > 1 else None
        self.activations = ActivationAccounting(model, entries=entries) if activations else None
        self._modules: dict[int | None, torch.nn.Module] = (
            {s.stage_index: s for s in self.pipeline.stages} if self.pipeline is not None else {None: model})
        """The modules whose forwards are phases, by global pipeline stage (None without a pipeline)."""
        tp = getattr(self.engine, "norm_group", None)  # the TP group's Communicator under tensor parallelism
        self._coords = {"pp_rank": self.pipeline.mesh.pp_rank if self.pipeline is not None else 0,
                        "dp_rank": int(self.engine.rank), "tp_rank": int(tp.rank) if tp is not None else 0}
        """(pp rank, dp rank, tp rank[, sp rank]), written into every record."""
        sp = getattr(model, "hfzero_sequence_mesh", None)  # sequence parallelism: ZeRO's rank is the world rank
        if sp is not None:
            self._coords.update(dp_rank=int(sp.dp_rank), sp_rank=int(sp.sp_rank))
        self._checkpoint = getattr(model, "hfzero_checkpoint", None)
        self._active = False
        self._step_depth = 0

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> "ZeroProfiler":
        """Write the header (rank 0) and this rank's start record, then attach the hooks."""
        if self._writer is not None:
            raise RuntimeError("ZeroProfiler.start() called twice")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        rank, world = _global_identity()
        run_id = _shared_run_id(self.device)
        self._header: dict[str, Any] | None = None
        pipeline_header = None
        if self.pipeline is not None:  # collective: every rank's place in the mesh, for rank 0's header
            from hfzero.planning.models import optimizer_kind
            from hfzero.profiler.pipeline import gather_identities, header_section

            pipeline_header = header_section(self.pipeline, gather_identities(self.pipeline),
                                             optimizer_kind(self.optimizer))
        if rank == 0:
            for stale in remove_stale_rank_files(self.run_dir, world):
                logger.warning("removed %s, left by an earlier run with more ranks", stale)
            self._header = build_header(
                run_id=run_id, engine=self.engine, model=self.model, optimizer=self.optimizer,
                global_world_size=world, device=self.device, every_n_steps=self.every_n_steps,
                cuda_snapshot=self.cuda_snapshot, accumulation_steps=self.accumulation_steps,
                pipeline=pipeline_header)
            write_header(self.run_dir, self._header)
        self._writer = RankWriter(self.run_dir / rank_file_name(rank))
        self._t0 = time.perf_counter()
        self._comm_last = self.engine.comm.stats()
        self._begin_step_accounting(self._t0)
        self._active = True
        self._emit(self._record("event", event=EVENT_START, format_version=FORMAT_VERSION, run_id=run_id,
                                rank=rank, global_world_size=world, dp_rank=int(self.engine.rank),
                                world_size=int(self.engine.world_size), device=str(self.device),
                                unix_time=time.time(), every_n_steps=self.every_n_steps,
                                **({"stages": sorted(k for k in self._modules)} if self.pipeline else {})))
        self._attach()
        logger.info("profiling into %s (rank file %s)", self.run_dir, self._writer.path.name)
        return self

    def stop(self, *, exception: BaseException | None = None) -> None:
        """Detach the hooks, write the stop record (naming ``exception`` if given) and close the file."""
        if self._writer is None:
            return
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._active:
            extra = {"exception": type(exception).__name__} if exception is not None else {}
            self._emit(self._record("event", event=EVENT_STOP, overhead_seconds=round(self.overhead_seconds, _ROUND),
                                    overhead_cpu_seconds=round(self.overhead_cpu_seconds, _ROUND), **extra))
        self._active = False
        self._writer.close()
        self.probe.close()

    def __enter__(self) -> "ZeroProfiler":
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: types.TracebackType | None) -> None:
        self.stop(exception=exc)

    # --- hooks -----------------------------------------------------------------------------------

    def _attach(self) -> None:
        for stage, module in self._modules.items():
            self._handles += [
                module.register_forward_pre_hook(functools.partial(self._on_forward_begin, stage), prepend=True),
                module.register_forward_hook(functools.partial(self._on_forward_end, stage)),
            ]
        self._handles += [
            self.optimizer.register_step_pre_hook(self._on_step_begin),
            self.optimizer.register_step_post_hook(self._on_step_end),
        ]
        if self._header is not None and self.pipeline is None:  # a pipeline stage holds some layers only
            self._predicted_shapes: set[tuple[int, int]] = set()
            self._input_hook = self.model.register_forward_pre_hook(self._on_first_input, with_kwargs=True)
            self._handles.append(self._input_hook)
        if self.pipeline is not None:  # See [Note: pipeline backward phases]
            self._handles.append(self.pipeline.add_pass_observer(self._on_pipeline_pass))
        else:
            handle = self.engine.add_backward_end_hook(self._on_backward_end)
            if hasattr(handle, "remove"):
                self._handles.append(handle)
        if self.activations is not None:
            self.activations.attach()
            self._handles.append(types.SimpleNamespace(remove=self.activations.detach))

    def _recording(self) -> bool:
        return self._active and self.step % self.every_n_steps == 0

    def _where(self, stage: int | None) -> dict[str, Any]:
        """The ``stage`` key of a pipeline rank's forward/backward records (nothing without a pipeline)."""
        return {} if stage is None else {"stage": stage}

    @_costed
    def _on_first_input(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Rank 0, recorded forwards with gradients: add the activation model's figures for the input's
        (batch, sequence) to the header (rewritten atomically), and again whenever a later input's
        prediction is larger (dynamic padding: the measured peak is the longest batch's), so the header
        holds the prediction for the largest input seen. Removed when the model has no prediction."""
        if not (self._recording() and torch.is_grad_enabled()) or self._header is None:
            return
        tokens = kwargs.get("input_ids", kwargs.get("inputs_embeds", args[0] if args else None))
        if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
            self._input_hook.remove()
            return
        shape = (int(tokens.shape[0]), int(tokens.shape[1]))
        if shape in self._predicted_shapes:
            return
        self._predicted_shapes.add(shape)
        prediction = activation_prediction(self.model, self.engine, *shape, self.device)
        if prediction is None:
            self._input_hook.remove()
            return
        if prediction["saved"] > (self._header.get("activation_prediction") or {}).get("saved", -1):
            self._header["activation_prediction"] = prediction
            write_header(self.run_dir, self._header)

    @_costed
    def _on_forward_begin(self, stage: int | None, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if self._recording() and torch.is_grad_enabled():
            self._micro[stage] = self._micro.get(stage, 0) + 1
            self._phase_edge("forward", "begin", key=stage, micro=self._micro[stage], **self._where(stage))

    @_costed
    def _on_forward_end(self, stage: int | None, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not (self._recording() and torch.is_grad_enabled()):
            return
        self._phase_edge("forward", "end", key=stage, micro=self._micro.get(stage, 0), **self._where(stage))
        for tensor in _top_level_tensors(output) if self.pipeline is None else ():
            if tensor.requires_grad:
                tensor.register_hook(functools.partial(self._on_output_grad, stage))

    @_costed
    def _on_output_grad(self, stage: int | None, grad: torch.Tensor) -> None:
        if self._recording() and self._backward_open is None:
            # without a pipeline a backward belongs to the latest forward; a pipeline stage runs its
            # backwards in micro-batch order, interleaved with later forwards (1F1B): count them
            self._backward_of[stage] = self._backward_of.get(stage, 0) + 1
            micro = self._micro.get(stage, 0) if stage is None else self._backward_of[stage]
            self._backward_open = (stage, micro)
            self._phase_edge("backward", "begin", key=stage, micro=micro, **self._where(stage))

    @_costed
    def _on_backward_end(self) -> None:
        if self._recording():
            stage, micro = self._backward_open or (None, self._micro.get(None, 0))
            if self._backward_open is None and self.pipeline is not None:
                stage, micro = max(self._modules), None  # a backward whose begin was not seen
            self._backward_open = None
            self._phase_edge("backward", "end", key=stage, micro=micro, **self._where(stage))

    @_costed
    def _on_pipeline_pass(self, edge: str, stage: int, micro: int, part: str) -> None:
        """A pipeline stage's backward action (``part``: "full", "input" or "weight"), micro-batch ``micro``
        (from 1): a begin or end phase record. See [Note: pipeline backward phases]."""
        if self._recording():
            self._phase_edge("backward", edge, key=stage, micro=micro, part=part, stage=stage)

    @_costed
    def _on_step_begin(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # A subclass whose step() calls super().step() fires the hooks once per patched level: count
        # the nesting and keep the outermost pair only.
        self._step_depth += 1
        if self._step_depth == 1 and self._recording():
            self._phase_edge("step", "begin")

    @_costed
    def _on_step_end(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._step_depth = max(0, self._step_depth - 1)
        if not self._active or self._step_depth:
            return
        if self._recording():
            # CUDA: the step's collective and phase times are read here, the one place they are waited
            # for (a host wait per recorded step, none per collective); See [Note: device timing]
            self.engine.comm.settle_timings(wait=True)
            end = self._phase_edge("step", "end")
            self._timer.settle(wait=True)
            self._emit(self._step_record(end))
        else:
            self._comm_last = self.engine.comm.stats()
        self.step += 1
        self._begin_step_accounting(time.perf_counter())

    # --- records ---------------------------------------------------------------------------------

    def _begin_step_accounting(self, now: float) -> None:
        self._step_t = now
        self._step_comm = self._comm_last
        self._micro: dict[int | None, int] = {}
        self._backward_of: dict[int | None, int] = {}
        self._backward_open: tuple[int | None, int] | None = None
        self._phase_t: dict[tuple[str, int | None], float] = {}
        self._phase_mark: dict[tuple[str, int | None], Any] = {}
        self._phase_seconds = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self._roles_max: dict[str, int] = {}
        self._model_state_max = 0
        self._host_roles_max: dict[str, int] = {}
        self._host_model_state_max = 0
        self._pinned_max = 0
        self._allocator_max: dict[str, float] = {}
        self._peak: dict[str, Any] | None = None

    def _phase_edge(self, phase: str, edge: str, key: int | None = None, **extra: Any) -> dict[str, Any]:
        """Record one phase boundary (of pipeline stage ``key``) and fold it into the step's peaks; returns
        the record."""
        mark = self._timer.mark()
        record = self._record("phase", phase=phase, edge=edge, **extra)
        if edge == "begin":
            self._phase_t[phase, key] = record["t"]
            self._phase_mark[phase, key] = mark
        else:
            began = self._phase_t.pop((phase, key), None)
            record["seconds"] = None if began is None else round(record["t"] - began, _ROUND)
            if (phase, key) in self._phase_mark:  # the step's phase_seconds: See [Note: device timing]
                totals = self._phase_seconds
                self._timer.interval(self._phase_mark.pop((phase, key)), mark,
                                     lambda seconds: totals.__setitem__(phase, totals[phase] + seconds))
        for role, nbytes in record["roles"].items():
            self._roles_max[role] = max(self._roles_max.get(role, 0), nbytes)
        self._model_state_max = max(self._model_state_max, record["model_state_bytes"])
        for role, nbytes in record["host_roles"].items():
            self._host_roles_max[role] = max(self._host_roles_max.get(role, 0), nbytes)
        self._host_model_state_max = max(self._host_model_state_max, record["host_model_state_bytes"])
        self._pinned_max = max(self._pinned_max, record["pinned_bytes"])
        # See [Note: peak decomposition]
        split = decompose(record["roles"], record["allocator"], _MODEL_STATE_KEYS, record["host_roles"])
        if split is not None and (self._peak is None or split["total"] > self._peak["total"]):
            self._peak = {**split, "phase": phase, "edge": edge}
        for key, value in record["allocator"].items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._allocator_max[key] = max(self._allocator_max.get(key, value), value)
        self._emit(record)
        return record

    def _step_record(self, end: dict[str, Any]) -> dict[str, Any]:
        """The step's summary, built from its phase records (no new sample but the optional snapshot)."""
        allocator = dict(end["allocator"])
        if self.cuda_snapshot:
            snapshot = self.probe.snapshot()
            if snapshot is not None:
                allocator.update({to: snapshot[key] for key, to in _SNAPSHOT_FIELDS.items()},
                                 segments=len(snapshot["segments"]))
                self._emit(self._record("event", event=EVENT_CUDA_SNAPSHOT, snapshot=snapshot))
        extra = {}
        if self.pipeline is not None:
            from hfzero.profiler.pipeline import step_section

            extra["pipeline"] = step_section(self.pipeline)
        return {
            "kind": "step", "step": self.step, "phase": None, "t": end["t"], **self._coords, **extra,
            "seconds": round(end["t"] + self._t0 - self._step_t, _ROUND),
            "phase_seconds": {k: round(v, _ROUND) for k, v in self._phase_seconds.items()},
            "micro_batches": max(self._micro.values(), default=0),
            "roles": dict(self._roles_max),
            "model_state_bytes": self._model_state_max,
            "host_roles": dict(self._host_roles_max),
            "host_model_state_bytes": self._host_model_state_max,
            "pinned_bytes": self._pinned_max,
            "allocator": allocator,
            "allocator_max": dict(self._allocator_max),
            "peak": self._peak_record(allocator),
            "comm": _comm_delta(self._comm_last, self._step_comm),
        }

    def _peak_record(self, allocator: dict[str, Any]) -> dict[str, Any] | None:
        """The step's sampled peak split by [Note: peak decomposition], with the lifetime peak."""
        if self._peak is None:
            return None
        lifetime = allocator.get("peak_reserved") if self.device.type == "cuda" else allocator.get("rss_peak")
        return {**self._peak, "peak_total": lifetime}

    def _record(self, kind: str, *, phase: str | None = None, **extra: Any) -> dict[str, Any]:
        """A record of the engine's state now: roles, model-state bytes, allocator, comm since the last record."""
        now = time.perf_counter()
        held = dict(self.engine.memory_by_role())
        for source in (self.activations, self._checkpoint):
            if source is not None:
                held.update(source.memory_by_role())
        roles = {getattr(role, "value", role): int(nbytes) for role, nbytes in held.items()}
        host_held = getattr(self.engine, "host_memory_by_role", dict)()  # offloaded states (see runtime/offload.py)
        host_roles = {getattr(role, "value", role): int(nbytes) for role, nbytes in host_held.items()}
        if self._checkpoint is not None and self._checkpoint.policy.cpu and "act_checkpoint" in roles:
            host_roles["act_checkpoint"] = roles["act_checkpoint"]  # P_a+cpu: the checkpoints live on the host
        pinned = getattr(self.engine, "pinned_bytes", lambda: 0)()
        if self._checkpoint is not None:
            pinned += self._checkpoint.pinned_bytes()
        comm = self.engine.comm.stats()
        record = {
            "kind": kind, "step": self.step, "phase": phase, "t": round(now - self._t0, _ROUND), **self._coords,
            **extra,
            "roles": roles,
            "model_state_bytes": sum(b for r, b in roles.items() if r in _MODEL_STATE_KEYS),
            "host_roles": host_roles,
            "host_model_state_bytes": sum(b for r, b in host_roles.items() if r in _MODEL_STATE_KEYS),
            "pinned_bytes": int(pinned),
            "allocator": self.probe.sample(),
            "comm": _comm_delta(comm, self._comm_last),
        }
        self._comm_last = comm
        return record

    def _emit(self, record: dict[str, Any]) -> None:
        assert self._writer is not None
        try:
            self._writer.write(record)
        except OSError as err:  # a full disk must not stop training: stop recording instead
            logger.error("profiler cannot write %s (%s); recording stops", self._writer.path, err)
            self._active = False


def _comm_delta(now: dict[str, Any], before: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per collective kind with calls since ``before``: calls, elements, bytes, seconds."""
    delta = {}
    for kind, stats in now.items():
        prev = before.get(kind)
        calls = stats.calls - (prev.calls if prev else 0)
        if calls:
            delta[kind] = {
                "calls": calls,
                "elements": stats.elements - (prev.elements if prev else 0),
                "bytes": stats.bytes - (prev.bytes if prev else 0),
                "seconds": round(stats.seconds - (prev.seconds if prev else 0.0), _ROUND),
                **{field: getattr(stats, field) - (getattr(prev, field) if prev else 0)
                   for field in NODE_COMM_FIELDS if hasattr(stats, field)},  # See [Note: node traffic] in comm.py
            }
    return delta


def _top_level_tensors(output: Any) -> list[torch.Tensor]:
    """Tensors directly in a forward's output: a tensor, a tuple/list, or a mapping (HF ModelOutput)."""
    if isinstance(output, torch.Tensor):
        return [output]
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    return [v for v in values if isinstance(v, torch.Tensor)]


def _find_pipeline(model: Any, optimizer: torch.optim.Optimizer | None) -> Any:
    """The Pipeline ``model`` is, or whose optimizer ``optimizer`` is; None without one."""
    from hfzero.parallel.pipeline import Pipeline, pipeline_of

    if isinstance(model, Pipeline):
        if optimizer is not None and optimizer is not model.optimizer:
            raise ValueError("ZeroProfiler: the optimizer is not the pipeline's; pass the Pipeline and "
                             "optimizer=None (or pipe.optimizer)")
        return model
    if optimizer is None:
        raise ValueError("ZeroProfiler: optimizer is None; pass the optimizer returned by hfzero.prepare "
                         "(None only with a hfzero.pipeline Pipeline as the model)")
    for _ in range(4):  # through wrappers (accelerate's AcceleratedOptimizer) to the pipeline's optimizer
        found = pipeline_of(optimizer)
        if found is not None or getattr(optimizer, "optimizer", None) is None:
            return found
        optimizer = optimizer.optimizer
    return None


def _find_engine(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """The optimizer's ``engine`` (any object with the engine interface), else ``hfzero.get_engine(model)``."""
    engine = getattr(optimizer, "engine", None)
    if engine is not None:
        return engine
    from hfzero.runtime.engine import get_engine

    return get_engine(model)


def _model_device(model: torch.nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _global_identity() -> tuple[int, int]:
    """(global rank, global world size): rank files are named by global rank, so pipeline stages
    sharing a data-parallel rank never collide. Without torch.distributed the process is alone."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _shared_run_id(device: torch.device) -> str:
    """A fresh run id, rank 0's on every rank (one small broadcast when torch.distributed is up)."""
    run_id = uuid.uuid4().hex
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [run_id]
        dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
        run_id = box[0]
    return run_id
