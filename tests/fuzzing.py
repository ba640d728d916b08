"""Seeded mutations of files for the reader fuzz tests: truncation, byte flips, JSON type swaps, huge
numbers and missing keys. Deterministic for a given ``random.Random``; no file is read here."""

from __future__ import annotations

import contextlib
import copy
import json
import random
import signal
from collections.abc import Iterator
from typing import Any

REPLACEMENTS: tuple[Any, ...] = ("x", "", [], [1, 2], {}, {"a": 1}, None, True, 0, -1, 1.5, 10**30, -(10**30),
                                 1e308, 10_000_000_000)
"""What a JSON value may be swapped for: other types, empty containers, huge and negative numbers."""


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(value, dict):
        for key, child in value.items():
            out += _paths(child, prefix + (key,))
    elif isinstance(value, list):
        for index, child in enumerate(value[:8]):
            out += _paths(child, prefix + (index,))
    return out


def mutate_json(value: Any, rng: random.Random) -> Any:
    """A copy of ``value`` with one node deleted or replaced by a value of another type or size."""
    value = copy.deepcopy(value)
    path = rng.choice(_paths(value)[1:] or [()])
    if not path:
        return rng.choice(REPLACEMENTS)
    parent = value
    for key in path[:-1]:
        parent = parent[key]
    if rng.random() < 0.3:
        del parent[path[-1]]  # a missing key (or list entry)
    else:
        parent[path[-1]] = rng.choice(REPLACEMENTS)
    return value


def mutate_bytes(raw: bytes, rng: random.Random, limit: int | None = None) -> bytes:
    """Truncated, or one to four bytes flipped (within the first ``limit`` bytes when given)."""
    if not raw:
        return b"x"
    if rng.random() < 0.4:
        return raw[:rng.randrange(len(raw))]
    out = bytearray(raw)
    for _ in range(rng.randint(1, 4)):
        out[rng.randrange(min(len(out), limit or len(out)))] ^= 1 << rng.randrange(8)
    return bytes(out)


def mutate_text_json(raw: bytes, rng: random.Random) -> bytes:
    """A JSON document mutated structurally (70%) or byte-wise (30%)."""
    if rng.random() < 0.3:
        return mutate_bytes(raw, rng)
    return json.dumps(mutate_json(json.loads(raw), rng)).encode()


def mutate_json_lines(raw: bytes, rng: random.Random) -> bytes:
    """One line of a JSON-lines file mutated (structurally or byte-wise), or the file truncated."""
    lines = raw.split(b"\n")
    index = rng.randrange(max(1, len(lines) - 1))
    if rng.random() < 0.2:
        return mutate_bytes(raw, rng)
    lines[index] = mutate_text_json(lines[index], rng)
    return b"\n".join(lines)


class Hang(BaseException):
    """A reader ran past the per-case time limit (BaseException: no ``except Exception`` swallows it)."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise Hang in the main thread if the block runs longer than ``seconds``."""
    def _raise(signum: int, frame: Any) -> None:
        raise Hang(f"still running after {seconds}s")

    previous = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
