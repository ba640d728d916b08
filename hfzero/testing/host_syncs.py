"""Count the host synchronizations hfzero makes per optimizer step (tests, the GPU validation command).

[Note: host-sync budget]
A host synchronization (reading a device value on the host: ``.item()``, ``.tolist()``, a Python
``bool`` of a tensor, creating a device tensor from Python data, ...) drains the device's queue: the
host stops issuing kernels until everything before it has run, so the compute it could have queued
ahead is lost. hfzero's budget is at most one per optimizer step, none per micro-batch (the
architecture note); its checks ride on asynchronous collectives read where the step already waits.

On a CPU machine nothing synchronizes, so ``SyncCounter`` counts a proxy: calls of the APIs that
synchronize on an accelerator (``SYNC_METHODS`` on tensors, ``torch.tensor``/``torch.as_tensor`` with
an explicit ``device``, ``nonzero``, the accelerator's ``synchronize``) made *directly from hfzero's
code* (the caller's module is under ``hfzero.`` and outside ``hfzero.testing``), whatever the device.
torch's own synchronizations (e.g. an optimizer reading a step counter) and the training loop's are
not hfzero's and are left out. On CUDA, ``measure`` also counts what torch itself reports under
``torch.cuda.set_sync_debug_mode("warn")`` (every synchronization in the step, torch's included).
"""

from __future__ import annotations

import collections
import contextlib
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch

SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__")
"""Tensor methods that read a device value on the host (each is one synchronization on an accelerator)."""

_FACTORIES = ("tensor", "as_tensor")
"""``torch`` functions that copy Python data to a device when given one (synchronous on CUDA)."""


def _from_hfzero(depth: int) -> str | None:
    """``module:line`` of the caller ``depth`` frames up when it is hfzero's (not hfzero.testing), else None."""
    frame = sys._getframe(depth + 1)
    module = frame.f_globals.get("__name__", "")
    if module.startswith("hfzero.") and not module.startswith("hfzero.testing"):
        return f"{module}:{frame.f_lineno}"
    return None


