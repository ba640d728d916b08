"""Resuming a ZeroTrainer run after torchelastic restarted it, and keeping its global batch on a world change.

[Note: automatic resume]
torchelastic (``hfzero run --max_restarts N``, torchrun) restarts every worker when one fails and sets
``TORCHELASTIC_RESTART_COUNT`` (0 on the first start). A restarted script calls ``trainer.train()``
as it did the first time, so without help it retrains from step 0. ZeroTrainer.train therefore, when
``TORCHELASTIC_RESTART_COUNT`` > 0 on any rank (torchelastic counts failures per node: a node restarted
only because another node's worker failed keeps 0, so the ranks decide together, in one all-gather
every ``train`` makes), ``ZeroConfig.auto_resume`` is true (the default) and the script
passed no ``resume_from_checkpoint``, resumes from the newest *complete* ``checkpoint-N`` in
``output_dir`` (and ``resume_from_checkpoint=True`` means that checkpoint too, not the newest by name):
- complete: its ``zero_optimizer/`` resolves to a directory with ``manifest.json`` (written last, then
  swapped in by rename: see [Note: atomic checkpoint]; a save killed between its renames leaves a
  complete ``.zero_optimizer.previous``, which counts), and its ``trainer_state.json`` (the Trainer
  writes it after the shards) reads as JSON. A checkpoint whose save was killed midway is skipped;
- newest on every rank: the ranks all-gather the steps complete where each of them looks (with
  node-local storage each node has its own ``output_dir``) and take the largest step complete on all.
A fresh start (count 0) never resumes on its own: an ``output_dir`` left by an earlier run is the
script's business (``--resume_from_checkpoint``), as with the plain Trainer; it is logged.

[Note: global batch on a world change]
The Trainer's global batch is per-device batch x gradient accumulation x data-parallel replicas. A
resume at another world size (an elastic shrink or grow, or a manual restart on fewer nodes) would
change it silently. Every ZeroTrainer checkpoint records the three figures in its manifest's
``extra["trainer_batch"]``; on resume, when the script asks for the per-device batch and accumulation
it was saved with and only the replicas changed, the accumulation is scaled to keep the global batch
if it divides evenly (``keep_global_batch``), else the change is logged as a warning saying what to set.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hfzero.checkpoint import format as fmt
from hfzero.checkpoint.errors import CheckpointError
from hfzero.logging import get_logger

logger = get_logger(__name__)

RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
TRAINER_STATE = "trainer_state.json"
BATCH_KEY = "trainer_batch"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def restart_count(environ: Mapping[str, str] | None = None) -> int:
    """How many times torchelastic restarted this worker (0 outside torchelastic or on the first start)."""
    environ = os.environ if environ is None else environ
    try:
        return int(environ.get(RESTART_COUNT_ENV, "0"))
    except ValueError:
        return 0


def checkpoint_problem(checkpoint: Path) -> str | None:
    """Why ``checkpoint`` (a ``checkpoint-N/``) cannot be resumed from, or None when it is complete."""
    try:
        fmt.resolve(checkpoint / fmt.TRAINER_SHARD_DIR)
    except CheckpointError as error:
        return str(error)
    try:
        json.loads((checkpoint / TRAINER_STATE).read_text())
    except (OSError, ValueError) as error:
        return f"{checkpoint / TRAINER_STATE} is missing or unreadable ({type(error).__name__})"
    return None


def complete_steps(output_dir: str | os.PathLike[str]) -> list[int]:
    """The steps N of the complete ``checkpoint-N`` directories in ``output_dir``, ascending (incomplete ones
    are logged and skipped)."""
    root = Path(output_dir)
    steps = []
    for child in root.iterdir() if root.is_dir() else ():
        match = _CHECKPOINT.match(child.name)
        if not match or not child.is_dir():
            continue
        problem = checkpoint_problem(child)
        if problem is None:
            steps.append(int(match.group(1)))
        else:
            logger.warning("automatic resume: skipping %s, which is incomplete: %s", child, problem)
    return sorted(steps)


def newest_common_step(per_rank: list[list[int]]) -> int | None:
    """The largest step complete on every rank (each rank's list as it sees its ``output_dir``), or None."""
    common = set(per_rank[0]) if per_rank else set()
    for steps in per_rank[1:]:
        common &= set(steps)
    return max(common) if common else None


def resume_checkpoint(output_dir: str, requested: str | bool | None, enabled: bool, comm: Any) -> str | bool | None:
    """What ``train`` resumes from: ``requested`` when it names a checkpoint; for ``True`` (the Trainer's "the
    last checkpoint") the newest *complete* one (the Trainer would take the newest by name, even one whose
    save was killed); for None after a restart, see [Note: automatic resume]. Returns None (train from
    the start), a path, or ``True`` when no checkpoint is complete (the Trainer then reports it).

    A collective over ``comm`` (a hfzero Communicator over every rank): every rank calls it at the same
    point (the start of ``train``), restarted or not, because the restart counts of different nodes can
    differ (torchelastic counts failures per agent: a node restarted only because another node's worker
    failed keeps count 0). The run counts as restarted when any rank's count is above 0.
    """
    mine = {"restart": restart_count(), "steps": complete_steps(output_dir)}
    gathered = [json.loads(b) for b in comm.all_gather_bytes(json.dumps(mine).encode())]
    step = newest_common_step([g["steps"] for g in gathered])
    path = str(Path(output_dir) / f"checkpoint-{step}") if step is not None else None
    if requested is True:
        return path or True
    if requested:
        return requested
    count = max(g["restart"] for g in gathered)
    if count == 0:
        if mine["steps"] and comm.rank == 0:
            logger.info("%s holds complete checkpoints up to checkpoint-%d; a fresh start does not resume from "
                        "them (pass --resume_from_checkpoint to continue)", output_dir, mine["steps"][-1])
        return None
    if not enabled:
        if comm.rank == 0:
            logger.warning("restart %d: --zero_auto_resume false, training from the script's start", count)
        return None
    if comm.rank == 0:
        if path is None:
            logger.warning("restart %d: no checkpoint in %s is complete on every rank; training from step 0",
                           count, output_dir)
        else:
            logger.warning("restart %d: resuming from %s, the newest complete checkpoint (--zero_auto_resume "
                           "false turns this off)", count, path)
    return path


@dataclasses.dataclass(frozen=True)
class TrainerBatch:
    """The Trainer's global batch, per its three factors.

    Attributes:
        per_device: rows per device per forward (``per_device_train_batch_size``, times ``n_gpu``).
        accumulation: ``gradient_accumulation_steps``.
        replicas: data-parallel replicas (world / (tp x pp)).
    """

    per_device: int
    accumulation: int
    replicas: int

    @property
    def global_batch(self) -> int:
        return self.per_device * self.accumulation * self.replicas

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Any) -> "TrainerBatch | None":
        """The record saved in a checkpoint's ``extra``, or None when absent or malformed (older checkpoints)."""
        try:
            batch = cls(**{f.name: int(values[f.name]) for f in dataclasses.fields(cls)})
        except (TypeError, KeyError, ValueError):
            return None
        return batch if min(batch.per_device, batch.accumulation, batch.replicas) > 0 else None


