"""``save_checkpoint``: every rank writes its shard; rank 0 writes the manifest last and swaps the directory in.

[Note: atomic checkpoint]
A save into ``DIR`` happens in ``.DIR.partial`` next to it:
1. rank 0 clears and creates ``.DIR.partial``; all ranks agree (a barrier that carries errors);
2. every rank writes and fsyncs its rank file (fp32 master + optimizer-state slices, RNG states);
   rank 0 also writes frozen tensors and the model config; ranks send rank 0 what they wrote;
3. rank 0 writes ``manifest.json`` (with every file's size and SHA-256) LAST, fsyncs it and the
   directory, then renames: ``DIR`` -> ``.DIR.previous`` (if it exists), ``.DIR.partial`` -> ``DIR``,
   fsyncs the parent, deletes ``.DIR.previous``.
A kill before the first rename leaves ``DIR`` untouched (and a ``.partial`` without a manifest, or
not yet swapped in, which the next save replaces); a kill between the renames leaves no ``DIR``
but a complete ``.DIR.previous``, which ``load_checkpoint(DIR)`` finds and loads. A directory
without ``manifest.json`` is never loaded. ``DIR`` must be on a file system every rank sees.

Test hook: with ``HFZERO_CHECKPOINT_PAUSE_AT=<phase>`` in the environment a rank reaching that
phase writes the path in ``HFZERO_CHECKPOINT_PAUSE_SIGNAL`` (suffixed ``.rank<r>``) and sleeps, so a
test can SIGKILL it at a known point. Phases: ``rank_file_written``, ``manifest_written``,
``between_renames``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import hfzero
from hfzero.checkpoint import format as fmt
from hfzero.checkpoint import rng
from hfzero.checkpoint.common import Inventory, agree, engine_of, gather_json, inventory
from hfzero.checkpoint.errors import CheckpointError
from hfzero.checkpoint.ranges import ParamRange, written_ranges
from hfzero.checkpoint.stream import (TensorEntry, dtype_name, fsync_dir, write_bytes_durably,
                                      write_safetensors)
from hfzero.logging import get_logger
from hfzero.runtime.engine import ZeroEngine
from hfzero.runtime.optimizer import ZeroOptimizer
from hfzero.runtime.stage3.engine import Stage3Engine

logger = get_logger(__name__)


def _pause(phase: str, rank: int) -> None:
    if os.environ.get("HFZERO_CHECKPOINT_PAUSE_AT") != phase:
        return
    signal = os.environ.get("HFZERO_CHECKPOINT_PAUSE_SIGNAL")
    if signal:
        Path(f"{signal}.rank{rank}").write_text(phase)
    logger.warning("HFZERO_CHECKPOINT_PAUSE_AT=%s: pausing the save here (test hook)", phase)
    time.sleep(600)


def save_checkpoint(directory: str | os.PathLike[str], model: nn.Module, optimizer: ZeroOptimizer, *,
                    extra: dict[str, Any] | None = None) -> Path:
    """Save the training state of every rank into ``directory``; a collective: every rank calls it.

    Written: each rank's fp32 master-weight and optimizer-state slices (its own shard only, never
    gathered), its RNG states; on rank 0 the frozen parameters, persistent buffers, model config,
    loss scaler, live optimizer hyper-parameters and ``extra`` (JSON-able, e.g. step counters).
    The save is atomic (see [Note: atomic checkpoint]): an existing checkpoint in ``directory`` is
    replaced only once the new one is complete. Resident memory beyond training: one tensor slice
    at a time (tensors stream to the file; a device tensor is copied to the CPU one at a time).
    Returns ``directory``.
    """
    engine = engine_of(model, optimizer)
    directory = Path(directory).absolute()
    if extra is not None:
        try:
            extra = json.loads(json.dumps(extra, allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"save_checkpoint: extra must be JSON-able (numbers, strings, lists, dicts): {exc}")
    comm, rank = engine.comm, engine.rank
    tmp = fmt.partial_dir(directory)
    started = time.perf_counter()

    error = None
    if rank == 0:
        error = _guard(lambda: _prepare_dir(directory, tmp))
    agree(comm, error, f"save_checkpoint({directory}): preparing {tmp}")

    inv = inventory(model, engine)
    if isinstance(engine, Stage3Engine) and engine.frozen_layout.slots:
        # partitioned frozen parameters are 0-element between uses: rank 0 writes them whole
        whole = engine.gather_frozen(keep=rank == 0)
        inv.frozen.update({n: (whole[t], kind) for n, (t, kind) in inv.frozen.items() if t in whole})
    report: dict[str, Any] = {}
    error = _guard(lambda: report.update(_write_rank_file(tmp, engine)))
    if error is None:
        _pause("rank_file_written", rank)
    gathered = gather_json(comm, {"error": error, "report": report})
    failed = [f"rank {r}: {g['error']}" for r, g in enumerate(gathered) if g["error"]]
    if failed:  # every rank sees the same list, so every rank raises
        raise CheckpointError(f"save_checkpoint({directory}): writing rank files failed: {'; '.join(failed)}")

    if rank == 0:
        reports = [g["report"] for g in gathered]
        error = _guard(lambda: _finish(directory, tmp, model, optimizer, engine, inv, reports, extra))
    agree(comm, error, f"save_checkpoint({directory}): writing the manifest")
    logger.info("saved checkpoint %s (world %d, stage %d) in %.2fs", directory, engine.world_size, engine.stage,
                time.perf_counter() - started)
    return directory


def _guard(fn) -> str | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported to every rank by agree(), then raised there
        logger.exception("checkpoint save step failed")
        return f"{type(exc).__name__}: {exc}"
    return None


def _prepare_dir(directory: Path, tmp: Path) -> None:
    if directory.exists() and not (directory / fmt.MANIFEST).is_file():
        if not directory.is_dir() or any(directory.iterdir()):
            raise CheckpointError(f"{directory} exists and is not a hfzero checkpoint; refusing to replace it. "
                                  "Choose another directory or remove it.")
    if tmp.exists():
        logger.warning("removing %s, left by an interrupted save", tmp)
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)


# ---- the rank file ----------------------------------------------------------------------------------
def _split_state(engine: ZeroEngine) -> tuple[list[str], list[dict[str, Any]]]:
    """Per bucket view: the element-wise state keys (tensors shaped like the view) and the scalar rest."""
    keys: list[str] | None = None
    scalars = []
    for bucket, view in zip(engine.layout.buckets, engine.master_views):
        state = engine.optimizer.state.get(view, {})
        elementwise = sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == view.shape
                             and v.dim() > 0)
        if keys is None:
            keys = elementwise
        elif keys != elementwise:
            raise CheckpointError(f"optimizer state of bucket {bucket.index} has keys {elementwise}, bucket 0 has "
                                  f"{keys}; hfzero saves optimizers whose slices all hold the same state")
        scalars.append({k: fmt.encode_value(v, f"optimizer state {k!r}") for k, v in state.items()
                        if k not in elementwise})
    return keys or [], scalars


def _write_rank_file(tmp: Path, engine: ZeroEngine) -> dict[str, Any]:
    """Write this rank's file; return its report for the manifest (pieces, scalars, RNG, digest)."""
    keys, scalars = _split_state(engine)
    ranges: list[ParamRange] = written_ranges(engine.layout, engine.rank, engine.world_size)
    rng_tensors, rng_meta = rng.capture(engine.device)
    entries: list[TensorEntry] = []
    sources: list[tuple[torch.Tensor, int, int]] = []  # (flat source, start, end) per entry
    for r in ranges:
        view = engine.master_views[r.bucket]
        state = engine.optimizer.state.get(view, {})
        for key, source in [(fmt.master_key(r.name), view)] + [(fmt.state_key(k, r.name), state[k]) for k in keys]:
            entries.append(TensorEntry(key, source.dtype, (r.numel,)))
            sources.append((source, r.view_start, r.view_start + r.numel))
    for key, tensor in rng_tensors.items():
        entries.append(TensorEntry(key, tensor.dtype, tuple(tensor.shape)))
        sources.append((tensor.reshape(-1), 0, tensor.numel()))
    name = fmt.rank_file(engine.rank, engine.world_size)
    # views of the live tensors: nothing is copied until write_safetensors streams each one out
    tensors = (src.reshape(-1)[a:b].reshape(e.shape) for (src, a, b), e in zip(sources, entries))
    digest = write_safetensors(tmp / name, entries, tensors, metadata={"format": "pt", "hfzero": fmt.FORMAT_NAME})
    return {
        "file": name, "sha256": digest.sha256, "bytes": digest.bytes, "state_keys": keys, "rng": rng_meta,
        "pieces": [[r.name, r.start, r.end] for r in ranges],
        "scalars": {r.name: scalars[r.bucket] for r in ranges if r.start == 0},
    }


