"""``load_checkpoint``: validate everything on every rank, then fill this rank's slices from any layout.

Resharding needs no conversion step: the manifest lists, per parameter, which element ranges each
file holds (see ranges.py), and a rank reads exactly the ranges its master views cover from
whichever files hold them (``safe_open(...).get_slice(key)[a:b]`` reads only those bytes). The
scalar optimizer state of a slice (Adam's ``step``) is shared by every parameter of the slice, so
it is taken from any of them (they must agree).

Order of work (nothing touches the model until every rank has validated everything):
1. resolve the directory (see [Note: atomic checkpoint] in save.py), parse the manifest, check its
   format version, every file's presence and size, and that its parameters, frozen tensors,
   buffers, param groups and optimizer class match the model's;
2. verify SHA-256 checksums, the files split round-robin over the ranks, and read this rank's RNG
   tensors;
3. all ranks agree (any rank's error is raised on every rank);
4. fill master slices and optimizer state in place, frozen tensors, hyper-parameters; agree again;
   all-gather the parameters (``engine.publish_params``); restore loss scaler and RNG states.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import torch

from hfzero.checkpoint import background, residuals, rng
from hfzero.checkpoint import format as fmt
from hfzero.checkpoint.common import Inventory, Scope, agree, gather_json, inventory, scope_of
from hfzero.checkpoint.errors import CheckpointError
from hfzero.checkpoint.ranges import ParamRange, held_ranges
from hfzero.checkpoint.stream import read_range, read_tensor
from hfzero.checkpoint.tensor_parallel import Run, whole_runs, whole_shape
from hfzero.logging import get_logger
from hfzero.runtime.engine import ZeroEngine
from hfzero.runtime.optimizer import ZeroOptimizer
from hfzero.runtime.stage3.engine import Stage3Engine

logger = get_logger(__name__)

_MAX_LISTED = 5


@dataclasses.dataclass
class _Plan:
    """Everything validated, ready to apply."""

    directory: Path
    manifest: dict[str, Any]
    inventory: Inventory
    ranges: list[ParamRange]
    runs: list[list[Run]]  # per range: where it sits in the whole parameter (see tensor_parallel.py)
    scalars: list[dict[str, Any]]  # per bucket: decoded scalar optimizer state
    hyper: list[dict[str, Any]]  # per param group: decoded hyper-parameters the optimizer has
    rng_tensors: dict[str, torch.Tensor] | None


def load_checkpoint(directory: str | os.PathLike[str], model: Any, optimizer: ZeroOptimizer, *,
                    verify: bool = True) -> dict[str, Any] | None:
    """Load a checkpoint saved by ``save_checkpoint`` at any world size and stage; return its ``extra``.

    A collective: every rank calls it. ``model`` is a prepared model or a ``hfzero.pipeline`` Pipeline;
    checkpoints saved with or without a pipeline load into either (any pp and dp sizes; see
    [Note: pipeline checkpoints]). ``verify`` checks every file's SHA-256 (each file hashed by
    one rank, in 1 MiB chunks). Resident memory beyond training: one saved piece being copied, plus
    fresh optimizer-state tensors where the optimizer had none yet. RNG states are restored when
    the world size is the one saved (rank r gets rank r's), and left alone otherwise; qgZ's error-feedback residuals
    when every rank's layout is the one saved, else dropped with a warning ([Note: residuals in checkpoints]).
    An asynchronous save still in flight is waited for first (its failure raised).
    Raises CheckpointError, on every rank and before touching the model, for a missing, incomplete,
    corrupt or newer-format checkpoint or one of another model.
    """
    background.wait()  # an asynchronous save in flight (perhaps of this very checkpoint) finishes first
    engine, scope = scope_of(model, optimizer)
    directory = Path(directory).absolute()
    inv = inventory(scope.module, engine)
    mine = _model_names(scope, inv)
    held = mine
    if scope.spans_stages:  # the stages together must hold what was saved
        held = {k: sorted({n for g in gather_json(scope.comm, mine) for n in g[k]}) for k in mine}
    plan, error = None, None
    try:
        plan = _validate(directory, scope, inv, held, optimizer, engine, verify)
    except CheckpointError as exc:
        error = str(exc)
    except OSError as exc:  # e.g. a file this rank may not read
        error = f"cannot read {directory}: {exc} ({type(exc).__name__})"
    agree(scope.comm, error, f"load_checkpoint({directory})")
    assert plan is not None
    restore_residuals = residuals.decide(engine, scope, plan.manifest)  # See [Note: residuals in checkpoints]
    error = None
    try:
        _fill(plan, scope, optimizer, engine)
        residuals.restore(engine, scope, plan.manifest, plan.directory, restore_residuals)
    except Exception as exc:  # noqa: BLE001 - an I/O failure after validation, reported on every rank
        logger.exception("reading checkpoint data failed")
        error = f"{type(exc).__name__}: {exc}"
    agree(scope.comm, error, f"load_checkpoint({directory}): reading data after validation (the model and "
                             "optimizer are now partially loaded: load a checkpoint again before training)")
    engine.publish_params()
    manifest = plan.manifest
    engine.scaler.load_state_dict(manifest["loss_scaler"])
    optimizer.skipped_steps = int(manifest["optimizer"].get("skipped_steps", 0))
    if plan.rng_tensors is not None:
        rng.restore(plan.rng_tensors, manifest["ranks"][scope.rank]["rng"], engine.device)
    elif scope.rank == 0:
        logger.info("checkpoint world size %d != %d: RNG states not restored", manifest["world_size"],
                    scope.world_size)
    logger.info("loaded checkpoint %s (saved at world %d, stage %d) into world %d, stage %d", plan.directory,
                manifest["world_size"], manifest["stage"], scope.world_size, engine.stage)
    return manifest["extra"]


# ---- validation ------------------------------------------------------------------------------------
def _listing(items: list[str]) -> str:
    more = len(items) - _MAX_LISTED
    return ", ".join(items[:_MAX_LISTED]) + (f" and {more} more" if more > 0 else "")


def _model_names(scope: Scope, inv: Inventory) -> dict[str, list[str]]:
    """This rank's trainable and frozen names, as checkpoint names (a tied copy under its canonical name)."""
    def canonical(name: str) -> str:
        name = scope.name(name)
        return scope.aliases.get(name, name)

    return {"trainable": sorted({canonical(n) for n in inv.trainable}),
            "frozen": sorted({canonical(n) for n in inv.frozen})}


def _source(manifest: dict[str, Any], scope: Scope, name: str) -> str:
    """The checkpoint name holding module tensor ``name`` (a tied copy reads its canonical tensor)."""
    name = scope.name(name)
    if name in manifest["params"] or name in manifest["frozen"]:
        return name
    return manifest["aliases"].get(name, scope.aliases.get(name, name))


def _validate(directory: Path, scope: Scope, inv: Inventory, held: dict[str, list[str]], optimizer: ZeroOptimizer,
              engine: ZeroEngine, verify: bool) -> _Plan:
    resolved, warning = fmt.resolve(directory)
    if warning:
        logger.warning(warning)
    manifest = fmt.read_manifest(resolved)
    fmt.check_files(resolved, manifest)
    _match_model(resolved, manifest, inv, held, optimizer, engine, scope)
    for i, name in enumerate(sorted(manifest["files"])):
        if i % scope.world_size == scope.rank:
            if verify:
                fmt.check_checksum(resolved, manifest, name)
            fmt.check_header(resolved, manifest, name)
    scalars = _bucket_scalars(resolved, manifest, engine, scope)
    hyper = _hyper(resolved, manifest, optimizer, scope)
    _check_scaler(resolved, manifest, engine)
    rng_tensors = None
    if manifest["world_size"] == scope.world_size:
        path = resolved / manifest["ranks"][scope.rank]["file"]
        try:
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                rng_tensors = {k: f.get_tensor(k) for k in f.keys() if k.startswith("rng/")}
        except Exception as exc:  # noqa: BLE001 - safetensors' own error types
            raise CheckpointError(f"{path}: cannot read its RNG states ({exc})") from exc
        rng.check(rng_tensors, manifest["ranks"][scope.rank]["rng"], engine.device)
    params = {slot.name: slot.param for slot in engine.layout.slots.values()}
    held = held_ranges(engine.layout, engine.rank)
    runs = [whole_runs(params[r.name], r.start, r.end) for r in held]
    ranges = [dataclasses.replace(r, name=_source(manifest, scope, r.name)) for r in held]
    return _Plan(resolved, manifest, inv, ranges, runs, scalars, hyper, rng_tensors)


def _frozen_shape(engine: ZeroEngine, tensor: torch.Tensor) -> torch.Size:
    """A frozen tensor's whole shape (a partitioned stage-3 frozen parameter is 0-element between uses)."""
    shape = engine.frozen_shape(tensor) if isinstance(engine, Stage3Engine) else None
    return shape if shape is not None else tensor.shape


def _match_model(directory: Path, manifest: dict[str, Any], inv: Inventory, held: dict[str, list[str]],
                 optimizer: ZeroOptimizer, engine: ZeroEngine, scope: Scope) -> None:
    """``held``: the names the model holds (every stage's, under a pipeline) as checkpoint names."""
    where = directory / fmt.MANIFEST
    problems = []
    saved, saved_frozen = manifest["params"], manifest["frozen"]
    pairs = (("trainable parameters", saved, held["trainable"]),
             ("frozen parameters and buffers", saved_frozen, held["frozen"]))
    for label, a, b in pairs:
        missing = sorted(set(b) - set(a))
        unexpected = sorted(set(a) - set(b))
        if missing:
            problems.append(f"{label} of the model absent from the checkpoint: {_listing(missing)}")
        if unexpected:
            problems.append(f"{label} in the checkpoint the model does not have: {_listing(unexpected)}")
    # the layout's shape, not p.shape: a stage-3 parameter is a 0-element tensor between uses
    logical = {_source(manifest, scope, n): tuple(whole_shape(p, engine.layout.slots[p].shape))
               for n, p in inv.trainable.items()}
    shapes = [f"{n} (checkpoint {tuple(saved[n]['shape'])}, model {shape})"
              for n, shape in logical.items() if n in saved and tuple(saved[n]["shape"]) != shape]
    frozen_now = {_source(manifest, scope, n): tuple(_frozen_shape(engine, t)) for n, (t, _) in inv.frozen.items()}
    shapes += [f"{n} (checkpoint {tuple(saved_frozen[n]['shape'])}, model {shape})"
               for n, shape in frozen_now.items() if n in saved_frozen and tuple(saved_frozen[n]["shape"]) != shape]
    if shapes:
        problems.append(f"shape mismatch: {_listing(shapes)}")
    if problems:
        raise CheckpointError(f"{where} is a checkpoint of another model: {'; '.join(problems)}")
    opt = manifest["optimizer"]
    if opt["class"] != type(engine.optimizer).__name__:
        raise CheckpointError(f"{where}: optimizer state was saved for {opt['class']}, the optimizer now is "
                              f"{type(engine.optimizer).__name__}; build the same optimizer class")
    if len(opt["param_groups"]) != scope.num_groups:
        raise CheckpointError(f"{where}: {len(opt['param_groups'])} optimizer param group(s) saved, "
                              f"{scope.num_groups} now; build the optimizer with the same groups")
    for index in range(len(optimizer.param_groups)):
        saved_group = set(opt["param_groups"][scope.groups[index]]["params"])
        mine = {_source(manifest, scope, s.name) for b in engine.layout.group_buckets(index) for s in b.slots}
        # under a pipeline this rank holds part of each group; the stages together were checked above
        wrong = mine - saved_group if scope.spans_stages else mine ^ saved_group
        if wrong:
            raise CheckpointError(f"{where}: optimizer param group {scope.groups[index]} holds other parameters "
                                  f"than saved ({_listing(sorted(wrong))} differ)")


def _bucket_scalars(directory: Path, manifest: dict[str, Any], engine: ZeroEngine,
                    scope: Scope) -> list[dict[str, Any]]:
    """Per bucket of this layout, the scalar optimizer state its parameters share (decoded)."""
    out = []
    for bucket in engine.layout.buckets:
        chosen, source = None, None
        for slot in bucket.slots:
            scalars = manifest["params"][_source(manifest, scope, slot.name)]["scalars"]
            if chosen is None:
                chosen, source = scalars, slot.name
            elif scalars != chosen:
                raise CheckpointError(
                    f"{directory / fmt.MANIFEST}: parameters {source!r} and {slot.name!r} have different scalar "
                    f"optimizer state ({chosen} vs {scalars}) but share one slice in this layout; load with the "
                    "bucket size used when saving")
        decoded = {k: fmt.decode_value(v) for k, v in (chosen or {}).items()}
        now = engine.optimizer.state.get(engine.master_views[bucket.index], {})
        wrong = [f"{k}={v!r}" for k, v in decoded.items() if k in now and not _compatible(v, now[k])]
        if wrong:
            raise CheckpointError(f"{directory / fmt.MANIFEST}: scalar optimizer state of {source!r} has the wrong "
                                  f"kind: {_listing(wrong)}; the manifest was edited or corrupted")
        out.append(decoded)
    return out


def _compatible(saved: Any, now: Any) -> bool:
    """Whether a saved optimizer value can stand where the optimizer now holds ``now`` (same kind of value)."""
    if now is None or saved is None:
        return True
    if isinstance(now, bool) or isinstance(saved, bool):
        return isinstance(now, bool) and isinstance(saved, bool)
    if isinstance(now, (int, float)):
        return isinstance(saved, (int, float)) and math.isfinite(saved)
    if isinstance(now, torch.Tensor):
        return isinstance(saved, torch.Tensor) and saved.numel() == now.numel()
    if isinstance(now, (tuple, list)):
        return (isinstance(saved, (tuple, list)) and len(saved) == len(now)
                and all(_compatible(a, b) for a, b in zip(saved, now)))
    return type(saved) is type(now)


def _hyper(directory: Path, manifest: dict[str, Any], optimizer: ZeroOptimizer, scope: Scope) -> list[dict[str, Any]]:
    """Per param group of the engine, the saved hyper-parameters (of the checkpoint group it maps to, see
    Scope.groups) the optimizer has, decoded and checked against its own."""
    out = []
    saved_groups = manifest["optimizer"]["param_groups"]
    for index, ours in enumerate(optimizer.param_groups):
        saved = saved_groups[scope.groups[index]]
        hyper = {k: fmt.decode_value(v) for k, v in saved["hyper"].items() if k in ours and k != "params"}
        wrong = [f"{k}={v!r} (the optimizer has {ours[k]!r})" for k, v in hyper.items() if not _compatible(v, ours[k])]
        if wrong:
            raise CheckpointError(f"{directory / fmt.MANIFEST}: param group {index} has hyper-parameters of the wrong "
                                  f"kind: {_listing(wrong)}; the manifest was edited or corrupted")
        out.append(hyper)
    return out


def _check_scaler(directory: Path, manifest: dict[str, Any], engine: ZeroEngine) -> None:
    """The saved loss-scaler state has the keys the engine's scaler reads, with integers where it keeps integers."""
    saved, now = manifest["loss_scaler"], engine.scaler.state_dict()
    if set(saved) != set(now) or any(isinstance(now[k], int) and not isinstance(saved[k], int) for k in now):
        raise CheckpointError(f"{directory / fmt.MANIFEST}: loss_scaler {saved} does not have the form "
                              f"{sorted(now)} (numbers); the manifest was edited or corrupted")
    if saved.get("scale", 1) <= 0:
        raise CheckpointError(f"{directory / fmt.MANIFEST}: loss_scaler scale {saved['scale']} must be > 0")


# ---- applying -------------------------------------------------------------------------------------
def _read_into(target: torch.Tensor, directory: Path, pieces: list[dict[str, Any]], key: str, start: int,
               end: int) -> None:
    """Fill ``target`` (elements [start, end) of a flattened parameter) from the saved pieces covering it
    (a piece's data starts at its ``at`` in the file's tensor; see [Note: tensor-parallel checkpoints])."""
    for piece in pieces:
        a, b = max(start, piece["start"]), min(end, piece["end"])
        if a >= b:
            continue
        at = piece.get("at", 0) - piece["start"]
        data = read_range(directory / piece["file"], key, at + a, at + b)
        target[a - start: b - start].copy_(data)


def _fill(plan: _Plan, scope: Scope, optimizer: ZeroOptimizer, engine: ZeroEngine) -> None:
    manifest, directory = plan.manifest, plan.directory
    keys = manifest["optimizer"]["state_keys"]
    inner = engine.optimizer
    optimizer.zero_grad()
    engine.wait_host_copies()  # offload: the host writes master weights and states below
    states: list[dict[str, Any]] = []
    for bucket, view in zip(engine.layout.buckets, engine.master_views):
        old = inner.state.get(view, {})
        state = {}
        for key in keys:
            t = old.get(key)
            if not (isinstance(t, torch.Tensor) and t.shape == view.shape):
                t = torch.empty_like(view)
            state[key] = t.zero_()  # padding elements belong to no parameter: zero
        state.update(plan.scalars[bucket.index])
        states.append(state)
    with torch.no_grad():
        for r, runs in zip(plan.ranges, plan.runs):
            pieces = manifest["params"][r.name]["pieces"]
            targets = [(engine.master_views[r.bucket], fmt.master_key(r.name))]
            targets += [(states[r.bucket][key], fmt.state_key(key, r.name)) for key in keys]
            for flat, key in targets:
                mine = flat[r.view_start: r.view_start + r.numel]
                for start, end, at in runs:
                    _read_into(mine[at: at + end - start], directory, pieces, key, start, end)
        for name, (tensor, _) in plan.inventory.frozen.items():
            name = _source(manifest, scope, name)
            value = read_tensor(directory / manifest["frozen"][name]["file"], name)
            if isinstance(engine, Stage3Engine) and tensor in engine.frozen_layout.slots:
                engine.load_frozen(tensor, value)  # partitioned: this rank's slice
            else:
                tensor.copy_(value)
    index = {id(p): i for i, p in enumerate(p for g in inner.param_groups for p in g["params"])}
    groups = inner.state_dict()["param_groups"]
    for ours, inner_group, hyper in zip(optimizer.param_groups, groups, plan.hyper):
        ours.update(hyper)
        inner_group.update({k: v for k, v in hyper.items() if k in inner_group})
    inner.load_state_dict({"state": {index[id(v)]: s for v, s in zip(engine.master_views, states) if s},
                           "param_groups": groups})
