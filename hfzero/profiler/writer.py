"""Writing a run directory: the header atomically, rank files one flushed line per record.

A record is written with a single ``write`` of its JSON text and newline, then flushed, so a crash
leaves every earlier line complete (and at most a cut-off last line, which the reader tolerates).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from hfzero.profiler.format import HEADER_FILE, RANK_FILE_PATTERN


def write_header(run_dir: Path, header: dict[str, Any]) -> Path:
    """Write ``header.json`` atomically (temp file, fsync, rename); return its path."""
    path = run_dir / HEADER_FILE
    tmp = run_dir / f".{HEADER_FILE}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(header, f, indent=2, sort_keys=True, allow_nan=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def remove_stale_rank_files(run_dir: Path, global_world_size: int) -> list[Path]:
    """Delete ``rank-<r>.jsonl`` files with r >= ``global_world_size`` (left by an earlier, larger run)."""
    removed = []
    for file in run_dir.iterdir():
        match = RANK_FILE_PATTERN.match(file.name)
        if match is not None and int(match.group(1)) >= global_world_size:
            file.unlink(missing_ok=True)
            removed.append(file)
    return removed


class RankWriter:
    """Appends JSON records to one rank file; thread-safe (autograd may call hooks from its threads)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        """Write ``record`` as one line and flush it to the OS."""
        line = json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()
