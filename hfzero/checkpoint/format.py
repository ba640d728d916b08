"""The on-disk checkpoint format (version 1): file names, the JSON manifest, and its validation.

A checkpoint is a directory (see docs/checkpoints.md)::

    manifest.json                 written last: its presence marks the checkpoint complete
    rank00000-of-00002.safetensors  fp32 master weights and optimizer-state slices, RNG states of rank 0
    rank00001-of-00002.safetensors  ... of rank 1
    frozen.safetensors            frozen parameters and persistent buffers (rank 0), if the model has any
    config.json                   the model's Hugging Face config (rank 0), if it has one
    generation_config.json        likewise

Tensor names inside rank files: ``master/<param>`` and ``state/<key>/<param>`` are 1-D fp32 element
ranges of the flattened parameter (the manifest says which range), ``rng/<source>`` RNG states.
Nothing is pickled: tensors are safetensors, everything else JSON.
"""

from __future__ import annotations

import json
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
    if isinstance(value, list):
        return [decode_value(v) for v in value]
    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(decode_value(v) for v in value["__tuple__"])
        if "__tensor__" in value:
            spec = value["__tensor__"]
            return torch.tensor(spec["value"], dtype=getattr(torch, spec["dtype"])).reshape(spec["shape"])
        return {k: decode_value(v) for k, v in value.items()}
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
        names = sorted(p.name for p in path.iterdir())
        raise CheckpointError(f"{path} is an incomplete checkpoint: it has no {MANIFEST} (written last by "
                              f"save_checkpoint), so the save that produced it did not finish (files present: "
                              f"{names[:6]}{'...' if len(names) > 6 else ''}). Load an earlier checkpoint.")
    if path.exists():
        raise CheckpointError(f"{path} is not a directory; a hfzero checkpoint is a directory with a {MANIFEST}")
    hint = ""
    if partial_dir(path).exists():
        hint = f" An incomplete save was found at {partial_dir(path)} (interrupted before it finished)."
    raise CheckpointError(f"checkpoint directory {path} does not exist.{hint}")


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
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path} is malformed ({type(exc).__name__}: {exc}); the manifest was edited or "
                              "corrupted") from None
    return manifest


def _check_structure(m: dict[str, Any]) -> None:
    files = m["files"]
    for name, info in files.items():
        if "/" in name or name.startswith("."):
            raise ValueError(f"file name {name!r} is not a plain file name")
        int(info["bytes"]), str(info["sha256"])
    for name, p in m["params"].items():
        numel = 1
        for d in p["shape"]:
            numel *= int(d)
        covered = 0
        for piece in sorted(p["pieces"], key=lambda q: q["start"]):
            if piece["file"] not in files:
                raise ValueError(f"parameter {name!r} refers to unlisted file {piece['file']!r}")
            if piece["start"] != covered or piece["end"] <= piece["start"]:
                raise ValueError(f"parameter {name!r}: its pieces do not tile [0, {numel}) (gap or overlap at "
                                 f"{covered})")
            covered = piece["end"]
        if covered != numel:
            raise ValueError(f"parameter {name!r}: pieces cover {covered} of {numel} elements")
    for name, f in m["frozen"].items():
        if f["file"] not in files:
            raise ValueError(f"frozen tensor {name!r} refers to unlisted file {f['file']!r}")
    if len(m["ranks"]) != m["world_size"]:
        raise ValueError(f"{len(m['ranks'])} rank entries for world size {m['world_size']}")
    m["optimizer"]["class"], m["optimizer"]["state_keys"], m["optimizer"]["param_groups"]
    m["loss_scaler"], m["extra"], m["stage"]


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
    """Raise if file ``name``'s SHA-256 differs from the manifest's, or its header lacks a listed tensor."""
    from hfzero.checkpoint.stream import describe, sha256_file

    path = directory / name
    actual = sha256_file(path)
    if actual != manifest["files"][name]["sha256"]:
        raise CheckpointError(f"{path}: checksum mismatch (sha256 {actual[:16]}..., the manifest records "
                              f"{manifest['files'][name]['sha256'][:16]}...); the file is corrupt")
    if name.endswith(".safetensors"):
        present = describe(path)
        missing = [k for k in expected_tensors(manifest).get(name, {}) if k not in present]
        if missing:
            raise CheckpointError(f"{path}: tensors listed in the manifest are absent ({missing[:3]})")


def expected_tensors(manifest: dict[str, Any]) -> dict[str, dict[str, int | None]]:
    """file -> {tensor key -> number of elements (None: any)} that the manifest says each file holds."""
    out: dict[str, dict[str, int | None]] = {}
    keys = manifest["optimizer"]["state_keys"]
    for name, p in manifest["params"].items():
        for piece in p["pieces"]:
            mine = out.setdefault(piece["file"], {})
            mine[master_key(name)] = piece["end"] - piece["start"]
            for key in keys:
                mine[state_key(key, name)] = piece["end"] - piece["start"]
    for name, f in manifest["frozen"].items():
        out.setdefault(f["file"], {})[name] = None
    return out
