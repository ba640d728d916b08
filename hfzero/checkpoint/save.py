"""``save_checkpoint``: every rank writes its shard; rank 0 writes the manifest last and swaps the directory in.

[Note: atomic checkpoint]
A save into ``DIR`` happens in ``.DIR.partial`` next to it:
1. rank 0 clears and creates ``.DIR.partial``; all ranks agree (a barrier that carries errors);
2. every rank writes and fsyncs its rank file (fp32 master + optimizer-state slices, RNG states);
   rank 0 (per pipeline stage, its dp rank 0) also writes frozen tensors; ranks send rank 0 what they
   wrote; rank 0 writes the model config;
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

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

import hfzero
from hfzero.checkpoint import format as fmt
from hfzero.checkpoint import rng
from hfzero.checkpoint.common import Inventory, Scope, agree, gather_json, inventory, scope_of
from hfzero.checkpoint.errors import CheckpointError
from hfzero.checkpoint.ranges import written_ranges
from hfzero.checkpoint.stream import (TensorEntry, dtype_name, fsync_dir, write_bytes_durably,
                                      write_safetensors)
from hfzero.checkpoint.tensor_parallel import whole_runs, whole_shape
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


def save_checkpoint(directory: str | os.PathLike[str], model: Any, optimizer: ZeroOptimizer, *,
                    extra: dict[str, Any] | None = None) -> Path:
    """Save the training state of every rank into ``directory``; a collective: every rank calls it.

    ``model`` is a prepared model, or a ``hfzero.pipeline`` Pipeline (then every rank of the pp x dp world
    writes its stage's shard under the whole model's HF names; see [Note: pipeline checkpoints]).
    Written: each rank's fp32 master-weight and optimizer-state slices (its own shard only, never
    gathered), its RNG states; on rank 0 (per pipeline stage: its dp rank 0) the frozen parameters and
    persistent buffers; on rank 0 the model config, loss scaler, live optimizer hyper-parameters and
    ``extra`` (JSON-able, e.g. step counters).
    The save is atomic (see [Note: atomic checkpoint]): an existing checkpoint in ``directory`` is
    replaced only once the new one is complete. Resident memory beyond training: one tensor slice
    at a time (tensors stream to the file; a device tensor is copied to the CPU one at a time).
    Returns ``directory``.
    """
    engine, scope = scope_of(model, optimizer)
    directory = Path(directory).absolute()
    if extra is not None:
        try:
            extra = json.loads(json.dumps(extra, allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"save_checkpoint: extra must be JSON-able (numbers, strings, lists, dicts): {exc}")
    comm, rank = scope.comm, scope.rank
    tmp = fmt.partial_dir(directory)
    started = time.perf_counter()

    error = None
    if rank == 0:
        error = _guard(lambda: _prepare_dir(directory, tmp))
    agree(comm, error, f"save_checkpoint({directory}): preparing {tmp}")

    inv = inventory(scope.module, engine)
    if isinstance(engine, Stage3Engine) and engine.frozen_layout.slots:
        # partitioned frozen parameters are 0-element between uses: the rank writing them gets them whole
        whole = engine.gather_frozen(keep=scope.writes_frozen)
        inv.frozen.update({n: (whole[t], kind) for n, (t, kind) in inv.frozen.items() if t in whole})
    report: dict[str, Any] = {}
    error = _guard(lambda: report.update(_write_rank_file(tmp, engine, scope, optimizer, inv)))
    if error is None:
        _pause("rank_file_written", rank)
    gathered = gather_json(comm, {"error": error, "report": report})
    failed = [f"rank {r}: {g['error']}" for r, g in enumerate(gathered) if g["error"]]
    if failed:  # every rank sees the same list, so every rank raises
        raise CheckpointError(f"save_checkpoint({directory}): writing rank files failed: {'; '.join(failed)}")

    if rank == 0:
        reports = [g["report"] for g in gathered]
        error = _guard(lambda: _finish(directory, tmp, scope, optimizer, engine, reports, extra))
    agree(comm, error, f"save_checkpoint({directory}): writing the manifest")
    logger.info("saved checkpoint %s (world %d, stage %d) in %.2fs", directory, scope.world_size, engine.stage,
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


def _write_rank_file(tmp: Path, engine: ZeroEngine, scope: Scope, optimizer: ZeroOptimizer,
                     inv: Inventory) -> dict[str, Any]:
    """Write this rank's file (and its stage's frozen tensors if it writes them); return its report for
    the manifest: pieces, scalars, RNG, digests, and its part of the model's description."""
    keys, scalars = _split_state(engine)
    params = {slot.name: slot.param for slot in engine.layout.slots.values()}
    ranges, runs = [], []  # runs: where each range sits in the whole parameter (several under TP: tensor_parallel.py)
    for r in written_ranges(engine.layout, engine.rank, engine.world_size) if scope.writes_shard else []:
        if scope.name(r.name) not in scope.skip:
            runs.append(whole_runs(params[r.name], r.start, r.end))
            ranges.append(dataclasses.replace(r, name=scope.name(r.name)))
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
    name = fmt.rank_file(scope.rank, scope.world_size)
    # views of the live tensors: nothing is copied until write_safetensors streams each one out
    tensors = (src.reshape(-1)[a:b].reshape(e.shape) for (src, a, b), e in zip(sources, entries))
    written = {r.name for r in ranges}
    shapes = {scope.name(s.name): list(whole_shape(s.param, s.shape)) for b in engine.layout.buckets for s in b.slots
              if scope.name(s.name) in written}
    metadata = {"format": "pt", "hfzero": fmt.FORMAT_NAME, fmt.SHAPES_METADATA: json.dumps(shapes)}
    digest = write_safetensors(tmp / name, entries, tensors, metadata=metadata)
    files = {name: {"sha256": digest.sha256, "bytes": digest.bytes}}
    frozen = _write_frozen(tmp, scope, inv) if scope.writes_frozen else {}
    if frozen:
        files[scope.frozen_file] = frozen.pop("__file__")
    return {
        "file": name, "files": files, "state_keys": keys, "rng": rng_meta,
        "pieces": [[r.name, start, end, at] for r, pieces in zip(ranges, runs) for start, end, at in pieces],
        "scalars": {r.name: scalars[r.bucket] for r, pieces in zip(ranges, runs) if pieces[0][0] == 0},
        "frozen": frozen, "stages": scope.pipeline["stages"] if scope.pipeline else None,
        **_describe(engine, optimizer, scope, inv),
    }


