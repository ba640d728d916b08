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
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hfzero.checkpoint import format as fmt
from hfzero.checkpoint import rng
from hfzero.checkpoint.common import Inventory, agree, engine_of, inventory
from hfzero.checkpoint.errors import CheckpointError
from hfzero.checkpoint.ranges import ParamRange, held_ranges
from hfzero.checkpoint.stream import read_range, read_tensor
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
    scalars: list[dict[str, Any]]  # per bucket: decoded scalar optimizer state
    rng_tensors: dict[str, torch.Tensor] | None


def load_checkpoint(directory: str | os.PathLike[str], model: nn.Module, optimizer: ZeroOptimizer, *,
                    verify: bool = True) -> dict[str, Any] | None:
    """Load a checkpoint saved by ``save_checkpoint`` at any world size and stage; return its ``extra``.

    A collective: every rank calls it. ``verify`` checks every file's SHA-256 (each file hashed by
    one rank, in 1 MiB chunks). Resident memory beyond training: one saved piece being copied, plus
    fresh optimizer-state tensors where the optimizer had none yet. RNG states are restored when
    the world size is the one saved (rank r gets rank r's), and left alone otherwise.
    Raises CheckpointError, on every rank and before touching the model, for a missing, incomplete,
    corrupt or newer-format checkpoint or one of another model.
    """
    engine = engine_of(model, optimizer)
    directory = Path(directory).absolute()
    plan, error = None, None
    try:
        plan = _validate(directory, model, optimizer, engine, verify)
    except CheckpointError as exc:
        error = str(exc)
    agree(engine.comm, error, f"load_checkpoint({directory})")
    assert plan is not None
    error = None
    try:
        _fill(plan, optimizer, engine)
    except Exception as exc:  # noqa: BLE001 - an I/O failure after validation, reported on every rank
        logger.exception("reading checkpoint data failed")
        error = f"{type(exc).__name__}: {exc}"
    agree(engine.comm, error, f"load_checkpoint({directory}): reading data after validation (the model and "
                              "optimizer are now partially loaded: load a checkpoint again before training)")
    engine.publish_params()
    manifest = plan.manifest
    engine.scaler.load_state_dict(manifest["loss_scaler"])
    optimizer.skipped_steps = int(manifest["optimizer"].get("skipped_steps", 0))
    if plan.rng_tensors is not None:
        rng.restore(plan.rng_tensors, manifest["ranks"][engine.rank]["rng"], engine.device)
    elif engine.rank == 0:
        logger.info("checkpoint world size %d != %d: RNG states not restored", manifest["world_size"],
                    engine.world_size)
    logger.info("loaded checkpoint %s (saved at world %d, stage %d) into world %d, stage %d", plan.directory,
                manifest["world_size"], manifest["stage"], engine.world_size, engine.stage)
    return manifest["extra"]


# ---- validation ------------------------------------------------------------------------------------
def _listing(items: list[str]) -> str:
    more = len(items) - _MAX_LISTED
    return ", ".join(items[:_MAX_LISTED]) + (f" and {more} more" if more > 0 else "")


def _validate(directory: Path, model: nn.Module, optimizer: ZeroOptimizer, engine: ZeroEngine,
              verify: bool) -> _Plan:
    resolved, warning = fmt.resolve(directory)
    if warning:
        logger.warning(warning)
    manifest = fmt.read_manifest(resolved)
    fmt.check_files(resolved, manifest)
    inv = inventory(model, engine)
    _match_model(resolved, manifest, inv, optimizer, engine)
    if verify:
        for i, name in enumerate(sorted(manifest["files"])):
            if i % engine.world_size == engine.rank:
                fmt.check_checksum(resolved, manifest, name)
    scalars = _bucket_scalars(resolved, manifest, engine)
    rng_tensors = None
    if manifest["world_size"] == engine.world_size:
        path = resolved / manifest["ranks"][engine.rank]["file"]
        try:
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                rng_tensors = {k: f.get_tensor(k) for k in f.keys() if k.startswith("rng/")}
        except Exception as exc:  # noqa: BLE001 - safetensors' own error types
            raise CheckpointError(f"{path}: cannot read its RNG states ({exc})") from exc
    return _Plan(resolved, manifest, inv, held_ranges(engine.layout, engine.rank), scalars, rng_tensors)


def _frozen_shape(engine: ZeroEngine, tensor: torch.Tensor) -> torch.Size:
    """A frozen tensor's whole shape (a partitioned stage-3 frozen parameter is 0-element between uses)."""
    shape = engine.frozen_shape(tensor) if isinstance(engine, Stage3Engine) else None
    return shape if shape is not None else tensor.shape


