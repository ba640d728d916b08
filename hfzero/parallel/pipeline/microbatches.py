"""How many micro-batches a pipeline step splits a replica's batch into, when the user did not say.

torch's schedules refuse fewer micro-batches than stages (GPipe and 1F1B: ``pp_size``; the V-shaped
zero-bubble schedules: ``2 * pp_size``), with a raw ValueError raised once the model is already built and
split. A Trainer script asking for ``--zero_pp_size 2`` and nothing else (``gradient_accumulation_steps``
1, so one accumulated batch per step) gets its batch split into enough micro-batches instead; the global
batch, the loss and the gradients are the same (each micro-batch's mean loss is divided by their count,
or every token's loss by the step's token count). When the batch cannot be split so, one ConfigError says
what to change, before the model is prepared. Holds no memory.
"""

from __future__ import annotations

from hfzero.config import ConfigError
from hfzero.parallel.pipeline.schedule import ScheduleKind


def min_microbatches(kind: ScheduleKind, pp_size: int) -> int:
    """The fewest micro-batches torch's schedule ``kind`` accepts: one per stage of the pipeline."""
    return pp_size * (kind.stages_per_rank if kind.v_shape or kind.stages_per_rank == 1 else 1)


def _fits(n: int, kind: ScheduleKind, pp_size: int) -> bool:
    # looped schedules run rounds of pp_size micro-batches: a multiple of pp_size always forms whole rounds
    return n >= min_microbatches(kind, pp_size) and (kind.stages_per_rank == 1 or n % pp_size == 0)


def default_microbatches(rows: int, accumulated: int, kind: ScheduleKind, pp_size: int) -> int:
    """Micro-batches for a replica's batch of ``rows`` rows gathered from ``accumulated`` batches: the
    accumulated batches themselves when they are enough, else the fewest equal splits of the rows that
    are (a divisor of ``rows``). ConfigError when no split is possible."""
    if accumulated >= 1 and rows % accumulated == 0 and _fits(accumulated, kind, pp_size):
        return accumulated
    for n in range(max(accumulated, 1), rows + 1):
        if rows % n == 0 and _fits(n, kind, pp_size):
            return n
    need = min_microbatches(kind, pp_size)
    raise ConfigError(
        f"hfzero pipeline: the {kind.name} schedule over {pp_size} stages needs at least {need} micro-batches "
        f"per step, but a step's batch has {rows} row(s) per data-parallel replica (per-device batch x "
        f"gradient_accumulation_steps); raise --gradient_accumulation_steps to {need} (the accumulated batches "
        f"are the micro-batches), or --per_device_train_batch_size to a multiple of {need}, or set "
        f"--zero_pp_n_microbatches to a divisor of the batch of at least {need}")


def check_explicit(n_microbatches: int, kind: ScheduleKind, pp_size: int) -> None:
    """A user's ``n_microbatches`` below what torch's schedule refuses (GPipe, 1F1B and the V-shaped ones:
    one per stage): ConfigError before anything is built (the looped schedules take fewer in one round)."""
    need = min_microbatches(kind, pp_size)
    if (kind.stages_per_rank == 1 or kind.v_shape) and n_microbatches < need:
        raise ConfigError(f"hfzero pipeline: --zero_pp_n_microbatches {n_microbatches} is fewer than the {need} "
                          f"the {kind.name} schedule needs over {pp_size} stages; use at least {need}")
