"""The on-disk checkpoint format (version 1): file names, the JSON manifest, and its validation.

A checkpoint is a directory (see docs/checkpoints.md)::

    manifest.json                 written last: its presence marks the checkpoint complete
    rank00000-of-00002.safetensors  fp32 master weights and optimizer-state slices, RNG states of rank 0
    rank00001-of-00002.safetensors  ... of rank 1
    frozen.safetensors            frozen parameters and persistent buffers (rank 0), if the model has any
    config.json                   the model's Hugging Face config (rank 0), if it has one
    generation_config.json        likewise

Tensor names inside rank files: ``master/<param>`` and ``state/<key>/<param>`` are 1-D fp32 element
ranges of the flattened parameter (the manifest says which range), ``rng/<source>`` RNG states,
``quant_residual/<bucket>/<hop>`` qgZ's error-feedback residuals (only with ``quantize_error_feedback``; the rank's
manifest entry says which layout they belong to: see hfzero/checkpoint/residuals.py). Readers that predate them
ignore them, so the format version stays 1.
Nothing is pickled: tensors are safetensors, everything else JSON.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from hfzero.checkpoint.errors import CheckpointError

FORMAT_NAME = "hfzero-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
FROZEN_FILE = "frozen.safetensors"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"


def rank_file(rank: int, world_size: int) -> str:
    return f"rank{rank:05d}-of-{world_size:05d}.safetensors"


def master_key(name: str) -> str:
    return f"master/{name}"


def state_key(key: str, name: str) -> str:
    return f"state/{key}/{name}"


def partial_dir(path: Path) -> Path:
    """Where a save into ``path`` is assembled before it is renamed into place."""
    return path.parent / f".{path.name}.partial"


def previous_dir(path: Path) -> Path:
    """Where the checkpoint being replaced by a save into ``path`` waits until the save is in place."""
    return path.parent / f".{path.name}.previous"


# ---- JSON encoding of optimizer values ------------------------------------------------------------
def encode_value(value: Any, where: str) -> Any:
    """A hyper-parameter or scalar optimizer state as exact JSON (tuples and 0-dim tensors tagged)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise CheckpointError(f"{where}: a tensor of shape {tuple(value.shape)} cannot be stored as a scalar")
        return {"__tensor__": {"dtype": str(value.dtype).removeprefix("torch."), "value": value.item(),
                               "shape": list(value.shape)}}
    if isinstance(value, tuple):
        return {"__tuple__": [encode_value(v, where) for v in value]}
    if isinstance(value, list):
        return [encode_value(v, where) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: encode_value(v, f"{where}.{k}") for k, v in value.items()}
    raise CheckpointError(f"{where}: a {type(value).__name__} cannot be saved in a checkpoint manifest (JSON); "
                          "use numbers, strings, tuples or 0-dim tensors for optimizer hyper-parameters")


def decode_value(value: Any) -> Any:
    """Inverse of ``encode_value``; a malformed tagged value raises CheckpointError."""
    try:
        return _decode(value)
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError, OverflowError) as exc:
        raise CheckpointError(f"a manifest value {_short(value)} cannot be decoded ({type(exc).__name__}: "
                              f"{exc})") from None


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(_decode(v) for v in value["__tuple__"])
        if "__tensor__" in value:
            spec = value["__tensor__"]
            dtype = getattr(torch, str(spec["dtype"]), None)
            if not isinstance(dtype, torch.dtype) or not isinstance(spec["value"], (int, float, bool)):
                raise ValueError(f"not a scalar tensor spec: {spec!r}")
            return torch.tensor(spec["value"], dtype=dtype).reshape(spec["shape"])
        return {k: _decode(v) for k, v in value.items()}
    return value


