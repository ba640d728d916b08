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

from hfzero.profiler.fragmentation import split_fragmentation
from hfzero.profiler.stages import pp_rank_of, stage_table
from hfzero.profiler.format import (
    COMM_FIELDS,
    NODE_COMM_FIELDS,
    EVENT_START,
    HEADER_FILE,
    KINDS,
    RANK_FILE_PATTERN,
    READABLE_VERSIONS,
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
    expected = header.get("global_world_size", header["world_size"])
    warning = _missing_ranks(path, expected, ranks)
    if warning:
        warnings.append(warning)
    return Run(path=path, header=header, ranks=dict(sorted(ranks.items())), warnings=warnings)


_PREDICTION_INPUTS = ("num_params", "dp", "stage", "param_bytes", "grad_bytes", "optimizer_k", "persistent_params")
"""The estimator inputs of a header's prediction that readers compute with (numbers)."""

_LISTED_MISSING = 8
"""Missing ranks named in a warning; the rest are counted."""


def _missing_ranks(path: Path, expected: int, ranks: dict[int, RankLog]) -> str | None:
    """A warning naming the ranks below ``expected`` without a file, or None.

    Work is bounded by the files on disk, not by ``expected`` (a header may claim any world size):
    the first few missing ranks are found among the first ``len(ranks) + _LISTED_MISSING`` ranks,
    and the rest are counted.
    """
    present = sum(1 for r in ranks if r < expected)
    if present == expected:
        return None
    listed = [r for r in range(min(expected, len(ranks) + _LISTED_MISSING)) if r not in ranks][:_LISTED_MISSING]
    count = expected - present
    more = f" and {count - len(listed)} more" if count > len(listed) else ""
    return f"{path}: no rank file for rank(s) {listed}{more} of {expected}"


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
    problem = _header_problem(header)
    if problem:
        raise ProfileFormatError(path, f"the header's {problem}")
    return header


def _header_problem(header: dict[str, Any]) -> str | None:
    """What is wrong with the types of the header's keys the readers use, or None."""
    if not isinstance(header["run_id"], str):
        return f"run_id is {header['run_id']!r}, not a string"
    for key in ("world_size", "global_world_size"):
        if key in header and not (_is_int(header[key]) and header[key] >= 1):
            return f"{key} is {_short(header[key])}, not an integer >= 1"
    if not (_is_int(header["stage"]) and 0 <= header["stage"] <= 3):
        return f"stage is {_short(header['stage'])}, not 0, 1, 2 or 3"
    model = header.get("model")
    if model is not None:
        if not isinstance(model, dict):
            return f"model is {_short(model)}, not an object"
        if model.get("class") is not None and not isinstance(model["class"], str):
            return f"model.class is {_short(model['class'])}, not a string"
        if model.get("num_params") is not None and not _is_int(model["num_params"]):
            return f"model.num_params is {_short(model['num_params'])}, not an integer"
    pipeline = header.get("pipeline")
    if pipeline is not None:
        problem = _pipeline_problem(pipeline)
        if problem:
            return problem
    prediction = header.get("prediction")
    if prediction is not None:
        if not isinstance(prediction, dict):
            return f"prediction is {_short(prediction)}, not an object"
        for key in ("model_state_bytes", "device_model_state_bytes", "host_model_state_bytes"):
            if prediction.get(key) is not None and not _is_number(prediction[key]):
                return f"prediction.{key} is {_short(prediction[key])}, not a number"
        if prediction.get("formula") is not None and not isinstance(prediction["formula"], str):
            return f"prediction.formula is {_short(prediction['formula'])}, not a string"
        inputs = prediction.get("inputs")
        if inputs is not None and not (isinstance(inputs, dict) and all(
                _is_number(inputs[k]) for k in _PREDICTION_INPUTS if inputs.get(k) is not None)):
            return f"prediction.inputs is {_short(inputs)}, not an object of numbers"
    return None


def _pipeline_problem(pipeline: Any) -> str | None:
    """What is wrong with the types of the header's ``pipeline`` section, or None."""
    if not isinstance(pipeline, dict):
        return f"pipeline is {_short(pipeline)}, not an object"
    for key in ("pp", "dp", "n_micro"):
        if not (_is_int(pipeline.get(key)) and pipeline[key] >= 1):
            return f"pipeline.{key} is {_short(pipeline.get(key))}, not an integer >= 1"
    ranks = pipeline.get("ranks")
    if not isinstance(ranks, list) or not all(isinstance(r, dict) and _is_int(r.get("pp_rank")) for r in ranks):
        return f"pipeline.ranks is {_short(ranks)}, not a list of objects with an integer pp_rank"
    for entry in ranks:
        for key in ("model_states_by_role", "comm_elements_per_step"):
            value = entry.get(key)
            if value is not None and not (isinstance(value, dict) and all(_is_number(v) for v in value.values())):
                return f"pipeline.ranks[{entry['pp_rank']}].{key} is {_short(value)}, not an object of numbers"
        if entry.get("model_state_bytes") is not None and not _is_number(entry["model_state_bytes"]):
            return f"pipeline.ranks[{entry['pp_rank']}].model_state_bytes is {_short(entry['model_state_bytes'])}"
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_version(path: Path, obj: dict[str, Any], line: int | None) -> None:
    version = obj.get("format_version")
    if version is None:
        raise ProfileFormatError(path, "no format_version: not an hfzero profile file", line)
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise ProfileFormatError(path, f"unknown format_version {version!r} (this reader understands "
                                       f"{', '.join(map(str, READABLE_VERSIONS))})", line)


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
    if not _is_int(record.get("step")) or not _is_number(record.get("t")):
        raise ProfileFormatError(path, "a record lacks an integer 'step' or a numeric 't'", number)
    problem = _record_problem(record)
    if problem:
        raise ProfileFormatError(path, f"a record's {problem}", number)
    _fill_cuda_fragmentation(record.get("allocator"))
    return record


def _fill_cuda_fragmentation(sample: dict[str, Any] | None) -> None:
    """A CUDA sample written before issue 33 has ``fragmentation`` null although it carries the two counters
    the figure is made of: fill it from them, as the profiler now records it (profiler/fragmentation.py)."""
    if not sample or sample.get("fragmentation") is not None or not str(sample.get("device", "")).startswith("cuda"):
        return
    inactive, reserved = sample.get("inactive_split"), sample.get("reserved")
    if _is_number(inactive) and _is_number(reserved):
        sample["fragmentation"] = split_fragmentation(inactive, reserved)


def _record_problem(record: Record) -> str | None:
    """What is wrong with the types of the record's keys the readers use, or None (unknown keys pass)."""
    for key in ("roles", "host_roles", "allocator", "allocator_max", "comm", "phase_seconds"):
        if record.get(key) is not None and not isinstance(record[key], dict):
            return f"{key} is {_short(record[key])}, not an object"
    for part in ("roles", "host_roles"):
        for key, value in (record.get(part) or {}).items():
            if not _is_number(value):
                return f"{part}.{key} is {_short(value)}, not a number"
    for kind, stats in (record.get("comm") or {}).items():
        if not isinstance(stats, dict) or not all(_is_number(stats.get(f, 0)) for f in COMM_FIELDS + NODE_COMM_FIELDS):
            return f"comm.{kind} is {_short(stats)}, not an object of numbers {list(COMM_FIELDS)}"
    for key in ("model_state_bytes", "host_model_state_bytes", "pinned_bytes", "seconds"):
        if record.get(key) is not None and not _is_number(record[key]):
            return f"{key} is {_short(record[key])}, not a number"
    for key in ("phase", "edge", "event"):
        if record.get(key) is not None and not isinstance(record[key], str):
            return f"{key} is {_short(record[key])}, not a string"
    for key in ("pp_rank", "dp_rank", "tp_rank", "sp_rank", "stage"):
        if record.get(key) is not None and not _is_int(record[key]):
            return f"{key} is {_short(record[key])}, not an integer"
    return _step_pipeline_problem(record.get("pipeline"))


_PIPELINE_NUMBERS = ("wall_seconds", "busy_seconds", "idle_seconds", "bubble_fraction", "idle_fraction",
                     "bubble_estimate")
"""Numeric keys of a step record's ``pipeline`` object (each may be null)."""


def _step_pipeline_problem(figures: Any) -> str | None:
    """What is wrong with the types of a step record's ``pipeline`` object, or None."""
    if figures is None:
        return None
    if not isinstance(figures, dict):
        return f"pipeline is {_short(figures)}, not an object"
    for key in _PIPELINE_NUMBERS:
        if figures.get(key) is not None and not _is_number(figures[key]):
            return f"pipeline.{key} is {_short(figures[key])}, not a number"
    for key in ("p2p", "p2p_estimate"):
        value = figures.get(key)
        if value is None:
            continue
        ok = isinstance(value, dict) and all(
            _is_number(v) or (isinstance(v, dict) and all(_is_number(x) for x in v.values())) for v in value.values())
        if not ok:
            return f"pipeline.{key} is {_short(value)}, not an object of numbers"
    return None


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
    ``host_model_state_bytes`` (the same for the part offloaded to host memory; None in profiles that
    predate it), ``pinned_bytes`` (peak page-locked host bytes; None in profiles that predate it),
    ``predicted_model_state_bytes`` and ``ratio`` (measured / predicted, None without a prediction),
    ``roles_peak`` (per role maximum), ``allocator_peak`` (maximum of each numeric allocator field),
    ``comm_per_step`` (mean per step record, per collective kind), ``comm_elements_per_step`` (all
    kinds), ``comm_inter_node_bytes_per_step`` (all kinds; None in profiles before issue 22), ``steps`` (step records), ``step_seconds`` (median), ``truncated`` and ``stopped``.
    Under pipeline parallelism each rank entry also has ``pp_rank``, its prediction is its stage's
    (the header's ``pipeline.ranks``), and ``pipeline`` is ``hfzero.profiler.stages.stage_table``
    (None without pipeline).
    """
    prediction = run.header.get("prediction")
    predicted = prediction.get("model_state_bytes") if isinstance(prediction, dict) else None
    per_stage = {e.get("pp_rank"): e.get("model_state_bytes")
                 for e in (run.header.get("pipeline") or {}).get("ranks") or [] if isinstance(e, dict)}
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
        "ranks": [{**_summarize_rank(log, per_stage.get(pp_rank_of(log.records), predicted)),
                   "pp_rank": pp_rank_of(log.records)} for log in run.ranks.values()],
        "pipeline": stage_table(run),
    }


def _summarize_rank(log: RankLog, predicted: float | None) -> dict[str, Any]:
    measured = _max_or_none(r.get("model_state_bytes") for r in log.records)
    host = _max_or_none(r.get("host_model_state_bytes") for r in log.records)
    pinned = _max_or_none(r.get("pinned_bytes") for r in log.records)
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
        "sp_rank": next((r["sp_rank"] for r in log.records if _is_int(r.get("sp_rank"))), None),
        "steps": len(steps),
        "model_state_bytes": measured,
        "host_model_state_bytes": host,
        "pinned_bytes": pinned,
        "predicted_model_state_bytes": predicted,
        "ratio": ratio,
        "roles_peak": roles_peak,
        "allocator_peak": allocator_peak,
        "comm_per_step": comm,
        "comm_elements_per_step": sum(c["elements"] for c in comm.values()),
        "comm_bytes_per_step": sum(c["bytes"] for c in comm.values()),
        "comm_inter_node_bytes_per_step": (sum(c["inter_node_bytes"] for c in comm.values())
                                           if any("inter_node_bytes" in c for c in comm.values()) else None),
        "step_seconds": statistics.median(seconds) if seconds else None,
        "truncated": log.truncated,
        "stopped": log.stopped,
    }


def _comm_per_step(steps: list[Record]) -> dict[str, dict[str, float]]:
    """Mean of each collective kind's fields over the step records (a kind absent from a step counts 0). The
    node split (``NODE_COMM_FIELDS``) is there only when the steps recorded it (issue 22 and later)."""
    if not steps:
        return {}
    split = any(f in stats for step in steps for stats in (step.get("comm") or {}).values() for f in NODE_COMM_FIELDS)
    fields = COMM_FIELDS + (NODE_COMM_FIELDS if split else ())
    totals: dict[str, dict[str, float]] = {}
    for step in steps:
        for kind, stats in (step.get("comm") or {}).items():
            entry = totals.setdefault(kind, dict.fromkeys(fields, 0))
            for field in fields:
                entry[field] += stats.get(field, 0)
    return {kind: {f: v / len(steps) for f, v in entry.items()} for kind, entry in sorted(totals.items())}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _max_or_none(values: Iterable[Any]) -> Any:
    numbers = [v for v in values if _is_number(v)]
    return max(numbers) if numbers else None
