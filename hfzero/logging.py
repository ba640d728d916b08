"""Rank-aware loggers: one per module, records carry the rank so multi-process logs read cleanly."""

from __future__ import annotations

import logging
import os
import sys


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = os.environ.get("RANK", "0")
        return True


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is when a record is emitted, never to a stream kept from the day the
    handler was made: a test runner or a notebook that swaps stderr and closes its replacement would otherwise
    leave every later record failing with "I/O operation on closed file"."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201 - the stream StreamHandler writes to
        return sys.stderr


def get_logger(name: str) -> logging.Logger:
    """Return the logger for module ``name``; its records carry a ``rank`` attribute."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, _RankFilter) for f in logger.filters):
        logger.addFilter(_RankFilter())
    return logger


def configure(level: int | str = logging.INFO) -> None:
    """Install a ``[rank N] level name: message`` handler on the ``hfzero`` root logger (CLI and examples)."""
    root = logging.getLogger("hfzero")
    root.setLevel(level)
    if not root.handlers:
        handler = _StderrHandler()
        handler.addFilter(_RankFilter())
        handler.setFormatter(logging.Formatter("[rank %(rank)s] %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