def _describe(engine: ZeroEngine, optimizer: ZeroOptimizer, scope: Scope, inv: Inventory) -> dict[str, Any]:
    """This rank's parameters, param groups and names, under checkpoint names (what rank 0 merges)."""
    name = scope.name
    params: dict[str, Any] = {}
    for bucket in engine.layout.buckets:
        for slot in bucket.slots:
            if name(slot.name) not in scope.skip:
                params[name(slot.name)] = {"shape": list(whole_shape(slot.param, slot.shape)),
                                           "dtype": dtype_name(slot.param.dtype),
                                           "group": scope.groups[bucket.group]}
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        names = [name(s.name) for b in engine.layout.group_buckets(index) for s in b.slots]
        hyper = {k: fmt.encode_value(v, f"param_groups[{index}].{k}") for k, v in group.items() if k != "params"}
        groups.append({"index": scope.groups[index], "hyper": hyper,
                       "params": [n for n in names if n not in scope.skip]})
    aliases = {name(a): name(c) for a, c in inv.aliases.items()}
    aliases.update(scope.aliases)
    return {"params": params, "groups": groups, "aliases": aliases,
            "order": [name(n) for n in inv.order if name(n) not in scope.skip],
            "tied_targets": scope.tied_targets if scope.tied_targets is not None else inv.tied_targets}


# ---- rank 0: frozen tensors, config, manifest, swap ------------------------------------------------
def _write_frozen(tmp: Path, scope: Scope, inv: Inventory) -> dict[str, Any]:
    """Write the module's frozen tensors; return their manifest entries plus ``__file__``: the file's digest."""
    if not inv.frozen:
        return {}
    entries = [TensorEntry(scope.name(n), t.dtype, tuple(t.shape)) for n, (t, _) in inv.frozen.items()]
    digest = write_safetensors(tmp / scope.frozen_file, entries, (t for t, _ in inv.frozen.values()),
                               metadata={"format": "pt", "hfzero": fmt.FORMAT_NAME})
    out: dict[str, Any] = {scope.name(n): {"shape": list(t.shape), "dtype": dtype_name(t.dtype), "kind": kind,
                                           "file": scope.frozen_file} for n, (t, kind) in inv.frozen.items()}
    out["__file__"] = {"sha256": digest.sha256, "bytes": digest.bytes}
    return out