# ---- rank 0: frozen tensors, config, manifest, swap ------------------------------------------------
def _write_frozen(tmp: Path, inv: Inventory) -> dict[str, Any]:
    if not inv.frozen:
        return {}
    entries = [TensorEntry(n, t.dtype, tuple(t.shape)) for n, (t, _) in inv.frozen.items()]
    digest = write_safetensors(tmp / fmt.FROZEN_FILE, entries, (t for t, _ in inv.frozen.values()),
                               metadata={"format": "pt", "hfzero": fmt.FORMAT_NAME})
    return {fmt.FROZEN_FILE: {"sha256": digest.sha256, "bytes": digest.bytes}}


def _write_configs(tmp: Path, model: nn.Module) -> dict[str, Any]:
    files = {}
    for attr, name in (("config", fmt.CONFIG_FILE), ("generation_config", fmt.GENERATION_CONFIG_FILE)):
        config = getattr(model, attr, None)
        if config is None or not hasattr(config, "to_json_string"):
            continue
        digest = write_bytes_durably(tmp / name, config.to_json_string().encode())
        files[name] = {"sha256": digest.sha256, "bytes": digest.bytes}
    return files


def _manifest(engine: ZeroEngine, optimizer: ZeroOptimizer, inv: Inventory, reports: list[dict[str, Any]],
              extra: dict[str, Any] | None) -> dict[str, Any]:
    keys = {tuple(r["state_keys"]) for r in reports}
    if len(keys) > 1:
        raise CheckpointError(f"ranks hold different optimizer state keys {sorted(keys)}; cannot save consistently")
    params: dict[str, Any] = {}
    for bucket in engine.layout.buckets:
        for slot in bucket.slots:
            params[slot.name] = {"shape": list(slot.shape), "dtype": dtype_name(slot.param.dtype),
                                 "group": bucket.group, "pieces": [], "scalars": {}}
    for report in reports:
        for name, start, end in report["pieces"]:
            params[name]["pieces"].append({"file": report["file"], "start": start, "end": end})
        for name, scalars in report["scalars"].items():
            params[name]["scalars"] = scalars
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        names = [s.name for b in engine.layout.group_buckets(index) for s in b.slots]
        hyper = {k: fmt.encode_value(v, f"param_groups[{index}].{k}") for k, v in group.items() if k != "params"}
        groups.append({"hyper": hyper, "params": names})
    files = {r["file"]: {"sha256": r["sha256"], "bytes": r["bytes"]} for r in reports}
    return {
        "format": fmt.FORMAT_NAME, "format_version": fmt.FORMAT_VERSION, "hfzero_version": hfzero.__version__,
        "world_size": engine.world_size, "stage": engine.stage, "config": engine.config.to_dict(),
        "param_dtype": dtype_name(engine.policy.param_dtype), "master_dtype": dtype_name(engine.policy.master_dtype),
        "optimizer": {"class": type(engine.optimizer).__name__, "state_keys": list(keys.pop() if keys else []),
                      "param_groups": groups, "skipped_steps": optimizer.skipped_steps},
        "loss_scaler": engine.scaler.state_dict(),
        "params": params,
        "frozen": {n: {"shape": list(t.shape), "dtype": dtype_name(t.dtype), "kind": kind, "file": fmt.FROZEN_FILE}
                   for n, (t, kind) in inv.frozen.items()},
        "aliases": inv.aliases, "order": inv.order, "tied_targets": inv.tied_targets,
        "files": files,
        "ranks": [{"file": r["file"], "rng": r["rng"]} for r in reports],
        "extra": extra,
    }


