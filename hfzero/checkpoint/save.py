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
without ``manifest.json`` is never loaded. ``DIR`` must be on a file system every rank sees (else see
node_local.py).

With ``async_save`` steps 2-3 run on a background thread from copies staged in host memory; see
[Note: asynchronous saves] in background.py.

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

from hfzero.checkpoint import background, residuals, rng, staging
from hfzero.checkpoint import format as fmt
from hfzero.checkpoint.common import Inventory, Scope, agree, gather_json, guard, inventory, scope_of
from hfzero.checkpoint.errors import CheckpointError
from hfzero.checkpoint.ranges import written_ranges
from hfzero.checkpoint.stream import (TensorEntry, dtype_name, fsync_dir, write_bytes_durably,
                                      write_safetensors)
from hfzero.checkpoint.tensor_parallel import whole_runs, whole_shape
from hfzero.logging import get_logger
from hfzero.version import __version__
from hfzero.runtime.engine import ZeroEngine
from hfzero.runtime.optimizer import ZeroOptimizer
from hfzero.runtime.stage3.engine import Stage3Engine

logger = get_logger(__name__)

_STEP = "checkpoint save step"
"""What ``guard`` logs as failing."""


def _pause(phase: str, rank: int) -> None:
    if os.environ.get("HFZERO_CHECKPOINT_PAUSE_AT") != phase:
        return
    signal = os.environ.get("HFZERO_CHECKPOINT_PAUSE_SIGNAL")
    if signal:
        Path(f"{signal}.rank{rank}").write_text(phase)
    logger.warning("HFZERO_CHECKPOINT_PAUSE_AT=%s: pausing the save here (test hook)", phase)
    time.sleep(600)


