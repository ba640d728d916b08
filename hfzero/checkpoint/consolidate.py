"""Export a checkpoint (any world size and stage) as a Hugging Face model directory.

Streams tensor by tensor: each full parameter is assembled from the ranks' saved pieces, cast,
written to its output shard and dropped before the next, so resident memory is about the largest
tensor (its fp32 assembly and one saved piece, plus a cast copy when ``dtype`` differs), not the
model. Needs no
torch.distributed and no model instance.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from hfzero.checkpoint import format as fmt
from hfzero.checkpoint.errors import CheckpointError
from hfzero.checkpoint.save import swap_into_place
from hfzero.checkpoint.stream import (TensorEntry, dtype_from_name, dtype_name, fsync_dir, read_range, read_tensor,
                                      write_bytes_durably, write_safetensors)
from hfzero.logging import get_logger

logger = get_logger(__name__)

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """``5_000_000``, ``"5GB"`` (10^9) or ``"5GiB"`` (2^30) -> bytes, as ``save_pretrained`` reads them."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size).upper())
        if not match:
            raise CheckpointError(f"max_shard_size {size!r} is not a size; use bytes or e.g. '500MB', '5GB', '2GiB'")
        value = int(float(match.group(1)) * _UNITS[match.group(2) or ""])
    if value <= 0:
        raise CheckpointError(f"max_shard_size must be positive, got {size!r}")
    return value


@dataclasses.dataclass(frozen=True)
class ConsolidateResult:
    """What ``consolidate`` wrote.

    Attributes:
        out_dir: the Hugging Face model directory.
        files: weight files written (one, or several plus ``model.safetensors.index.json``).
        total_bytes: bytes of tensor data.
        tensors: number of tensors written (tied duplicates are not written).
        has_config: whether ``config.json`` was written (``from_pretrained`` needs it).
    """

    out_dir: Path
    files: list[str]
    total_bytes: int
    tensors: int
    has_config: bool

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "out_dir": str(self.out_dir)}


@dataclasses.dataclass(frozen=True)
class _Source:
    name: str  # name in the checkpoint
    out_name: str  # name written (a tied alias the model does not re-tie, where the canonical one is re-tied)
    entry: TensorEntry


def _plan(manifest: dict[str, Any], dtype: torch.dtype | None) -> list[_Source]:
    aliases_of: dict[str, list[str]] = {}
    for alias, canonical in manifest["aliases"].items():
        aliases_of.setdefault(canonical, []).append(alias)
    targets = set(manifest["tied_targets"])
    out = []
    for name in manifest["order"]:
        if name in manifest["params"]:
            info, is_param = manifest["params"][name], True
        elif name in manifest["frozen"]:
            info = manifest["frozen"][name]
            is_param = info["kind"] == "parameter"
        else:
            raise CheckpointError(f"manifest lists {name!r} in 'order' but holds no data for it")
        saved = dtype_from_name(info["dtype"])
        target = dtype if dtype is not None and is_param and saved.is_floating_point else saved
        out_name = name
        if name in targets:  # the model re-ties this name on load: write the tensor under its source name
            out_name = next((a for a in aliases_of.get(name, []) if a not in targets), name)
        out.append(_Source(name, out_name, TensorEntry(out_name, target, tuple(info["shape"]))))
    return out


def _shards(sources: list[_Source], limit: int) -> list[list[_Source]]:
    shards: list[list[_Source]] = [[]]
    size = 0
    for source in sources:
        if shards[-1] and size + source.entry.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(source)
        size += source.entry.nbytes
    return shards


def _tensors(directory: Path, manifest: dict[str, Any], shard: list[_Source]) -> Iterator[torch.Tensor]:
    """Each tensor of ``shard`` in full, assembled from its pieces one at a time."""
    master = dtype_from_name(manifest["master_dtype"])
    for source in shard:
        if source.name in manifest["params"]:
            pieces = manifest["params"][source.name]["pieces"]
            key = fmt.master_key(source.name)
            if len(pieces) == 1 and not pieces[0].get("at"):  # saved whole by one rank: no assembly buffer
                full = read_tensor(directory / pieces[0]["file"], key)
            else:
                full = torch.empty(math.prod(source.entry.shape), dtype=master)  # (numel,) fp32
                for piece in pieces:  # a piece's data starts at its ``at`` in the file's tensor (TP runs)
                    at = piece.get("at", 0)
                    full[piece["start"]: piece["end"]] = read_range(directory / piece["file"], key, at,
                                                                    at + piece["end"] - piece["start"])
            tensor = full.view(source.entry.shape)
        else:
            tensor = read_tensor(directory / manifest["frozen"][source.name]["file"], source.name)
        yield tensor.to(source.entry.dtype)
        del tensor