def _finish(directory: Path, tmp: Path, model: nn.Module, optimizer: ZeroOptimizer, engine: ZeroEngine,
            inv: Inventory, reports: list[dict[str, Any]], extra: dict[str, Any] | None) -> None:
    manifest = _manifest(engine, optimizer, inv, reports, extra)
    manifest["files"].update(_write_frozen(tmp, inv))
    manifest["files"].update(_write_configs(tmp, model))
    write_bytes_durably(tmp / fmt.MANIFEST, json.dumps(manifest, indent=1).encode())
    fsync_dir(tmp)
    _pause("manifest_written", 0)
    swap_into_place(tmp, directory, pause=lambda: _pause("between_renames", 0))


def swap_into_place(tmp: Path, directory: Path, pause=None) -> None:
    """Rename the finished ``tmp`` to ``directory``, replacing a previous one. See [Note: atomic checkpoint]."""
    prev = fmt.previous_dir(directory)
    if prev.exists() and directory.exists():
        shutil.rmtree(prev)  # left by an earlier save killed after its swap, before its cleanup
    if directory.exists():
        os.rename(directory, prev)
        if pause is not None:
            pause()
    os.rename(tmp, directory)
    fsync_dir(directory.parent)
    if prev.exists():
        shutil.rmtree(prev)
