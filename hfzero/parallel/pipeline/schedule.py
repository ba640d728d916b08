"""torch.distributed.pipelining schedules by name, and the PipelineStage that ends a step with ZeRO's reduction.

Depends on torch.distributed.pipelining's public classes (PipelineStage, the Schedule* classes,
``get_schedule_class``) and on one method that is public but not documented as an extension point:
``PipelineStage.perform_reduce_grad``, which every schedule calls once per stage after that stage's
last backward (GPipe and 1F1B at the end of ``_step_microbatches``, the runtime schedules as the
REDUCE_GRAD action). No private torch API is used, so no version pin; tested on torch 2.13 only
(earlier releases lack some of these schedules or the static ``input_args``/``output_args`` form).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as _schedules

from hfzero.config import ConfigError
from hfzero.parallel.pipeline.timeline import StageClock


@dataclasses.dataclass(frozen=True)
class ScheduleKind:
    """Attributes:
    name: the canonical name (torch's).
    cls: the torch schedule class.
    stages_per_rank: 1 for single-stage schedules, 2 for the multi-stage ones used here.
    v_shape: stages placed in a V (rank r holds stages r and 2P-1-r) instead of round-robin (r, r+P).
    zero_bubble: the backward is split into input and weight passes; the weight pass writes ``.grad``
        by hand, so post-accumulate-grad hooks do not see those gradients.
    """

    name: str
    cls: type
    stages_per_rank: int = 1
    v_shape: bool = False
    zero_bubble: bool = False

    def stage_ids(self, pp_rank: int, pp_size: int) -> list[int]:
        """The global stage indices this pp rank runs."""
        if self.stages_per_rank == 1:
            return [pp_rank]
        if self.v_shape:
            return [pp_rank, 2 * pp_size - 1 - pp_rank]
        return [pp_rank + k * pp_size for k in range(self.stages_per_rank)]


SCHEDULES: dict[str, ScheduleKind] = {k.name.lower(): k for k in (
    ScheduleKind("GPipe", _schedules.ScheduleGPipe),
    ScheduleKind("1F1B", _schedules.Schedule1F1B),
    ScheduleKind("Interleaved1F1B", _schedules.ScheduleInterleaved1F1B, 2),
    ScheduleKind("LoopedBFS", _schedules.ScheduleLoopedBFS, 2),
    ScheduleKind("InterleavedZeroBubble", _schedules.ScheduleInterleavedZeroBubble, 2, zero_bubble=True),
    ScheduleKind("ZBVZeroBubble", _schedules.ScheduleZBVZeroBubble, 2, v_shape=True, zero_bubble=True),
    ScheduleKind("DualPipeV", _schedules.ScheduleDualPipeV, 2, v_shape=True, zero_bubble=True),
)}


def resolve_schedule(name: str) -> ScheduleKind:
    """The schedule called ``name`` (case-insensitive); a clear error listing the valid names otherwise."""
    kind = SCHEDULES.get(str(name).lower())
    if kind is None:
        raise ConfigError(f"hfzero pipeline: unknown schedule {name!r}; valid schedules: "
                          f"{', '.join(k.name for k in SCHEDULES.values())}")
    return kind


class ZeroPipelineStage(PipelineStage):
    """A PipelineStage whose end-of-step action (REDUCE_GRAD) calls ``on_reduce_grad()``, whose backward
    and weight passes run inside ``backward_pass(stage_index, chunk_id, part)`` (part: "full", "input" or
    "weight"), and whose actions and P2P
    operations are timed and counted by ``clock``.

    The driver uses the first to run ZeRO's deferred reduction once the stage's last backward is done,
    the second to reduce only this stage's buckets and take a weight pass's hand-written ``.grad``, the
    third for the profiler's bubble and P2P figures (see [Note: measuring the bubble]). Both wrap
    the public PipelineStage methods the schedules call; the stage computes exactly what torch's does.
    """

    def __init__(self, *args, on_reduce_grad: Callable[[], None], clock: StageClock | None = None,
                 backward_pass: Callable[[int, int, str], contextlib.AbstractContextManager[None]] | None = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self._on_reduce_grad = on_reduce_grad
        self._backward_pass = backward_pass or (lambda stage, chunk, part: contextlib.nullcontext())
        self.clock = clock if clock is not None else StageClock()

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        with self.clock.span("reduce", self.stage_index, -1):
            super().perform_reduce_grad(grad_scale_factor)  # scale_grads=False: a factor of 1, nothing to scale
            if self.has_backward:
                self._on_reduce_grad()

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        with self.clock.span("forward", self.stage_index, fwd_chunk_id):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
        with self.clock.span("backward", self.stage_index, bwd_chunk_id), \
                self._backward_pass(self.stage_index, bwd_chunk_id, "full" if full else "input"):
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    def backward_weight_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        with self.clock.span("backward_weight", self.stage_index, bwd_chunk_id), \
                self._backward_pass(self.stage_index, bwd_chunk_id, "weight"):
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)

    def get_fwd_send_ops(self, fwd_chunk_id):
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        self.clock.count_p2p("send", ops)
        return ops

    def get_bwd_send_ops(self, bwd_chunk_id):
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        self.clock.count_p2p("send", ops)
        return ops

    def get_fwd_recv_ops(self, fwd_chunk_id):
        ops = super().get_fwd_recv_ops(fwd_chunk_id)
        self.clock.count_p2p("recv", ops)
        return ops

    def get_bwd_recv_ops(self, bwd_chunk_id):
        ops = super().get_bwd_recv_ops(bwd_chunk_id)
        self.clock.count_p2p("recv", ops)
        return ops
