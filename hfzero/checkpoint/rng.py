"""Per-rank RNG states (Python, NumPy if installed, torch CPU, the engine's accelerator) as tensors + JSON.

Resident memory: a few KiB per source. The device is handled through ``torch.get_device_module``,
so the same code covers CUDA and any other accelerator backend (no device ladder).
"""

from __future__ import annotations

import random
from typing import Any

import torch

from hfzero.checkpoint.errors import CheckpointError
from hfzero.logging import get_logger

logger = get_logger(__name__)


def _numpy():
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def _device_module(device: torch.device):
    if device.type == "cpu":
        return None
    module = torch.get_device_module(device.type)
    return module if hasattr(module, "get_rng_state") else None


def capture(device: torch.device) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This process's RNG states: tensors (for the rank file) and the JSON rest (for the manifest)."""
    version, mt, gauss = random.getstate()
    tensors = {"rng/python": torch.tensor(mt, dtype=torch.int64), "rng/torch": torch.get_rng_state()}
    meta: dict[str, Any] = {"python": {"version": version, "gauss_next": gauss}, "numpy": None, "device": None}
    np = _numpy()
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        tensors["rng/numpy"] = torch.from_numpy(keys.astype("int64"))
        meta["numpy"] = {"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    module = _device_module(device)
    if module is not None:
        tensors["rng/device"] = module.get_rng_state(device).cpu()
        meta["device"] = device.type
    return tensors, meta


def restore(tensors: dict[str, torch.Tensor], meta: dict[str, Any], device: torch.device) -> None:
    """Set this process's RNG states from ``capture``'s output (read back from a checkpoint)."""
    try:
        python = meta["python"]
        random.setstate((python["version"], tuple(int(x) for x in tensors["rng/python"].tolist()),
                         python["gauss_next"]))
        torch.set_rng_state(tensors["rng/torch"])
        np = _numpy()
        if meta.get("numpy") and np is not None:
            n = meta["numpy"]
            np.random.set_state((n["kind"], tensors["rng/numpy"].numpy().astype("uint32"), n["pos"], n["has_gauss"],
                                 n["cached_gaussian"]))
        module = _device_module(device)
        if meta.get("device") == device.type and module is not None:
            module.set_rng_state(tensors["rng/device"], device)
        elif meta.get("device"):
            logger.info("checkpoint has a %s RNG state but this rank runs on %s; not restored", meta["device"], device)
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError, OverflowError, IndexError) as exc:
        raise CheckpointError(f"the saved RNG state is malformed ({exc})") from exc


def check(tensors: dict[str, torch.Tensor], meta: dict[str, Any], device: torch.device) -> None:
    """Raise CheckpointError if ``restore`` would fail on these states; this process's RNGs are left as they were."""
    current = capture(device)
    try:
        restore(tensors, meta, device)
    finally:
        restore(*current, device)