@dataclasses.dataclass(frozen=True)
class BatchDecision:
    """What a resume does about the global batch.

    Attributes:
        accumulation: the gradient accumulation to train with.
        message: what changed and why (empty when nothing did).
        warning: True when the global batch changes (logged as a warning).
    """

    accumulation: int
    message: str = ""
    warning: bool = False


def keep_global_batch(saved: TrainerBatch, now: TrainerBatch) -> BatchDecision:
    """See [Note: global batch on a world change]. ``now`` is what the script asks for at this world size."""
    if now.global_batch == saved.global_batch:
        return BatchDecision(now.accumulation)
    if (now.per_device, now.accumulation) != (saved.per_device, saved.accumulation):
        return BatchDecision(now.accumulation, (
            f"the global batch changes from {saved.global_batch} (saved: {_describe(saved)}) to {now.global_batch} "
            f"({_describe(now)}): the script's batch size or accumulation differs from the checkpoint's, so it "
            "is kept as given"), warning=True)
    rows = now.per_device * now.replicas
    if saved.global_batch % rows == 0:
        accumulation = saved.global_batch // rows
        return BatchDecision(accumulation, (
            f"data-parallel replicas changed from {saved.replicas} to {now.replicas}: gradient accumulation "
            f"{now.accumulation} -> {accumulation} keeps the global batch of {saved.global_batch}"))
    return BatchDecision(now.accumulation, (
        f"data-parallel replicas changed from {saved.replicas} to {now.replicas} and the global batch of "
        f"{saved.global_batch} is not a multiple of {rows} (per-device batch {now.per_device} x {now.replicas} "
        f"replicas): it becomes {now.global_batch}. To keep it, set --per_device_train_batch_size and "
        "--gradient_accumulation_steps so that their product times the replicas is "
        f"{saved.global_batch}"), warning=True)


def _describe(batch: TrainerBatch) -> str:
    return f"{batch.per_device} per device x {batch.accumulation} accumulation x {batch.replicas} replicas"


def saved_batch(checkpoint: str | os.PathLike[str]) -> TrainerBatch | None:
    """The ``TrainerBatch`` recorded in ``checkpoint``'s ``zero_optimizer`` manifest, if any."""
    try:
        directory, _ = fmt.resolve(Path(checkpoint) / fmt.TRAINER_SHARD_DIR)
        extra = json.loads((directory / fmt.MANIFEST).read_text()).get("extra") or {}
    except (CheckpointError, OSError, ValueError):
        return None
    return TrainerBatch.from_dict(extra.get(BATCH_KEY)) if isinstance(extra, dict) else None