def _write_configs(tmp: Path, model: Any) -> dict[str, Any]:
    files = {}
    for attr, name in (("config", fmt.CONFIG_FILE), ("generation_config", fmt.GENERATION_CONFIG_FILE)):
        config = getattr(model, attr, None)
        if config is None or not hasattr(config, "to_json_string"):
            continue
        digest = write_bytes_durably(tmp / name, config.to_json_string().encode())
        files[name] = {"sha256": digest.sha256, "bytes": digest.bytes}
    return files


def _manifest(engine: ZeroEngine, optimizer: ZeroOptimizer, scope: Scope, reports: list[dict[str, Any]],
              extra: dict[str, Any] | None) -> dict[str, Any]:
    """The manifest from every rank's report (in rank order: pipeline stages in order; see
    [Note: pipeline checkpoints])."""
    keys = {tuple(r["state_keys"]) for r in reports}
    if len(keys) > 1:
        raise CheckpointError(f"ranks hold different optimizer state keys {sorted(keys)}; cannot save consistently")
    params: dict[str, Any] = {}
    groups: list[dict[str, Any]] = [{"hyper": None, "params": []} for _ in range(scope.num_groups)]
    frozen: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    order: list[str] = []
    for report in reports:
        for name, meta in report["params"].items():
            params.setdefault(name, {**meta, "pieces": [], "scalars": {}})
        for group in report["groups"]:
            merged = groups[group["index"]]
            merged["hyper"] = merged["hyper"] or group["hyper"]
            merged["params"] += [n for n in group["params"] if n not in merged["params"]]
        for name, meta in report["frozen"].items():
            frozen.setdefault(name, meta)
        aliases.update(report["aliases"])
        order += [n for n in report["order"] if n not in order]
    for report in reports:
        for name, start, end, at in report["pieces"]:
            piece = {"file": report["file"], "start": start, "end": end}
            params[name]["pieces"].append({**piece, "at": at} if at else piece)
        for name, scalars in report["scalars"].items():
            params[name]["scalars"] = scalars
    files = {name: info for r in reports for name, info in r["files"].items()}
    manifest = {
        "format": fmt.FORMAT_NAME, "format_version": fmt.FORMAT_VERSION, "hfzero_version": hfzero.__version__,
        "world_size": scope.world_size, "stage": engine.stage, "config": engine.config.to_dict(),
        "param_dtype": dtype_name(engine.policy.param_dtype), "master_dtype": dtype_name(engine.policy.master_dtype),
        "optimizer": {"class": type(engine.optimizer).__name__, "state_keys": list(keys.pop() if keys else []),
                      "param_groups": groups, "skipped_steps": optimizer.skipped_steps},
        "loss_scaler": engine.scaler.state_dict(),
        "params": params,
        "frozen": frozen,
        "aliases": aliases, "order": order, "tied_targets": reports[0]["tied_targets"],
        "files": files,
        "ranks": [{"file": r["file"], "rng": r["rng"]} for r in reports],
        "extra": extra,
    }
    if scope.tensor_parallel is not None:
        manifest["tensor_parallel"] = dict(scope.tensor_parallel)
    if scope.pipeline is not None:
        manifest["pipeline"] = {**{k: v for k, v in scope.pipeline.items() if k != "stages"},
                                "stages_of_rank": [r["stages"] for r in reports]}
    return manifest


def _finish(directory: Path, tmp: Path, scope: Scope, optimizer: ZeroOptimizer, engine: ZeroEngine,
            reports: list[dict[str, Any]], extra: dict[str, Any] | None) -> None:
    manifest = _manifest(engine, optimizer, scope, reports, extra)
    manifest["files"].update(_write_configs(tmp, scope.configs))
    write_bytes_durably(tmp / fmt.MANIFEST, json.dumps(manifest, indent=1).encode())
    fsync_dir(tmp)
    _pause("manifest_written", 0)
    swap_into_place(tmp, directory, pause=lambda: _pause("between_renames", 0))


def swap_into_place(tmp: Path, directory: Path, pause=None) -> None:
    """Rename the finished ``tmp`` to ``directory``, replacing a previous one. See [Note: atomic checkpoint]."""
    prev = fmt.previous_dir(directory)
    if prev.exists() and directory.exists():
        _remove(prev)  # left by an earlier save killed after its swap, before its cleanup
    if directory.exists():
        os.rename(directory, prev)
        if pause is not None:
            pause()
    os.rename(tmp, directory)
    fsync_dir(directory.parent)
    if prev.exists():
        _remove(prev)


def _remove(path: Path) -> None:
    """Delete a replaced directory (or the file an export with overwrite replaced)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
