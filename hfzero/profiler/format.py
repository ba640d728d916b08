"""Names and constants of the profile format, shared by the writer and the reader.

Pure Python (no torch), so the dashboard can import it. The format itself is documented in
``docs/profile-format.md``; a change to anything here that breaks old readers bumps
``FORMAT_VERSION``.
"""

from __future__ import annotations

import re

FORMAT_VERSION = 2
"""Version written into ``header.json`` and into the first record of every rank file.

2 (issue 11): every record carries ``pp_rank`` and ``dp_rank``; under pipeline parallelism the header
has a ``pipeline`` section, forward/backward records a ``stage`` and step records a ``pipeline`` object,
and the top-level ``prediction`` is null (per-stage predictions live in the header's ``pipeline``).
Issue 12 added ``tp_rank`` to every record (the rank in its tensor-parallel group, 0 without TP) within
version 2: an optional key, absent from earlier version-2 files. Issue 23 added ``sp_rank`` the same way
(only under sequence parallelism, where ``dp_rank`` is then the data-parallel replica, world rank // sp), and
issue 22 the ``NODE_COMM_FIELDS`` of each collective kind's ``comm`` entry and the header's ``topology``."""

READABLE_VERSIONS = (1, 2)
"""Versions the reader accepts: a version-1 file reads as a run without pipeline (pp rank 0)."""

HEADER_FILE = "header.json"
"""The run's header: configuration, model, versions, host and the estimator's prediction."""

RANK_FILE_PATTERN = re.compile(r"^rank-(\d+)\.jsonl$")
"""Per-rank JSON-lines files, ``rank-<global rank>.jsonl``."""

KINDS = ("phase", "step", "event")
"""Values of a record's ``kind``."""

PHASES = ("forward", "backward", "step")
"""Values of a phase record's ``phase``."""

EDGES = ("begin", "end")
"""Values of a phase record's ``edge``."""

EVENT_START = "start"
"""The first record of every rank file: carries ``format_version``, ``run_id`` and the rank's identity."""

EVENT_STOP = "stop"
"""The last record of a rank file whose profiler was stopped (absent after a crash)."""

EVENT_CUDA_SNAPSHOT = "cuda_snapshot"
"""Per-segment summary of ``torch.cuda.memory_snapshot()`` (only with ``cuda_snapshot=True``)."""

COMM_FIELDS = ("calls", "elements", "bytes", "seconds")
"""Fields of one collective kind's entry in a record's ``comm`` mapping."""

NODE_COMM_FIELDS = ("intra_node_bytes", "inter_node_bytes")
"""Optional fields of a ``comm`` entry (issue 22; absent from earlier files): the part of ``bytes`` that stays
inside a node and the part that crosses nodes, by [Note: node traffic] in hfzero/comm/collectives.py."""


def rank_file_name(rank: int) -> str:
    """The file name of global rank ``rank``'s records."""
    return f"rank-{rank}.jsonl"