class SyncCounter:
    """Patches the synchronizing APIs while ``active()`` is entered and counts hfzero's calls of them.

    ``sites``: "module:line api" -> calls, cumulative over every ``active()`` block.
    """

    def __init__(self) -> None:
        self.sites: collections.Counter[str] = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def _count(self, api: str) -> None:
        site = _from_hfzero(2)
        if site is not None:
            self.sites[f"{site} {api}"] += 1

    def _method(self, name: str, original: Any) -> Any:
        def patched(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self._count(f"Tensor.{name}")
            return original(tensor, *args, **kwargs)
        return patched

    def _factory(self, name: str, original: Any) -> Any:
        def patched(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("device") is not None:
                self._count(f"torch.{name}(device=)")
            return original(*args, **kwargs)
        return patched

    def _plain(self, name: str, original: Any) -> Any:
        def patched(*args: Any, **kwargs: Any) -> Any:
            self._count(name)
            return original(*args, **kwargs)
        return patched

    @contextlib.contextmanager
    def active(self) -> Iterator["SyncCounter"]:
        """Count within the block (patches are undone on exit, also on error)."""
        undo: list[tuple[Any, str, Any, bool]] = []

        def patch(owner: Any, name: str, make: Any, label: str) -> None:
            had = name in vars(owner)
            original = getattr(owner, name)
            undo.append((owner, name, vars(owner).get(name), had))
            setattr(owner, name, make(label, original))

        try:
            for name in SYNC_METHODS:
                patch(torch.Tensor, name, self._method, name)
            for name in _FACTORIES:
                patch(torch, name, self._factory, name)
            patch(torch, "nonzero", self._plain, "torch.nonzero")
            if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "synchronize"):
                patch(torch.accelerator, "synchronize", self._plain, "torch.accelerator.synchronize")
            patch(torch.cuda, "synchronize", self._plain, "torch.cuda.synchronize")
            yield self
        finally:
            for owner, name, original, had in reversed(undo):
                if had:
                    setattr(owner, name, original)
                else:
                    delattr(owner, name)


def measure(rank: int, world_size: int, stage: int, accumulation_steps: int, *, steps: int = 3,
            warmup: int = 2, device: str | None = None, dtype: str = "fp32", no_sync: bool = True,
            model_kind: str = "llama", **config: Any) -> dict[str, Any]:
    """Train a tiny causal LM on this rank (in a process group already set up) and count host syncs.

    ``warmup`` steps first (recording stage 3's unit orders, building buffers), then ``steps`` counted
    steps of ``accumulation_steps`` micro-batches, the first ones under ``optimizer.no_sync()`` when
    ``no_sync`` (as Trainer and accelerate do). ``config``: more ZeroConfig options. Returns
    ``per_step`` (the proxy's count per optimizer step), ``sites`` ("module:line api" -> count over the
    counted steps) and, on CUDA, ``cuda_per_step`` (torch's sync-debug warnings per step), else None.
    """
    import hfzero
    from hfzero.testing.models import micro_batches, tiny_causal_lm, token_batches

    place = torch.device(device) if device is not None else torch.device("cpu")
    if place.type == "cuda" and place.index is None:  # rank r on GPU r (all on cuda:0 with one GPU)
        place = torch.device("cuda", rank % torch.cuda.device_count())
    if place.type == "cuda":
        torch.cuda.set_device(place)  # before the first collective: NCCL binds to the current device
    model = tiny_causal_lm(model_kind).to(place)
    options = {"stage": stage, "dtype": dtype, "param_persistence_threshold": 0, **config}
    model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      hfzero.ZeroConfig(**options))
    counter = SyncCounter()
    cuda_warnings = 0
    batches = token_batches(warmup + steps, 2 * world_size * accumulation_steps, 8)
    for step, batch in enumerate(batches):
        counting = step >= warmup
        cuda_debug = counting and place.type == "cuda"
        with contextlib.ExitStack() as stack:
            if counting:
                stack.enter_context(counter.active())
            if cuda_debug:
                caught = stack.enter_context(warnings.catch_warnings(record=True))
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
            try:
                micro = micro_batches(batch, rank, world_size, accumulation_steps)
                for index, ids in enumerate(micro):
                    ids = ids.to(place)
                    defer = no_sync and index < len(micro) - 1
                    with optimizer.no_sync() if defer else contextlib.nullcontext():
                        loss = model(input_ids=ids, labels=ids).loss / accumulation_steps
                        optimizer.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            finally:
                if cuda_debug:
                    torch.cuda.set_sync_debug_mode("default")
            if cuda_debug:
                cuda_warnings += sum("synchroniz" in str(w.message) for w in caught)
    return {"per_step": counter.total / steps, "sites": dict(counter.sites),
            "cuda_per_step": cuda_warnings / steps if place.type == "cuda" else None}


def host_syncs(stage: int, accumulation_steps: int, *, world_size: int = 2, steps: int = 3, warmup: int = 2,
               device: str | None = None, backend: str = "gloo", timeout: float = 300.0,
               **kwargs: Any) -> dict[str, Any]:
    """Spawn ``world_size`` ranks (``hfzero.testing.run_distributed``), run ``measure`` on each and
    return rank 0's result plus ``per_step_by_rank``. Used by tests/test_host_syncs.py on CPU and by the
    GPU validation command on CUDA (``device="cuda"``: gloo ranks sharing one GPU, or ``backend="nccl"``
    with ``world_size=1``)."""
    from hfzero.testing.spawn import run_distributed

    results = run_distributed(_measure_worker, world_size, stage, accumulation_steps, steps, warmup, device,
                              kwargs, backend=backend, timeout=timeout)
    return {**results[0], "per_step_by_rank": [r["per_step"] for r in results]}


def _measure_worker(rank: int, world_size: int, stage: int, accumulation_steps: int, steps: int, warmup: int,
                    device: str | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    return measure(rank, world_size, stage, accumulation_steps, steps=steps, warmup=warmup, device=device, **kwargs)
