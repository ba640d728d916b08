"""Read a profile run directory and summarize it.

Pure Python + ``json`` (no torch, no torch.distributed), so the dashboard and the CLI can read
profiles anywhere. The format is documented in ``docs/profile-format.md``.

``load_run`` validates what it reads: a missing header, malformed JSON, a file without (or with an
unknown) ``format_version`` and a rank file written by another run raise ``ProfileFormatError``
naming the file and line. The one thing it tolerates is what a crash leaves behind: a rank file whose
last line was cut off mid-write (or that is still empty). That line is dropped and a warning is added
to ``Run.warnings``; every complete line before it is kept.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hfzero.profiler.format import (
    COMM_FIELDS,
    EVENT_START,
    FORMAT_VERSION,
    HEADER_FILE,
    KINDS,
    RANK_FILE_PATTERN,
)

Record = dict[str, Any]


class ProfileFormatError(ValueError):
    """A profile file is missing, malformed, foreign or from another run.

    Attributes:
        path: the offending file (or run directory).
        line: 1-based line number in ``path`` where the problem is, when there is one.
    """

    def __init__(self, path: Path | str, message: str, line: int | None = None) -> None:
        self.path = Path(path)
        self.line = line
        where = f"{self.path}:{line}" if line is not None else str(self.path)
        super().__init__(f"{where}: {message}")


@dataclasses.dataclass(frozen=True)
class RankLog:
    """The records of one rank file, in file order.

    Attributes:
        rank: the global rank (from the file name, checked against the start record).
        path: the ``rank-<r>.jsonl`` file.
        records: every complete record, the ``start`` event first.
        truncated: the file's last line was cut off (a crash mid-write) and was dropped.
    """

    rank: int
    path: Path
    records: list[Record]
    truncated: bool = False

    @property
    def start(self) -> Record | None:
        """The ``start`` event (the rank's identity), or None when the file is empty."""
        return self.records[0] if self.records else None

    def of_kind(self, kind: str) -> list[Record]:
        """Records whose ``kind`` is ``kind`` ("phase", "step" or "event")."""
        return [r for r in self.records if r["kind"] == kind]

    @property
    def stopped(self) -> bool:
        """True when the profiler on this rank was stopped cleanly (the file ends with a stop event)."""
        return bool(self.records) and self.records[-1].get("event") == "stop"


@dataclasses.dataclass(frozen=True)
class Run:
    """A loaded run directory.

    Attributes:
        path: the run directory.
        header: the parsed ``header.json``.
        ranks: the rank logs by global rank.
        warnings: problems tolerated while loading (truncated or empty rank files, missing ranks).
    """

    path: Path
    header: dict[str, Any]
    ranks: dict[int, RankLog]
    warnings: list[str]

    @property
    def run_id(self) -> str:
        return str(self.header["run_id"])

    @property
    def stage(self) -> int:
        return int(self.header["stage"])

    @property
    def world_size(self) -> int:
        """The data-parallel degree (the paper's N_d)."""
        return int(self.header["world_size"])


def load_run(run_dir: Path | str) -> Run:
    """Load ``run_dir``: its header and every ``rank-<r>.jsonl`` file.

    Raises ProfileFormatError (naming file and line) for a missing or malformed header, a foreign or
    unknown-version file, malformed JSON before a file's last line, or a rank file of another run.
    A cut-off last line or an empty rank file becomes a warning in ``Run.warnings``.
    """
    path = Path(run_dir)
    if not path.is_dir():
        raise ProfileFormatError(path, "not a directory (expected a profile run directory)")
    header = _read_header(path / HEADER_FILE)
    warnings: list[str] = []
    ranks: dict[int, RankLog] = {}
    for file in sorted(path.iterdir()):
        match = RANK_FILE_PATTERN.match(file.name)
        if match is None:
            continue
        log, warning = _read_rank_file(file, int(match.group(1)), header)
        ranks[log.rank] = log
        if warning:
            warnings.append(warning)
    expected = int(header.get("global_world_size", header["world_size"]))
    missing = [r for r in range(expected) if r not in ranks]
    if missing:
        warnings.append(f"{path}: no rank file for rank(s) {missing} of {expected}")
    return Run(path=path, header=header, ranks=dict(sorted(ranks.items())), warnings=warnings)


def _read_header(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ProfileFormatError(path, f"missing {HEADER_FILE}: not a profile run directory")
    try:
        header = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ProfileFormatError(path, f"malformed JSON ({err})", getattr(err, "lineno", None)) from None
    if not isinstance(header, dict):
        raise ProfileFormatError(path, "the header is not a JSON object")
    _check_version(path, header, line=None)
    for key in ("run_id", "world_size", "stage"):
        if key not in header:
            raise ProfileFormatError(path, f"the header lacks required key {key!r}")
    return header


def _check_version(path: Path, obj: dict[str, Any], line: int | None) -> None:
    version = obj.get("format_version")
    if version is None:
        raise ProfileFormatError(path, "no format_version: not an hfzero profile file", line)
    if version != FORMAT_VERSION:
        raise ProfileFormatError(path, f"unknown format_version {version!r} (this reader understands "
                                       f"{FORMAT_VERSION})", line)


def _read_rank_file(path: Path, rank: int, header: dict[str, Any]) -> tuple[RankLog, str | None]:
    lines = path.read_bytes().split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline, else the last (maybe partial) line
    records = [_parse_record(path, number, raw) for number, raw in enumerate(lines, 1) if raw.strip()]
    truncated = False
    warning = None
    if tail.strip():
        try:
            records.append(_parse_record(path, len(lines) + 1, tail))
        except ProfileFormatError:
            truncated = True
            warning = f"{path}:{len(lines) + 1}: last line cut off (crashed rank?); dropped it"
    if records:
        _check_start(path, rank, records[0], header)
    elif warning is None:
        warning = f"{path}: empty rank file (the rank wrote no record)"
    return RankLog(rank=rank, path=path, records=records, truncated=truncated), warning


def _parse_record(path: Path, number: int, raw: bytes) -> Record:
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ProfileFormatError(path, f"malformed JSON ({err})", number) from None
    if not isinstance(record, dict):
        raise ProfileFormatError(path, "a record is not a JSON object", number)
    if record.get("kind") not in KINDS:
        raise ProfileFormatError(path, f"record kind {record.get('kind')!r} is not one of {list(KINDS)}", number)
    if not isinstance(record.get("step"), int) or not isinstance(record.get("t"), (int, float)):
        raise ProfileFormatError(path, "a record lacks an integer 'step' or a numeric 't'", number)
    return record


def _check_start(path: Path, rank: int, start: Record, header: dict[str, Any]) -> None:
    if start.get("event") != EVENT_START:
        raise ProfileFormatError(path, "the first record is not a start event: not an hfzero rank file", 1)
    _check_version(path, start, line=1)
    if start.get("run_id") != header["run_id"]:
        raise ProfileFormatError(path, f"rank file of another run (run_id {start.get('run_id')!r}, header "
                                       f"has {header['run_id']!r})", 1)
    if start.get("rank") != rank:
        raise ProfileFormatError(path, f"the file name says rank {rank} but the start record says "
                                       f"{start.get('rank')!r}", 1)


def summarize(run: Run) -> dict[str, Any]:
    """Condense a run into per-rank figures (the ``hfzero profile summary --json`` contract).

    Returns a dict with top-level ``stage``, ``world_size``, ``run_id``, ``model_class``,
    ``num_params``, ``prediction`` (or None), ``warnings`` and ``ranks``: one entry per rank file with
    ``model_state_bytes`` (peak over all records of the sum of the model-state roles),
    ``predicted_model_state_bytes`` and ``ratio`` (measured / predicted, None without a prediction),
    ``roles_peak`` (per role maximum), ``allocator_peak`` (maximum of each numeric allocator field),
    ``comm_per_step`` (mean per step record, per collective kind), ``comm_elements_per_step`` (all
    kinds), ``steps`` (step records), ``step_seconds`` (median), ``truncated`` and ``stopped``.
    """
    prediction = run.header.get("prediction")
    predicted = prediction.get("model_state_bytes") if isinstance(prediction, dict) else None
    model = run.header.get("model") or {}
    return {
        "format_version": run.header["format_version"],
        "run_id": run.run_id,
        "stage": run.stage,
        "world_size": run.world_size,
        "model_class": model.get("class"),
        "num_params": model.get("num_params"),
        "prediction": prediction,
        "warnings": list(run.warnings),
        "ranks": [_summarize_rank(log, predicted) for log in run.ranks.values()],
    }


def _summarize_rank(log: RankLog, predicted: float | None) -> dict[str, Any]:
    measured = _max_or_none(r.get("model_state_bytes") for r in log.records)
    steps = log.of_kind("step")
    roles_peak: dict[str, int] = {}
    allocator_peak: dict[str, float] = {}
    for record in log.records:
        for role, nbytes in (record.get("roles") or {}).items():
            roles_peak[role] = max(roles_peak.get(role, 0), nbytes)
        for sample in (record.get("allocator"), record.get("allocator_max")):
            for key, value in (sample or {}).items():
                if _is_number(value) and (key not in allocator_peak or value > allocator_peak[key]):
                    allocator_peak[key] = value
    comm = _comm_per_step(steps)
    seconds = [s["seconds"] for s in steps if _is_number(s.get("seconds"))]
    ratio = measured / predicted if measured is not None and predicted else None
    return {
        "rank": log.rank,
        "dp_rank": (log.start or {}).get("dp_rank"),
        "steps": len(steps),
        "model_state_bytes": measured,
        "predicted_model_state_bytes": predicted,
        "ratio": ratio,
        "roles_peak": roles_peak,
        "allocator_peak": allocator_peak,
        "comm_per_step": comm,
        "comm_elements_per_step": sum(c["elements"] for c in comm.values()),
        "comm_bytes_per_step": sum(c["bytes"] for c in comm.values()),
        "step_seconds": statistics.median(seconds) if seconds else None,
        "truncated": log.truncated,
        "stopped": log.stopped,
    }


def _comm_per_step(steps: list[Record]) -> dict[str, dict[str, float]]:
    """Mean of each collective kind's fields over the step records (a kind absent from a step counts 0)."""
    if not steps:
        return {}
    totals: dict[str, dict[str, float]] = {}
    for step in steps:
        for kind, stats in (step.get("comm") or {}).items():
            entry = totals.setdefault(kind, dict.fromkeys(COMM_FIELDS, 0))
            for field in COMM_FIELDS:
                entry[field] += stats.get(field, 0)
    return {kind: {f: v / len(steps) for f, v in entry.items()} for kind, entry in sorted(totals.items())}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _max_or_none(values: Iterable[Any]) -> Any:
    numbers = [v for v in values if _is_number(v)]
    return max(numbers) if numbers else None
