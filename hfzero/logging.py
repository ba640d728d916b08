"""Rank-aware loggers: one per module, records carry the rank so multi-process logs read cleanly."""

from __future__ import annotations

import logging
import os


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = os.environ.get("RANK", "0")
        return True


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
        handler = logging.StreamHandler()
        handler.addFilter(_RankFilter())
        handler.setFormatter(logging.Formatter("[rank %(rank)s] %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
