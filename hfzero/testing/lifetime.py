"""Checks that an engine is freed: a weak reference to it, and the memory that is live before and after.

See [Note: engine lifetime] in hfzero/runtime/lifetime.py. ``del model, optimizer`` (and whatever else the caller
held: a Trainer, an accelerator, a Pipeline) must leave no engine and no tensor of it behind:

    watch = LifetimeWatch(device)          # the live bytes now (after a full collection)
    model, optimizer = hfzero.prepare(...)
    watch.track(hfzero.get_engine(model))  # a weak reference only
    ...                                     # train
    del model, optimizer
    report = watch.check()                  # collects, then compares
    assert report.freed, report.describe()

What "live bytes" is, by device (``live_bytes``):
- CUDA: ``torch.cuda.memory_allocated`` (every tensor's bytes on the device, whoever holds it), plus the host
  census below for pinned and host buffers (offload, checkpoint staging);
- CPU: a census of the tensors the garbage collector can see: the distinct storages of every live
  ``torch.Tensor`` object, parameters and DTensor local shards included, counted once however many views share
  them. Tensors held by C++ alone (an autograd graph's saved variables without a Python object) are not seen; the
  engine's own buffers all are (it holds them as Python attributes).
"""

from __future__ import annotations

import dataclasses
import gc
import warnings
import weakref
from typing import Any

import torch


def collect() -> None:
    """A full garbage collection (twice: finalizers of the first may free more)."""
    gc.collect()
    gc.collect()


def _storage(tensor: torch.Tensor) -> tuple[tuple[str, int], int] | None:
    """(key, bytes) of ``tensor``'s storage, or None for meta, fake and wrapper tensors without one of their own."""
    try:
        if tensor.device.type == "meta":
            return None
        storage = tensor.untyped_storage()
        pointer, nbytes = storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # DTensor and other wrapper subclasses
        return None
    if nbytes == 0 or pointer == 0:
        return None
    return (str(tensor.device), pointer), nbytes


def live_tensors(device: str | torch.device | None = None) -> dict[tuple[str, int], tuple[int, str]]:
    """The storages of every tensor the garbage collector sees, on ``device``'s type (None: all):
    {(device, address): (bytes, a description of one tensor viewing it)}. Call ``collect()`` first."""
    kind = None if device is None else torch.device(device).type
    found: dict[tuple[str, int], tuple[int, str]] = {}
    with warnings.catch_warnings():  # isinstance() on some lazily deprecated objects of torch warns
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in tensors:
        entry = _storage(obj)
        if entry is None or (kind is not None and obj.device.type != kind):
            continue
        key, nbytes = entry
        if key not in found:
            found[key] = (nbytes, f"{type(obj).__name__}{tuple(obj.shape)} {str(obj.dtype).removeprefix('torch.')}")
    return found


def live_bytes(device: str | torch.device = "cpu") -> int:
    """Bytes live now: on CUDA ``memory_allocated`` plus the host census (pinned buffers); on CPU the census
    (see the module docstring). Collects first."""
    collect()
    device = torch.device(device)
    host = sum(nbytes for nbytes, _ in live_tensors("cpu").values())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device) + host
    return host


def engine_collected(ref: weakref.ref) -> bool:
    """Whether the engine behind ``ref`` (a ``weakref.ref`` to it) was freed, after a full collection."""
    collect()
    return ref() is None


def referrers(obj: Any, limit: int = 8) -> list[str]:
    """Short descriptions of what refers to ``obj`` (for a failure's message: who keeps an engine alive)."""
    collect()
    out = []
    for holder in gc.get_referrers(obj)[:limit]:
        if isinstance(holder, dict):
            out.append(f"dict with keys {sorted(map(str, holder))[:6]}")
        else:
            out.append(f"{type(holder).__module__}.{type(holder).__qualname__}")
    return out


@dataclasses.dataclass
class LifetimeReport:
    """What ``LifetimeWatch.check`` found.

    Attributes:
        engines_tracked: how many engines were tracked (a check that tracked none proves nothing).
        engines_alive: how many of them are still alive.
        before, after: live bytes when the watch started and at the check (``live_bytes``).
        leaked: descriptions of the storages live at the check that were not before, largest first.
        leaked_bytes: their bytes (CPU census; the host part on CUDA).
        holders: for the first engine still alive, what refers to it.
    """

    engines_tracked: int
    engines_alive: int
    before: int
    after: int
    leaked: list[str]
    leaked_bytes: int
    holders: list[str]

    def freed(self, allowance: int = 0) -> bool:
        """At least one engine tracked, none alive, and at most ``allowance`` bytes more live than before."""
        return self.engines_tracked > 0 and self.engines_alive == 0 and self.after - self.before <= allowance

    def describe(self) -> str:
        return (f"{self.engines_alive} of {self.engines_tracked} engine(s) alive (held by {self.holders}); live bytes {self.before} before, "
                f"{self.after} after; {self.leaked_bytes} bytes in storages that were not live before: "
                f"{self.leaked[:8]}")


class LifetimeWatch:
    """The live memory before ``prepare`` and weak references to the engines made since; ``check()`` after ``del``.

    Holds no strong reference to anything it watches; its own baseline is a dict of addresses (no tensors)."""

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self._engines: list[weakref.ref] = []
        collect()
        self._storages = set(live_tensors())
        self.before = live_bytes(self.device)

    def track(self, engine: Any) -> None:
        """Watch ``engine`` (a weak reference is kept)."""
        self._engines.append(weakref.ref(engine))

    def check(self) -> LifetimeReport:
        """Collect, then report the engines still alive and the storages live now that were not before."""
        after = live_bytes(self.device)
        alive = [ref() for ref in self._engines if ref() is not None]
        holders = referrers(alive[0]) if alive else []
        new = [(nbytes, what) for key, (nbytes, what) in live_tensors().items() if key not in self._storages]
        new.sort(reverse=True)
        report = LifetimeReport(len(self._engines), len(alive), self.before, after, [f"{what}: {n} B" for n, what in new],
                                sum(n for n, _ in new), holders)
        del alive
        return report