# ---- reading and validating -----------------------------------------------------------------------
def resolve(path: Path) -> tuple[Path, str | None]:
    """The directory to load for checkpoint ``path``, and a warning to log if it is not ``path`` itself.

    A save that replaced ``path`` and was killed between its two renames leaves the previous
    checkpoint at ``previous_dir(path)``; it is complete, so it is used.
    """
    if (path / MANIFEST).is_file():
        return path, None
    prev = previous_dir(path)
    if not path.exists() and (prev / MANIFEST).is_file():
        return prev, (f"{path} is missing but the checkpoint it replaced is complete at {prev} (a save was "
                      "interrupted while swapping directories); loading that one")
    if path.is_dir():
        raise CheckpointError(_not_a_checkpoint(path))
    if path.exists():
        raise CheckpointError(f"{path} is not a directory; a hfzero checkpoint is a directory with a {MANIFEST}")
    hint = ""
    if partial_dir(path).exists():
        hint = f" An incomplete save was found at {partial_dir(path)} (interrupted before it finished)."
    raise CheckpointError(f"checkpoint directory {path} does not exist.{hint}")


TRAINER_SHARD_DIR = "zero_optimizer"
"""Where a ZeroTrainer checkpoint (``checkpoint-N/``) keeps its hfzero checkpoint."""


def _not_a_checkpoint(path: Path) -> str:
    """Why directory ``path`` (no manifest) is not loadable, naming what it looks like instead."""
    names = sorted(p.name for p in path.iterdir())
    listed = f"{names[:6]}{'...' if len(names) > 6 else ''}"
    shards = [n for n in names if n.lstrip(".").startswith(TRAINER_SHARD_DIR)]  # Trainer's, or accelerate's _<i>
    if shards:
        inner = path / shards[0].lstrip(".").removesuffix(".previous")
        return (f"{path} is a Trainer or accelerate checkpoint, not a hfzero checkpoint; its hfzero checkpoint is "
                f"{inner} (resume with ZeroTrainer(resume_from_checkpoint=...) / load_state, or pass that directory)")
    if (path / "latest").is_file() or any(n.startswith("global_step") or n == "zero_to_fp32.py" for n in names):
        return (f"{path} is a DeepSpeed checkpoint, not a hfzero checkpoint (no {MANIFEST}); convert it with "
                "DeepSpeed's zero_to_fp32.py and start from those weights")
    if (path / CONFIG_FILE).is_file() and any(n.endswith((".safetensors", ".bin")) and not n.startswith("rank")
                                              for n in names):
        return (f"{path} is a Hugging Face model directory, not a hfzero checkpoint (no {MANIFEST}); load its "
                "weights with from_pretrained before hfzero.prepare")
    if any(n.startswith("rank") and n.endswith(".safetensors") for n in names):
        return (f"{path} is an incomplete checkpoint: it has no {MANIFEST} (written last by save_checkpoint), so "
                f"the save that produced it did not finish (files present: {listed}). Load an earlier checkpoint.")
    return f"{path} is not a hfzero checkpoint: it has no {MANIFEST} (files present: {listed})"


def read_manifest(directory: Path) -> dict[str, Any]:
    """Parse and structurally validate ``directory/manifest.json``; raise CheckpointError naming the problem."""
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); the manifest is corrupt or truncated") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path} is not a hfzero checkpoint manifest (its 'format' is not {FORMAT_NAME!r})")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version < 1:
        raise CheckpointError(f"{path}: invalid format_version {version!r}")
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{path} has format version {version}, written by a newer hfzero; this version reads "
                              f"format versions up to {FORMAT_VERSION}. Upgrade hfzero to load it.")
    try:
        _check_structure(manifest)
    except KeyError as exc:
        raise CheckpointError(f"{path} is malformed: a required key {exc} is missing; the manifest was edited or "
                              "corrupted") from None
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path} is malformed ({type(exc).__name__}: {exc}); the manifest was edited or "
                              "corrupted") from None
    return manifest