def _write_config(src: Path, dst: Path, dtype: torch.dtype | None, sources: list[_Source]) -> None:
    try:
        config = json.loads(src.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{src} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{src} is not a JSON object (a model config)")
    floats = [s.entry.dtype for s in sources if s.entry.dtype.is_floating_point]
    chosen = dtype or (max(set(floats), key=floats.count) if floats else None)
    if chosen is not None:
        key = "torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"
        config[key] = dtype_name(chosen)
    write_bytes_durably(dst, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())


def consolidate(ckpt_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
                max_shard_size: int | str = "5GB", dtype: str | torch.dtype | None = None, verify: bool = True,
                overwrite: bool = False) -> ConsolidateResult:
    """Write ``out_dir``: ``config.json`` + safetensors weights that ``from_pretrained`` loads.

    Weights above ``max_shard_size`` are split into ``model-0000i-of-0000n.safetensors`` files with a
    ``model.safetensors.index.json``; a tied weight is written once, under the name the model does
    not re-tie on load. ``dtype`` (e.g. "bfloat16") casts floating-point parameters; by default each
    is written in the dtype it trained in (fp32 masters are cast back to it). ``verify`` checks all
    checksums first. The directory appears atomically (written next to it, then renamed). An
    ``out_dir`` that is, holds or lies inside the checkpoint is refused (the input is never replaced);
    every failure is a CheckpointError and leaves no partial output.
    Resident memory: two to three times the largest tensor (see module docstring), whatever the model size.
    """
    out_dir = Path(out_dir).absolute()
    try:
        source_dir, manifest = _read_checkpoint(Path(ckpt_dir).absolute(), out_dir, verify)
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {ckpt_dir}: {exc.strerror or exc} ({type(exc).__name__})") \
            from None
    target = None if dtype is None else (dtype if isinstance(dtype, torch.dtype) else dtype_from_name(str(dtype)))
    sources = _plan(manifest, target)
    shards = _shards(sources, parse_size(max_shard_size))
    tmp = fmt.partial_dir(out_dir)
    try:
        if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not overwrite:
            raise CheckpointError(f"{out_dir} exists and is not empty; choose a new directory or pass "
                                  "overwrite=True (--overwrite)")
        names, total, has_config = _write(tmp, source_dir, manifest, sources, shards, target)
        swap_into_place(tmp, out_dir)
    except OSError as exc:
        raise CheckpointError(f"cannot write {out_dir}: {exc.strerror or exc} ({type(exc).__name__}); choose a "
                              "directory you can write to") from None
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("wrote %s: %d tensors, %d bytes in %d file(s)", out_dir, len(sources), total, len(names))
    return ConsolidateResult(out_dir, names, total, len(sources), has_config)


def _read_checkpoint(ckpt_dir: Path, out_dir: Path, verify: bool) -> tuple[Path, dict[str, Any]]:
    """Resolve and validate the checkpoint (manifest, sizes, headers, checksums); refuse an overlapping output."""
    source_dir, warning = fmt.resolve(ckpt_dir)
    if warning:
        logger.warning(warning)
    _refuse_overlap(ckpt_dir, source_dir, out_dir)
    manifest = fmt.read_manifest(source_dir)
    fmt.check_files(source_dir, manifest)
    for name in sorted(manifest["files"]):
        if verify:
            fmt.check_checksum(source_dir, manifest, name)
        fmt.check_header(source_dir, manifest, name)
    return source_dir, manifest


def _refuse_overlap(given: Path, source: Path, out_dir: Path) -> None:
    """Refuse an output that is, holds, or lies inside the checkpoint: replacing it would delete the input.

    Paths are compared resolved (symlinks followed); the directories an export renames through
    (``.OUT.partial``, ``.OUT.previous``) count as the output too.
    """
    outs = [os.path.realpath(p) for p in (out_dir, fmt.partial_dir(out_dir), fmt.previous_dir(out_dir))]
    for src in {os.path.realpath(given), os.path.realpath(source)}:
        for out in outs:
            if out == src or _inside(out, src) or _inside(src, out):
                raise CheckpointError(f"the output {out_dir} overlaps the checkpoint {source} (one is, holds or "
                                      "lies inside the other); writing it would delete the checkpoint. Choose an "
                                      "output directory outside the checkpoint")


def _inside(path: str, parent: str) -> bool:
    return os.path.commonpath([path, parent]) == parent and path != parent


def _write(tmp: Path, source_dir: Path, manifest: dict[str, Any], sources: list[_Source],
           shards: list[list[_Source]], target: torch.dtype | None) -> tuple[list[str], int, bool]:
    """Write the whole export into ``tmp``; return (weight files, tensor bytes, whether config.json was written)."""
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    names = [WEIGHTS_NAME] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        write_safetensors(tmp / name, [s.entry for s in shard], _tensors(source_dir, manifest, shard),
                          metadata={"format": "pt"})
    total = sum(s.entry.nbytes for s in sources)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {s.out_name: name for name, shard in zip(names, shards) for s in shard}}
        write_bytes_durably(tmp / INDEX_NAME, (json.dumps(index, indent=2) + "\n").encode())
    has_config = fmt.CONFIG_FILE in manifest["files"]
    if has_config:
        _write_config(source_dir / fmt.CONFIG_FILE, tmp / fmt.CONFIG_FILE, target, sources)
    else:
        logger.warning("%s has no config.json (the model had no HF config); from_pretrained needs one", source_dir)
    if fmt.GENERATION_CONFIG_FILE in manifest["files"]:
        shutil.copyfile(source_dir / fmt.GENERATION_CONFIG_FILE, tmp / fmt.GENERATION_CONFIG_FILE)
    fsync_dir(tmp)
    return names, total, has_config