def _match_model(directory: Path, manifest: dict[str, Any], inv: Inventory, optimizer: ZeroOptimizer,
                 engine: ZeroEngine) -> None:
    where = directory / fmt.MANIFEST
    problems = []
    saved, now = manifest["params"], inv.trainable
    saved_frozen, now_frozen = manifest["frozen"], inv.frozen
    pairs = (("trainable parameters", saved, now), ("frozen parameters and buffers", saved_frozen, now_frozen))
    for label, a, b in pairs:
        missing = sorted(set(b) - set(a))
        unexpected = sorted(set(a) - set(b))
        if missing:
            problems.append(f"{label} of the model absent from the checkpoint: {_listing(missing)}")
        if unexpected:
            problems.append(f"{label} in the checkpoint the model does not have: {_listing(unexpected)}")
    # the layout's shape, not p.shape: a stage-3 parameter is a 0-element tensor between uses
    logical = {n: tuple(engine.layout.slots[p].shape) for n, p in now.items()}
    shapes = [f"{n} (checkpoint {tuple(saved[n]['shape'])}, model {shape})"
              for n, shape in logical.items() if n in saved and tuple(saved[n]["shape"]) != shape]
    frozen_shapes = {n: tuple(_frozen_shape(engine, t)) for n, (t, _) in now_frozen.items()}
    shapes += [f"{n} (checkpoint {tuple(saved_frozen[n]['shape'])}, model {shape})"
               for n, shape in frozen_shapes.items() if n in saved_frozen and tuple(saved_frozen[n]["shape"]) != shape]
    if shapes:
        problems.append(f"shape mismatch: {_listing(shapes)}")
    if problems:
        raise CheckpointError(f"{where} is a checkpoint of another model: {'; '.join(problems)}")
    opt = manifest["optimizer"]
    if opt["class"] != type(engine.optimizer).__name__:
        raise CheckpointError(f"{where}: optimizer state was saved for {opt['class']}, the optimizer now is "
                              f"{type(engine.optimizer).__name__}; build the same optimizer class")
    if len(opt["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(f"{where}: {len(opt['param_groups'])} optimizer param group(s) saved, "
                              f"{len(optimizer.param_groups)} now; build the optimizer with the same groups")
    for index, group in enumerate(opt["param_groups"]):
        mine = {s.name for b in engine.layout.group_buckets(index) for s in b.slots}
        if set(group["params"]) != mine:
            raise CheckpointError(f"{where}: optimizer param group {index} holds other parameters than saved "
                                  f"({_listing(sorted(set(group['params']) ^ mine))} differ)")


def _bucket_scalars(directory: Path, manifest: dict[str, Any], engine: ZeroEngine) -> list[dict[str, Any]]:
    """Per bucket of this layout, the scalar optimizer state its parameters share (decoded)."""
    out = []
    for bucket in engine.layout.buckets:
        chosen, source = None, None
        for slot in bucket.slots:
            scalars = manifest["params"][slot.name]["scalars"]
            if chosen is None:
                chosen, source = scalars, slot.name
            elif scalars != chosen:
                raise CheckpointError(
                    f"{directory / fmt.MANIFEST}: parameters {source!r} and {slot.name!r} have different scalar "
                    f"optimizer state ({chosen} vs {scalars}) but share one slice in this layout; load with the "
                    "bucket size used when saving")
        out.append({k: fmt.decode_value(v) for k, v in (chosen or {}).items()})
    return out


# ---- applying -------------------------------------------------------------------------------------
def _read_into(target: torch.Tensor, directory: Path, pieces: list[dict[str, Any]], key: str, start: int,
               end: int) -> None:
    """Fill ``target`` (elements [start, end) of a flattened parameter) from the saved pieces covering it."""
    for piece in pieces:
        a, b = max(start, piece["start"]), min(end, piece["end"])
        if a >= b:
            continue
        data = read_range(directory / piece["file"], key, a - piece["start"], b - piece["start"])
        target[a - start: b - start].copy_(data)


def _fill(plan: _Plan, optimizer: ZeroOptimizer, engine: ZeroEngine) -> None:
    manifest, directory = plan.manifest, plan.directory
    keys = manifest["optimizer"]["state_keys"]
    inner = engine.optimizer
    optimizer.zero_grad()
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
        for r in plan.ranges:
            pieces = manifest["params"][r.name]["pieces"]
            view = engine.master_views[r.bucket]
            _read_into(view[r.view_start: r.view_start + r.numel], directory, pieces, fmt.master_key(r.name),
                       r.start, r.end)
            for key in keys:
                _read_into(states[r.bucket][key][r.view_start: r.view_start + r.numel], directory, pieces,
                           fmt.state_key(key, r.name), r.start, r.end)
        for name, (tensor, _) in plan.inventory.frozen.items():
            value = read_tensor(directory / manifest["frozen"][name]["file"], name)
            if isinstance(engine, Stage3Engine) and tensor in engine.frozen_layout.slots:
                engine.load_frozen(tensor, value)  # partitioned: this rank's slice
            else:
                tensor.copy_(value)
    index = {id(p): i for i, p in enumerate(p for g in inner.param_groups for p in g["params"])}
    groups = inner.state_dict()["param_groups"]
    for ours, inner_group, saved in zip(optimizer.param_groups, groups, manifest["optimizer"]["param_groups"]):
        hyper = {k: fmt.decode_value(v) for k, v in saved["hyper"].items() if k in ours}
        ours.update(hyper)
        inner_group.update({k: v for k, v in hyper.items() if k in inner_group})
    inner.load_state_dict({"state": {index[id(v)]: s for v, s in zip(engine.master_views, states) if s},
                           "param_groups": groups})