def _int(value: Any, what: str, low: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{what} is {value!r}, not an integer >= {low}")
    return value


def _typed(value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ValueError(f"{what} is {type(value).__name__} {_short(value)}, not {names}")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _shape(value: Any, what: str) -> int:
    """Validate a shape (a list of integers >= 0); return its number of elements."""
    numel = 1
    for d in _typed(value, list, f"{what} shape"):
        numel *= _int(d, f"{what} shape entry")
    return numel


def _check_structure(m: dict[str, Any]) -> None:
    """Every key and type the readers use, so nothing downstream meets a KeyError or TypeError."""
    files = _typed(m["files"], dict, "'files'")
    for name, info in files.items():
        if "/" in name or "\\" in name or name.startswith(".") or not name:
            raise ValueError(f"file name {name!r} is not a plain file name")
        _int(_typed(info, dict, f"files[{name!r}]")["bytes"], f"files[{name!r}].bytes")
        _typed(info["sha256"], str, f"files[{name!r}].sha256")
    _int(m["world_size"], "'world_size'", 1)
    stage = _int(m["stage"], "'stage'")
    if stage > 3:
        raise ValueError(f"'stage' is {stage}, not 0-3")
    _typed(m["master_dtype"], str, "'master_dtype'")
    for name, p in _typed(m["params"], dict, "'params'").items():
        _check_param(name, _typed(p, dict, f"params[{name!r}]"), files)
    for name, f in _typed(m["frozen"], dict, "'frozen'").items():
        _typed(f, dict, f"frozen[{name!r}]")
        _shape(f["shape"], f"frozen tensor {name!r}")
        _typed(f["dtype"], str, f"frozen[{name!r}].dtype")
        _typed(f["kind"], str, f"frozen[{name!r}].kind")
        if f["file"] not in files:
            raise ValueError(f"frozen tensor {name!r} refers to unlisted file {f['file']!r}")
    for alias, canonical in _typed(m["aliases"], dict, "'aliases'").items():
        _typed(canonical, str, f"aliases[{alias!r}]")
    for key in ("order", "tied_targets"):
        for item in _typed(m[key], list, f"'{key}'"):
            _typed(item, str, f"an entry of '{key}'")
    ranks = _typed(m["ranks"], list, "'ranks'")
    if len(ranks) != m["world_size"]:
        raise ValueError(f"{len(ranks)} rank entries for world size {m['world_size']}")
    for index, entry in enumerate(ranks):
        _typed(_typed(entry, dict, f"ranks[{index}]")["rng"], dict, f"ranks[{index}].rng")
        if entry["file"] not in files:
            raise ValueError(f"ranks[{index}] refers to unlisted file {entry['file']!r}")
    opt = _typed(m["optimizer"], dict, "'optimizer'")
    _typed(opt["class"], str, "optimizer.class")
    for key in _typed(opt["state_keys"], list, "optimizer.state_keys"):
        _typed(key, str, "an optimizer state key")
    for index, group in enumerate(_typed(opt["param_groups"], list, "optimizer.param_groups")):
        _typed(_typed(group, dict, f"param_groups[{index}]")["hyper"], dict, f"param_groups[{index}].hyper")
        for name in _typed(group["params"], list, f"param_groups[{index}].params"):
            _typed(name, str, f"a parameter name of param_groups[{index}]")
    _int(opt.get("skipped_steps", 0), "optimizer.skipped_steps")
    for key, value in _typed(m["loss_scaler"], dict, "'loss_scaler'").items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
            raise ValueError(f"loss_scaler.{key} is {_short(value)}, not a finite number >= 0")
    _typed(m["extra"], (dict, type(None)), "'extra'")


def _check_param(name: str, p: dict[str, Any], files: dict[str, Any]) -> None:
    numel = _shape(p["shape"], f"parameter {name!r}")
    _typed(p["dtype"], str, f"params[{name!r}].dtype")
    _typed(p["scalars"], dict, f"params[{name!r}].scalars")
    pieces = _typed(p["pieces"], list, f"params[{name!r}].pieces")
    for piece in pieces:
        _typed(piece, dict, f"a piece of {name!r}")
        _int(piece["start"], f"a piece start of {name!r}")
        _int(piece["end"], f"a piece end of {name!r}")
        _int(piece.get("at", 0), f"a piece's 'at' of {name!r}")
        if not isinstance(piece["file"], str) or piece["file"] not in files:
            raise ValueError(f"parameter {name!r} refers to unlisted file {_short(piece['file'])}")
    covered = 0
    for piece in sorted(pieces, key=lambda q: q["start"]):
        if piece["start"] != covered or piece["end"] <= piece["start"]:
            raise ValueError(f"parameter {name!r}: its pieces do not tile [0, {numel}) (gap or overlap at "
                             f"{covered})")
        covered = piece["end"]
    if covered != numel:
        raise ValueError(f"parameter {name!r}: pieces cover {covered} of {numel} elements")


def check_files(directory: Path, manifest: dict[str, Any], names: list[str] | None = None) -> None:
    """Every listed file (or those in ``names``) exists with its recorded size (cheap: stat only)."""
    problems = []
    for name in names if names is not None else manifest["files"]:
        info = manifest["files"][name]
        path = directory / name
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.stat().st_size != info["bytes"]:
            problems.append(f"{path}: {path.stat().st_size} bytes, the manifest records {info['bytes']} "
                            "(truncated or overwritten)")
    if problems:
        raise CheckpointError("checkpoint files are missing or have the wrong size: " + "; ".join(problems))


def check_checksum(directory: Path, manifest: dict[str, Any], name: str) -> None:
    """Raise if file ``name``'s SHA-256 differs from the manifest's."""
    from hfzero.checkpoint.stream import sha256_file

    path = directory / name
    actual = sha256_file(path)
    if actual != manifest["files"][name]["sha256"]:
        raise CheckpointError(f"{path}: checksum mismatch (sha256 {actual[:16]}..., the manifest records "
                              f"{manifest['files'][name]['sha256'][:16]}...); the file is corrupt")


SHAPES_METADATA = "hfzero_shapes"
"""Rank-file metadata key: JSON ``{param: shape}`` of the parameters with a piece in the file."""


def check_header(directory: Path, manifest: dict[str, Any], name: str) -> None:
    """Raise unless safetensors file ``name`` holds every tensor the manifest lists in it, with that shape.

    Reads the header only. Catches what sizes and checksums cannot: a manifest edited to claim other
    pieces or shapes (a parameter shape with the right element count but another layout is checked
    against the shapes the rank file recorded, where it recorded them).
    """
    from hfzero.checkpoint.stream import read_header

    if not name.endswith(".safetensors"):
        return
    path = directory / name
    present, metadata = read_header(path)
    problems = []
    for key, shape in expected_tensors(manifest).get(name, {}).items():
        if key not in present:
            problems.append(f"{key} is absent")
        elif present[key][1] != shape:
            problems.append(f"{key} has shape {present[key][1]}, the manifest implies {shape}")
    try:
        recorded = json.loads(metadata.get(SHAPES_METADATA) or "{}")
        recorded = recorded if isinstance(recorded, dict) else {}
    except json.JSONDecodeError:
        recorded = {}
    for param, shape in recorded.items():
        saved = manifest["params"].get(param)
        if saved is not None and list(saved["shape"]) != shape:
            problems.append(f"parameter {param!r} was saved with shape {shape}, the manifest says {saved['shape']}")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(f"{path} does not match {directory / MANIFEST}: {'; '.join(problems[:3])}{more}; "
                              "the manifest was edited or the file replaced")


def expected_tensors(manifest: dict[str, Any]) -> dict[str, dict[str, tuple[int, ...]]]:
    """file -> {tensor key -> shape} of what the manifest says each file holds."""
    out: dict[str, dict[str, tuple[int, ...]]] = {}
    keys = manifest["optimizer"]["state_keys"]
    for name, p in manifest["params"].items():
        for piece in p["pieces"]:  # a file's tensor of ``name`` ends where its last piece ends (``at``: TP runs)
            mine = out.setdefault(piece["file"], {})
            size = piece.get("at", 0) + piece["end"] - piece["start"]
            for key in [master_key(name)] + [state_key(k, name) for k in keys]:
                mine[key] = (max(size, mine.get(key, (0,))[0]),)
    for name, f in manifest["frozen"].items():
        out.setdefault(f["file"], {})[name] = tuple(f["shape"])
    return out
