"""Fuzz the file readers (issue 15): seeded mutations of a valid profile run, checkpoint manifest and
rank-file safetensors header. Every outcome must be a successful read or the library's own error
type with a message; never a hang (a per-case time limit), another exception type, or a changed
input file. Single process, no spawn; 240 cases per reader."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from fuzzing import mutate_bytes, mutate_json, mutate_json_lines, mutate_text_json, time_limit
from hfzero.checkpoint import CheckpointError, consolidate, load_checkpoint, save_checkpoint
from hfzero.profiler.reader import ProfileFormatError, load_run, summarize
from test_checkpoint_kill import build, data, train
from test_dashboard import write_run

CASES = 240
LIMIT_S = 10.0
RANK_FILE = "rank00000-of-00001.safetensors"


def _hashes(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir()) if p.is_file()}


def _fuzz(seed: int, base: Path, work: Path, mutate: Callable[[Path, random.Random], None],
          read: Callable[[Path], None], errors: tuple[type[BaseException], ...]) -> dict[str, int]:
    """Run CASES mutations of a copy of ``base``; return how many were read and how many refused."""
    rng = random.Random(seed)
    outcome = {"read": 0, "refused": 0}
    for case in range(CASES):
        target = work / f"case{case}"
        shutil.copytree(base, target)
        mutate(target, rng)
        before = _hashes(target)
        try:
            with time_limit(LIMIT_S):
                read(target)
            outcome["read"] += 1
        except errors as err:
            assert str(err).strip(), f"case {case}: an empty message"
            outcome["refused"] += 1
        # any other exception (or Hang) fails the test here, naming the case through the traceback
        assert _hashes(target) == before, f"case {case}: the reader changed its input"
        shutil.rmtree(target)
    return outcome


# ---- profile run -----------------------------------------------------------------------------------
def _mutate_profile(run: Path, rng: random.Random) -> None:
    files = sorted(run.iterdir())
    file = rng.choice(files)
    raw = file.read_bytes()
    file.write_bytes(mutate_text_json(raw, rng) if file.name == "header.json" else mutate_json_lines(raw, rng))


def _read_profile(run: Path) -> None:
    summarize(load_run(run))


def test_fuzz_profile_reader(tmp_path: Path) -> None:
    base = write_run(tmp_path / "base", steps=2)
    outcome = _fuzz(15, base, tmp_path, _mutate_profile, _read_profile, (ProfileFormatError,))
    assert outcome["read"] and outcome["refused"], outcome


# ---- checkpoint manifest and shard header ------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, opt = build()
    train(model, opt, data()[:2])
    return save_checkpoint(tmp_path_factory.mktemp("fuzz") / "ckpt", model, opt, extra={"step": 2})


def _read_checkpoint(verify: bool) -> Callable[[Path], None]:
    model, opt = build(seed=3)  # one pair for all cases: a refused load leaves it untouched

    def read(path: Path) -> None:
        out = path.parent / f"{path.name}-hf"
        try:
            load_checkpoint(path, model, opt, verify=verify)
            consolidate(path, out, verify=verify)
        finally:
            assert not list(path.parent.glob(".*.partial")), "an export left its .partial behind"
            shutil.rmtree(out, ignore_errors=True)
    return read


def _mutate_manifest(path: Path, rng: random.Random) -> None:
    manifest = path / "manifest.json"
    manifest.write_bytes(mutate_text_json(manifest.read_bytes(), rng))


def _mutate_shard_header(path: Path, rng: random.Random) -> None:
    """The rank file's 8-byte length and JSON header, mutated structurally or byte-wise (data kept), and
    its size in the manifest updated, so the header itself is what the readers meet."""
    file = path / RANK_FILE
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    if rng.random() < 0.5:
        file.write_bytes(mutate_bytes(raw, rng, limit=8 + length))
    else:
        header = json.dumps(mutate_json(json.loads(raw[8:8 + length]), rng)).encode()
        file.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + length:])
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][RANK_FILE]["bytes"] = file.stat().st_size
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("mutate, verify, seed", [(_mutate_manifest, True, 7), (_mutate_shard_header, False, 8)],
                         ids=["manifest", "shard-header"])
def test_fuzz_checkpoint_readers(checkpoint: Path, tmp_path: Path, mutate, verify: bool, seed: int) -> None:
    outcome = _fuzz(seed, checkpoint, tmp_path, mutate, _read_checkpoint(verify), (CheckpointError,))
    assert outcome["refused"], outcome