def save_checkpoint(directory: str | os.PathLike[str], model: Any, optimizer: ZeroOptimizer, *,
                    extra: dict[str, Any] | None = None, async_save: bool | None = None) -> Path:
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

    ``async_save`` (default: the engine's ``ZeroConfig.async_save``): return after the small collectives and
    the copy of the persistent buffers; a background thread copies the rank's master and optimizer-state
    slices into its host staging buffer (held from save to save, CKPT_STAGING; the next optimizer step
    waits for that copy: see hfzero/checkpoint/staging.py), writes the files and swaps the directory in. The next save, a load, or the end of training waits for it and
    raises its failure on every rank (see [Note: asynchronous saves] in background.py). The files are
    byte for byte a synchronous save's at the same point.
    Returns ``directory``.
    """
    background.wait()  # the previous asynchronous save: finished, or its failure raised here on every rank
    engine, scope = scope_of(model, optimizer)
    async_save = engine.config.async_save if async_save is None else async_save
    directory = Path(directory).absolute()
    if extra is not None:
        try:
            extra = json.loads(json.dumps(extra, allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"save_checkpoint: extra must be JSON-able (numbers, strings, lists, dicts): {exc}")
    comm, rank = scope.comm, scope.rank
    side = background.side_comm(comm) if async_save else None
    if async_save and side is None:
        logger.warning("save_checkpoint(%s): asynchronous saves need a checkpoint group spanning the world; this "
                       "save's ranks are a sub-group, so it runs synchronously", directory)
        async_save = False
    tmp = fmt.partial_dir(directory)
    started = time.perf_counter()

    error = None
    if rank == 0:
        error = guard(lambda: _prepare_dir(directory, tmp), _STEP)
    agree(comm, error, f"save_checkpoint({directory}): preparing {tmp}")

    inv = inventory(scope.module, engine)
    private: set[str] = set()  # frozen tensors that are this save's own copies (never changed by training)
    if isinstance(engine, Stage3Engine) and engine.frozen_layout.slots:
        # partitioned frozen parameters are 0-element between uses: the rank writing them gets them whole
        whole = engine.gather_frozen(keep=scope.writes_frozen)
        private = {scope.name(n) for n, (t, _) in inv.frozen.items() if t in whole}
        inv.frozen.update({n: (whole[t], kind) for n, (t, kind) in inv.frozen.items() if t in whole})
    files: list[_File] = []
    report: dict[str, Any] = {}
    copies: staging.StagedCopies | None = None

    def plan() -> None:
        nonlocal copies
        rng_tensors, rng_meta = rng.capture(engine.device)
        residual_tensors, residual_meta = residuals.capture(engine, scope)  # See [Note: residuals in checkpoints]
        files.extend(_plan_files(engine, scope, inv, {**rng_tensors, **residual_tensors}))
        report.update(_report(engine, scope, optimizer, inv, files[0], rng_meta))
        report["quant_residual"] = residual_meta
        if async_save:
            copies = _stage(engine, files, private)

    error = guard(plan, _STEP)
    gathered = gather_json(comm, {"error": error, "report": report})
    failed = [f"rank {r}: {g['error']}" for r, g in enumerate(gathered) if g["error"]]
    if failed:  # every rank sees the same list, so every rank raises
        raise CheckpointError(f"save_checkpoint({directory}): preparing rank files failed: {'; '.join(failed)}")
    manifest: dict[str, Any] = {}
    error = None
    if rank == 0:  # the manifest as training stands now (hyper-parameters, loss scale, step counters)
        error = guard(lambda: manifest.update(_manifest(engine, optimizer, scope, [g["report"] for g in gathered],
                                                        extra, configs=_config_files(scope.configs))), _STEP)
    agree(comm, error, f"save_checkpoint({directory}): building the manifest")

    def finish(comm: Any) -> None:
        _write_and_swap(comm, rank, directory, tmp, files, manifest, copies)
        logger.info("saved checkpoint %s (world %d, stage %d) in %.2fs%s", directory, scope.world_size,
                    engine.stage, time.perf_counter() - started, " (asynchronously)" if async_save else "")

    if async_save:
        engine.checkpoint_copy = copies
        background.start(directory, lambda: finish(side))
        logger.info("checkpoint %s staged in %.3fs; writing it in the background", directory,
                    time.perf_counter() - started)
    else:
        finish(comm)
    return directory


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


@dataclasses.dataclass
class _File:
    """One safetensors file this rank writes: its entries and their tensors (views of the live ones, or
    after ``_stage`` their copies in the staging buffer), produced in order when the file is written."""

    name: str
    entries: list[TensorEntry]
    tensors: list[torch.Tensor]
    metadata: dict[str, str]
    kinds: list[str] = dataclasses.field(default_factory=list)  # frozen files: "parameter" / "buffer" per entry

    def write(self, tmp: Path) -> dict[str, Any]:
        digest = write_safetensors(tmp / self.name, self.entries, iter(self.tensors), metadata=self.metadata)
        return {self.name: {"sha256": digest.sha256, "bytes": digest.bytes}}


def _plan_files(engine: ZeroEngine, scope: Scope, inv: Inventory, rank_tensors: dict[str, torch.Tensor]) -> list[_File]:
    """This rank's file (views of its master and optimizer-state slices, its RNG states, qgZ's error-feedback
    residuals) and, if it writes them, its stage's frozen tensors. Nothing is copied (``rank_tensors``: the small fresh
    RNG tensors and views of the live residuals, written as they are named)."""
    keys, _ = _split_state(engine)
    entries: list[TensorEntry] = []
    tensors: list[torch.Tensor] = []
    ranges = _ranges(engine, scope)[0]
    for r in ranges:
        view = engine.master_views[r.bucket]
        state = engine.optimizer.state.get(view, {})
        for key, source in [(fmt.master_key(r.name), view)] + [(fmt.state_key(k, r.name), state[k]) for k in keys]:
            entries.append(TensorEntry(key, source.dtype, (r.numel,)))
            tensors.append(source.reshape(-1)[r.view_start: r.view_start + r.numel])
    for key, tensor in rank_tensors.items():
        entries.append(TensorEntry(key, tensor.dtype, tuple(tensor.shape)))
        tensors.append(tensor)
    written = {r.name for r in ranges}
    shapes = {scope.name(s.name): list(whole_shape(s.param, s.shape)) for b in engine.layout.buckets for s in b.slots
              if scope.name(s.name) in written}
    metadata = {"format": "pt", "hfzero": fmt.FORMAT_NAME, fmt.SHAPES_METADATA: json.dumps(shapes)}
    files = [_File(fmt.rank_file(scope.rank, scope.world_size), entries, tensors, metadata)]
    if scope.writes_frozen and inv.frozen:
        files.append(_File(scope.frozen_file,
                           [TensorEntry(scope.name(n), t.dtype, tuple(t.shape)) for n, (t, _) in inv.frozen.items()],
                           [t for t, _ in inv.frozen.values()], {"format": "pt", "hfzero": fmt.FORMAT_NAME},
                           [kind for _, kind in inv.frozen.values()]))
    return files


def _stage(engine: ZeroEngine, files: list[_File], private: set[str]) -> staging.StagedCopies:
    """Point every file's tensors that training may change before the background write at copies in the
    staging buffer: the rank file's (master and optimizer-state slices, RNG: copied later, see staging.py;
    qgZ's residuals: copied now, a backward changes them) and the frozen file's buffers (copied now: a forward may
    change them). Frozen *parameters* are not
    staged: no optimizer steps them (and at stage 3 they are this save's own gathered copies), so a
    background write reads them as they are."""
    rank_file = files[0]
    frozen = files[1] if len(files) > 1 else None
    buffers = []
    if frozen is not None:
        buffers = [t for e, t, kind in zip(frozen.entries, frozen.tensors, frozen.kinds)
                   if kind != "parameter" and e.name not in private]
    # qgZ's residuals change in the next backward, before the step that waits for deferred copies: copied now
    eager_rank = [e.name.startswith(residuals.PREFIX) for e in rank_file.entries]
    copies = staging.StagedCopies(engine, buffers + [t for t, now in zip(rank_file.tensors, eager_rank) if now],
                                  [t for t, now in zip(rank_file.tensors, eager_rank) if not now])
    residual_copies, deferred = iter(copies.eager[len(buffers):]), iter(copies.deferred)
    rank_file.tensors = [next(residual_copies) if now else next(deferred) for now in eager_rank]
    if frozen is not None:
        staged = iter(copies.eager[:len(buffers)])
        frozen.tensors = [t if kind == "parameter" or e.name in private else next(staged)
                          for e, t, kind in zip(frozen.entries, frozen.tensors, frozen.kinds)]
    return copies


def _ranges(engine: ZeroEngine, scope: Scope) -> tuple[list[Any], list[Any]]:
    """The element ranges this rank writes (under checkpoint names) and where each sits in the whole
    parameter (several runs under TP: tensor_parallel.py)."""
    params = {slot.name: slot.param for slot in engine.layout.slots.values()}
    ranges, runs = [], []
    for r in written_ranges(engine.layout, engine.rank, engine.world_size) if scope.writes_shard else []:
        if scope.name(r.name) not in scope.skip:
            runs.append(whole_runs(params[r.name], r.start, r.end))
            ranges.append(dataclasses.replace(r, name=scope.name(r.name)))
    return ranges, runs


def _report(engine: ZeroEngine, scope: Scope, optimizer: ZeroOptimizer, inv: Inventory, rank_file: _File,
            rng_meta: dict[str, Any]) -> dict[str, Any]:
    """This rank's part of the manifest: pieces, scalars, RNG, frozen entries, its part of the model's
    description (the files' digests come once they are written)."""
    keys, scalars = _split_state(engine)
    ranges, runs = _ranges(engine, scope)
    frozen: dict[str, Any] = {}
    if scope.writes_frozen:
        frozen = {scope.name(n): {"shape": list(t.shape), "dtype": dtype_name(t.dtype), "kind": kind,
                                  "file": scope.frozen_file} for n, (t, kind) in inv.frozen.items()}
    return {
        "file": rank_file.name, "state_keys": keys, "rng": rng_meta,
        "pieces": [[r.name, start, end, at] for r, pieces in zip(ranges, runs) for start, end, at in pieces],
        "scalars": {r.name: scalars[r.bucket] for r, pieces in zip(ranges, runs) if pieces[0][0] == 0},
        "frozen": frozen, "stages": scope.pipeline["stages"] if scope.pipeline else None,
        **_describe(engine, optimizer, scope, inv),
    }


def _write_and_swap(comm: Any, rank: int, directory: Path, tmp: Path, files: list[_File],
                    manifest: dict[str, Any], copies: staging.StagedCopies | None = None) -> None:
    """Write and fsync this rank's files (an asynchronous save first completes ``copies``, its deferred copies
    into the staging buffer); the ranks exchange digests; rank 0 writes the manifest and swaps the directory
    in; every rank raises any rank's failure (a collective over ``comm``)."""
    digests: dict[str, Any] = {}

    def write() -> None:
        if copies is not None:
            copies.run()  # the next optimizer step waits for this, not for the writing
        for f in files:
            digests.update(f.write(tmp))

    error = guard(write, _STEP)
    if error is None:
        _pause("rank_file_written", rank)
    gathered = gather_json(comm, {"error": error, "files": digests})
    failed = [f"rank {r}: {g['error']}" for r, g in enumerate(gathered) if g["error"]]
    if failed:  # every rank sees the same list, so every rank raises
        raise CheckpointError(f"save_checkpoint({directory}): writing rank files failed: {'; '.join(failed)}")
    error = None
    if rank == 0:
        for g in gathered:
            manifest["files"].update(g["files"])
        error = guard(lambda: _finish(directory, tmp, manifest), _STEP)
    agree(comm, error, f"save_checkpoint({directory}): writing the manifest")


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


# ---- rank 0: config, manifest, swap ------------------------------------------------------------------
def _config_files(model: Any) -> dict[str, bytes]:
    """The model's HF config and generation config as the bytes rank 0 writes."""
    out = {}
    for attr, name in (("config", fmt.CONFIG_FILE), ("generation_config", fmt.GENERATION_CONFIG_FILE)):
        config = getattr(model, attr, None)
        if config is not None and hasattr(config, "to_json_string"):
            out[name] = config.to_json_string().encode()
    return out


def _manifest(engine: ZeroEngine, optimizer: ZeroOptimizer, scope: Scope, reports: list[dict[str, Any]],
              extra: dict[str, Any] | None, configs: dict[str, bytes]) -> dict[str, Any]:
    """The manifest from every rank's report (in rank order: pipeline stages in order; see
    [Note: pipeline checkpoints]), without the tensor files' digests (added once they are written);
    ``configs``: the config files' contents, kept under ``_configs`` until ``_finish`` writes them."""
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
    manifest = {
        "format": fmt.FORMAT_NAME, "format_version": fmt.FORMAT_VERSION, "hfzero_version": __version__,
        "world_size": scope.world_size, "stage": engine.stage, "config": engine.config.to_dict(),
        "param_dtype": dtype_name(engine.policy.param_dtype), "master_dtype": dtype_name(engine.policy.master_dtype),
        "optimizer": {"class": type(engine.optimizer).__name__, "state_keys": list(keys.pop() if keys else []),
                      "param_groups": groups, "skipped_steps": optimizer.skipped_steps},
        "loss_scaler": engine.scaler.state_dict(),
        "params": params,
        "frozen": frozen,
        "aliases": aliases, "order": order, "tied_targets": reports[0]["tied_targets"],
        "files": {},
        "ranks": [{"file": r["file"], "rng": r["rng"],
                   **({"quant_residual": r["quant_residual"]} if r.get("quant_residual") else {})} for r in reports],
        "extra": extra,
    }
    if scope.tensor_parallel is not None:
        manifest["tensor_parallel"] = dict(scope.tensor_parallel)
    if scope.expert_parallel is not None:
        manifest["expert_parallel"] = dict(scope.expert_parallel)
    if scope.pipeline is not None:
        manifest["pipeline"] = {**{k: v for k, v in scope.pipeline.items() if k != "stages"},
                                "stages_of_rank": [r["stages"] for r in reports]}
    manifest["_configs"] = configs
    return manifest


def _finish(directory: Path, tmp: Path, manifest: dict[str, Any]) -> None:
    """Rank 0: write the config files and the manifest (last), fsync, swap the directory in."""
    for name, data in manifest.pop("_configs").items():
        digest = write_bytes_durably(tmp / name, data)
        manifest["files"][name] = {"sha256": digest.sha256, "bytes": digest.bytes}
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
