"""The hfzero memory profiler: records a ZeRO run per rank, per step and per phase; reads it back.

The file format is documented in ``docs/profile-format.md``.
"""

from __future__ import annotations

from hfzero.profiler.reader import ProfileFormatError, RankLog, Run, load_run, summarize

__all__ = ["ProfileFormatError", "RankLog", "Run", "load_run", "summarize"]
