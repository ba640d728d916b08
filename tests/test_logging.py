"""hfzero's log handler: records carry the rank, and a stderr swapped and closed by a runner breaks nothing."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from hfzero.logging import configure, get_logger


@pytest.fixture
def bare_root():
    root = logging.getLogger("hfzero")
    saved = root.handlers[:], root.level
    root.handlers.clear()
    yield root
    root.handlers[:], root.level = saved[0], saved[1]


def test_records_go_to_the_stderr_of_the_moment(bare_root: logging.Logger, monkeypatch: pytest.MonkeyPatch) -> None:
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    configure()
    first.close()  # what a test runner does to the stream it had swapped in
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    monkeypatch.setenv("RANK", "3")
    get_logger("hfzero.some_module").info("after the swap %d", 7)
    assert second.getvalue() == "[rank 3] INFO hfzero.some_module: after the swap 7\n"


def test_configure_installs_one_handler(bare_root: logging.Logger) -> None:
    configure()
    configure(logging.DEBUG)
    assert len(bare_root.handlers) == 1 and bare_root.level == logging.DEBUG
