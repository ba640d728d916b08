"""Checkpoints on node-local storage: no file system every rank sees.

[Note: node-local checkpoints]
``save_checkpoint`` needs ``DIR`` on a file system all ranks share (rank 0 creates ``.DIR.partial``,
every rank writes into it, rank 0 writes the manifest). ``save_checkpoint_node_local`` /
``load_checkpoint_node_local`` take the same arguments for ranks that each see their own ``DIR``
(a node's local disk; the path is usually the same string on every node, and may differ):
- storage groups: every rank creates ``.DIR.probe-<nonce>/rank<r>`` next to ``DIR`` and checks by
  name which ranks' files it sees. Ranks that see each other form a group (normally a node); groups
  must be consistent (r sees s iff s sees r), else CheckpointError. One group (a shared file system)
  means these functions are exactly ``save_checkpoint`` / ``load_checkpoint``.
- save: each group's lowest rank (its leader) prepares its own ``.DIR.partial``; ``save_checkpoint``
  then runs unchanged, so every rank writes its rank file where it stands, and rank 0 completes and
  swaps in its node's ``DIR``. Rank 0's manifest and model config files are then broadcast to the
  other leaders, each of which writes them (the manifest last, fsynced) and swaps its own ``DIR`` in,
  as in [Note: atomic checkpoint]. Each node ends up with its own ranks' rank files, the manifest and
  the configs; frozen tensors stay on the node of the rank that wrote them. All nodes' manifests are
  the same bytes.
- load: the leaders report which of the manifest's files their node holds (and the manifest's
  SHA-256: nodes holding different checkpoints under ``DIR`` are refused, naming them). A file held
  by no node is a CheckpointError naming each missing file and what every node holds. Otherwise
  every file a node lacks is broadcast from a node holding it (in 16 MiB chunks, one resident at a
  time) into that node's ``DIR``; ``load_checkpoint`` then validates and loads as usual (checksums
  included, so a corrupted transfer is caught), and the fetched files are deleted again. Every rank
  decides the transfers from the same gathered lists, so all ranks run the same collectives.
A crash between nodes' swaps can leave nodes with different steps under one ``DIR``: the load then
refuses (different manifests); Trainer checkpoints use one ``checkpoint-N`` per step, so a resume
simply picks the newest step complete on every node (hfzero/integrations/resume.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch

from hfzero.checkpoint import format as fmt
from hfzero.checkpoint.common import agree, gather_json, guard, scope_of
from hfzero.checkpoint.errors import CheckpointError
from hfzero.checkpoint.load import load_checkpoint
from hfzero.checkpoint.save import _prepare_dir, save_checkpoint, swap_into_place
from hfzero.checkpoint.stream import fsync_dir, write_bytes_durably
from hfzero.comm.collectives import Communicator
from hfzero.logging import get_logger
from hfzero.runtime.optimizer import ZeroOptimizer

logger = get_logger(__name__)

_STEP = "node-local checkpoint step"
"""What ``guard`` logs as failing."""

CHUNK_BYTES = 1 << 24
"""Bytes per broadcast when a file moves between nodes (the resident buffer on every rank)."""


def storage_groups(comm: Communicator, rank: int, directory: Path) -> list[list[int]]:
    """The groups of ranks that see the same ``directory.parent`` (see [Note: node-local checkpoints])."""
    nonce = json.loads(comm.all_gather_bytes(json.dumps(secrets.token_hex(8) if rank == 0 else "").encode())[0])
    probe = directory.parent / f".{directory.name}.probe-{nonce}"
    error = guard(lambda: (probe.mkdir(parents=True, exist_ok=True), (probe / f"rank{rank}").touch()), _STEP)
    agree(comm, error, f"checking which ranks share {directory.parent}")
    seen = [r for r in range(comm.world_size) if (probe / f"rank{r}").exists()]  # by name: no stale listing
    gathered = gather_json(comm, seen)
    if rank == seen[0]:
        shutil.rmtree(probe, ignore_errors=True)  # every rank of the group has looked (gather_json above)
    for r, group in enumerate(gathered):
        if r not in group or any(gathered[s] != group for s in group):
            raise CheckpointError(f"ranks disagree about who shares {directory.parent}: rank {r} sees the files of "
                                  f"ranks {group}, and they see {[gathered[s] for s in group]}; each directory must "
                                  "be on one file system shared by a fixed set of ranks")
    return sorted({tuple(g): list(g) for g in gathered}.values())


def _storage(directory: str | os.PathLike[str], model: Any,
             optimizer: ZeroOptimizer) -> tuple[Communicator, int, Path, list[list[int]]]:
    """The checkpoint scope's communicator and rank, ``directory`` made absolute, and its storage groups
    (``storage_groups``; a collective)."""
    scope = scope_of(model, optimizer)[1]
    path = Path(directory).absolute()
    return scope.comm, scope.rank, path, storage_groups(scope.comm, scope.rank, path)


def save_checkpoint_node_local(directory: str | os.PathLike[str], model: Any, optimizer: ZeroOptimizer, *,
                               extra: dict[str, Any] | None = None) -> Path:
    """``save_checkpoint`` for ranks without a shared file system: each node writes its own ranks' files
    into its own ``directory`` (see [Note: node-local checkpoints]). A collective. Returns ``directory``."""
    comm, rank, directory, groups = _storage(directory, model, optimizer)
    if len(groups) == 1:
        return save_checkpoint(directory, model, optimizer, extra=extra)
    group = next(g for g in groups if rank in g)
    tmp = fmt.partial_dir(directory)
    error = guard(lambda: _prepare_dir(directory, tmp), _STEP) if rank == group[0] and 0 not in group else None
    agree(comm, error, f"save_checkpoint_node_local({directory}): preparing {tmp} on every node")
    # synchronous whatever ZeroConfig.async_save says: the other nodes' copies are made from rank 0's
    # finished files right after (asynchronous node-local saves are not built)
    save_checkpoint(directory, model, optimizer, extra=extra, async_save=False)  # rank 0's node is complete after this
    names = [fmt.MANIFEST]
    if rank == 0:
        manifest = json.loads((directory / fmt.MANIFEST).read_text())
        names += [n for n in (fmt.CONFIG_FILE, fmt.GENERATION_CONFIG_FILE) if n in manifest["files"]]
    names = json.loads(comm.all_gather_bytes(json.dumps(names).encode())[0])
    sizes = json.loads(comm.all_gather_bytes(json.dumps(
        [(directory / n).stat().st_size for n in names] if rank == 0 else []).encode())[0])
    leaders = {g[0]: tmp for g in groups if 0 not in g}
    errors = [_transfer(comm, rank, name, size, 0, directory, leaders) for name, size in zip(names[::-1], sizes[::-1])]
    error = next((e for e in errors if e), None)  # the configs first, the manifest last (reversed order)
    if error is None and rank in leaders:
        error = guard(lambda: (fsync_dir(tmp), swap_into_place(tmp, directory)), _STEP)
    agree(comm, error, f"save_checkpoint_node_local({directory}): completing the other nodes' copies")
    logger.info("saved node-local checkpoint %s on %d storage groups %s", directory, len(groups), groups)
    return directory


def load_checkpoint_node_local(directory: str | os.PathLike[str], model: Any, optimizer: ZeroOptimizer, *,
                               verify: bool = True) -> dict[str, Any] | None:
    """``load_checkpoint`` from node-local copies: files a node lacks are fetched from a node holding them
    first, and deleted after the load (see [Note: node-local checkpoints]). A collective; returns ``extra``."""
    comm, rank, directory, groups = _storage(directory, model, optimizer)
    if len(groups) == 1:
        return load_checkpoint(directory, model, optimizer, verify=verify)
    group = next(g for g in groups if rank in g)
    report = _holdings(directory) if rank == group[0] else None
    gathered = gather_json(comm, report)
    reports = {g[0]: gathered[g[0]] for g in groups}
    _check_holdings(directory, groups, reports)
    files = reports[0]["files"]
    fetched: list[Path] = []
    errors = []
    for name in sorted(files):
        holder = min(leader for leader, r in reports.items() if name in r["held"])
        lacking = {leader: Path(r["dir"]) for leader, r in reports.items() if name not in r["held"]}
        if lacking:
            errors.append(_transfer(comm, rank, name, files[name], holder, Path(reports[holder]["dir"]), lacking))
            if rank in lacking:
                fetched.append(lacking[rank] / name)
    agree(comm, next((e for e in errors if e), None), f"load_checkpoint_node_local({directory}): fetching files "
                                                     "between nodes")
    if fetched:
        logger.info("fetched %d checkpoint file(s) from other nodes into %s", len(fetched), fetched[0].parent)
    try:
        return load_checkpoint(directory, model, optimizer, verify=verify)
    finally:
        for path in fetched:
            path.unlink(missing_ok=True)


def _holdings(directory: Path) -> dict[str, Any]:
    """A leader's report: its resolved directory, the manifest's files and digest, and which it holds."""
    try:
        resolved, warning = fmt.resolve(directory)
        if warning:
            logger.warning(warning)
        raw = (resolved / fmt.MANIFEST).read_bytes()
        files = {n: int(info["bytes"]) for n, info in json.loads(raw)["files"].items()}
    except (CheckpointError, OSError, ValueError, KeyError, TypeError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    held = sorted(n for n, size in files.items() if (resolved / n).is_file() and (resolved / n).stat().st_size == size)
    return {"error": None, "dir": str(resolved), "sha256": hashlib.sha256(raw).hexdigest(), "files": files,
            "held": held}


def _check_holdings(directory: Path, groups: list[list[int]], reports: dict[int, Any]) -> None:
    """Raise (on every rank: ``reports`` is the same everywhere) unless the nodes together hold one checkpoint."""
    where = {g[0]: f"node of ranks {g}" for g in groups}
    failed = [f"{where[leader]}: {r['error']}" for leader, r in reports.items() if r["error"]]
    if failed:
        raise CheckpointError(f"load_checkpoint_node_local({directory}): {'; '.join(failed)}")
    digests = {r["sha256"] for r in reports.values()}
    if len(digests) > 1:
        listing = "; ".join(f"{where[leader]}: manifest sha256 {r['sha256'][:12]}" for leader, r in reports.items())
        raise CheckpointError(f"load_checkpoint_node_local({directory}): the nodes hold different checkpoints under "
                              f"this name ({listing}); a save was interrupted between nodes. Load another checkpoint")
    files = reports[groups[0][0]]["files"]
    nowhere = sorted(n for n in files if not any(n in r["held"] for r in reports.values()))
    if nowhere:
        held = "; ".join(f"{where[leader]} holds {', '.join(r['held'])}" for leader, r in reports.items())
        raise CheckpointError(f"load_checkpoint_node_local({directory}): {', '.join(nowhere)} missing on every node "
                              f"(or of the wrong size) ({held}). Restore the missing files into {directory.name} on "
                              "any node, or load another checkpoint")


def _transfer(comm: Communicator, rank: int, name: str, size: int, source: int, source_dir: Path,
              receivers: dict[int, Path]) -> str | None:
    """Broadcast file ``name`` (``size`` bytes) from rank ``source`` (in ``source_dir``) to every rank; each rank
    in ``receivers`` writes it into its directory (temp name, fsync, rename). Every rank calls it; returns
    this rank's error (None if fine), reported later with ``agree`` so the broadcasts stay in step."""
    error = None
    reader = writer = None
    target = receivers.get(rank)
    try:
        if rank == source:
            reader = open(source_dir / name, "rb")
        if target is not None:
            writer = open(target / f".{name}.fetching", "wb")
    except OSError as exc:
        error = f"{name}: {exc}"
    done = 0
    while done < size:
        n = min(CHUNK_BYTES, size - done)
        buffer = torch.zeros(n, dtype=torch.uint8)
        if reader is not None and error is None:
            try:
                data = reader.read(n)
                buffer[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            except OSError as exc:
                error = f"reading {source_dir / name}: {exc}"
        device_buffer = buffer.to(comm.device)
        comm.broadcast(device_buffer, src_rank=source)
        if writer is not None and error is None:
            try:
                writer.write(device_buffer.cpu().numpy().tobytes())
            except OSError as exc:
                error = f"writing {target / name}: {exc}"
        done += n
    for handle in (reader, writer):
        if handle is not None:
            if handle is writer and error is None:
                handle.flush()
                os.fsync(handle.fileno())
            handle.close()
    if writer is not None and error is None:
        os.rename(target / f".{name}.fetching", target / name)
    return error
