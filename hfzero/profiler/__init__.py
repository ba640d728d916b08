"""The hfzero memory profiler: records a ZeRO run per rank, per step and per phase; reads it back.

``ZeroProfiler`` (the recorder, which imports torch) is loaded on first use, so
``hfzero.profiler.reader`` stays importable without pulling in the recorder.
The file format is documented in ``docs/profile-format.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hfzero.profiler.reader import ProfileFormatError, RankLog, Run, load_run, summarize

if TYPE_CHECKING:
    from hfzero.profiler.recorder import ZeroProfiler

__all__ = ["ProfileFormatError", "RankLog", "Run", "ZeroProfiler", "load_run", "summarize"]


def __getattr__(name: str) -> Any:
    if name == "ZeroProfiler":
        from hfzero.profiler.recorder import ZeroProfiler

        return ZeroProfiler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
