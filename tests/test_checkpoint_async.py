"""Asynchronous checkpoint saves (``async_save``) at world 2: the files are a synchronous save's byte for byte
although training changes every saved tensor before the background write starts; resume from them is exact;
the staging buffer is reported (CKPT_STAGING) and reused; a background failure on one rank is raised at the
next save on every rank, and the previous checkpoint in that directory is kept; a load waits for the save.

One spawn of 2 ranks runs every case (spawning is the expensive part). The background write is held back by
a gate (``write_safetensors`` wrapped to wait for an event) until the foreground has trained two more steps,
so a save that wrote the live tensors instead of its staged copies would differ from the synchronous one;
the background's copies of the master and optimizer-state slices start 0.5 s late, so an optimizer step that
did not wait for them would change the slices first and the files would differ too.
"""

from __future__ import annotations

import functools
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import hfzero.checkpoint.save as save_module
import hfzero.checkpoint.staging as staging_module
from hfzero import MemoryRole, ZeroConfig, prepare
from hfzero.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, wait_for_save
from hfzero.testing import run_distributed
from hfzero.testing.models import micro_batches, tiny_causal_lm, token_batches

STEPS, K = 6, 2
CASES = ((2, "fp32", 0), (3, "bf16", 0), (3, "fp32", 100))  # (stage, dtype, param_persistence_threshold)


def _build(stage: int, dtype: str, persist: int, seed: int = 0):
    model = tiny_causal_lm("gpt2", seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    config = ZeroConfig(stage=stage, dtype=dtype, reduce_bucket_size=3000, param_persistence_threshold=persist)
    return prepare(model, opt, config)


def _train(model, opt, batches) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for batch in batches:
        mb = micro_batches(batch, rank, world, 1)[0]
        loss = model(input_ids=mb, labels=mb).loss
        opt.backward(loss)
        opt.step()
        for g in opt.param_groups:
            g["lr"] *= 0.8
        value = loss.detach().float().clone().reshape(1)
        dist.all_reduce(value)
        losses.append(value.item() / world)
    return losses


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _gated_writes():
    """Make the background writes wait for the returned event (the foreground's writes pass at once), and the
    background's deferred copies into the staging buffer start late (so an optimizer step that did not wait
    for them would change the slices before they are copied)."""
    gate = threading.Event()
    original, original_copy = save_module.write_safetensors, staging_module._copy

    def write(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            gate.wait(120)
        return original(*args, **kwargs)

    def copy(pairs):
        if pairs and threading.current_thread() is not threading.main_thread():
            time.sleep(0.5)
        return original_copy(pairs)

    save_module.write_safetensors, staging_module._copy = write, copy

    def restore():
        save_module.write_safetensors, staging_module._copy = original, original_copy
    return gate, restore


def _case(root: Path, stage: int, dtype: str, persist: int) -> dict:
    batches = token_batches(STEPS, 4, 16)
    model, opt = _build(stage, dtype, persist)
    ref = _train(model, opt, batches[:K])
    sync_dir, async_dir = root / f"sync-{stage}-{dtype}-{persist}", root / f"async-{stage}-{dtype}-{persist}"
    save_checkpoint(sync_dir, model, opt, extra={"step": K})
    gate, restore = _gated_writes()
    try:
        save_checkpoint(async_dir, model, opt, extra={"step": K}, async_save=True)
        engine = opt.engine
        staging = engine.checkpoint_staging
        staged_bytes = engine.memory_by_role().get(MemoryRole.CKPT_STAGING, 0)
        ref += _train(model, opt, batches[K:K + 2])  # changes every staged tensor before the write starts
        assert not (async_dir / "manifest.json").exists()
        gate.set()
        wait_for_save()
    finally:
        restore()
    same_files = _files(sync_dir) == _files(async_dir)
    save_checkpoint(root / f"again-{stage}-{dtype}-{persist}", model, opt, async_save=True)
    reused = engine.checkpoint_staging is staging
    ref += _train(model, opt, batches[K + 2:])

    model2, opt2 = _build(stage, dtype, persist, seed=5)
    extra = load_checkpoint(async_dir, model2, opt2)  # also waits for the "again" save
    resumed = _train(model2, opt2, batches[extra["step"]:])
    master = sum(v.numel() * v.element_size() for v in engine.master_views)
    return {"same_files": same_files, "resumed": resumed, "ref": ref[K:], "staged_bytes": staged_bytes,
            "master_bytes": master, "reused": reused}


def _failure(rank: int, root: Path) -> dict:
    """Rank 1's background write fails: the next save raises it on both ranks; the directory keeps the
    previous checkpoint; a load right after an asynchronous save of the same directory waits for it."""
    model, opt = _build(2, "fp32", 0)
    batches = token_batches(4, 4, 16)
    _train(model, opt, batches[:1])
    ckpt = root / "failing"
    save_checkpoint(ckpt, model, opt, extra={"step": 1}, async_save=True)
    _train(model, opt, batches[1:2])
    wait_for_save()  # the first save is written (and succeeded) before the failure is injected
    original = save_module.write_safetensors
    if rank == 1:  # the next write fails, whenever the background thread gets to it; later ones work
        failed: list[int] = []

        def fail_once(*args, **kwargs):
            if not failed:
                failed.append(1)
                raise OSError("No space left on device (injected)")
            return original(*args, **kwargs)
        save_module.write_safetensors = fail_once
    save_checkpoint(ckpt, model, opt, extra={"step": 2}, async_save=True)
    _train(model, opt, batches[2:3])
    message = None
    try:
        save_checkpoint(root / "next", model, opt, async_save=True)
    except CheckpointError as exc:
        message = str(exc)
    save_module.write_safetensors = original
    after = save_checkpoint(root / "next", model, opt, async_save=True)  # the failure was raised once
    extra = load_checkpoint(after, *_build(2, "fp32", 0, seed=3))  # waits for that save
    kept = load_checkpoint(ckpt, *_build(2, "fp32", 0, seed=3))
    return {"message": message, "kept": kept, "extra_next": extra}


def _everything(rank: int, world: int, root: str) -> dict:
    root = Path(root)
    out = {f"{s}-{d}-{p}": _case(root, s, d, p) for s, d, p in CASES}
    out["failure"] = _failure(rank, root)
    return out


@functools.lru_cache(maxsize=None)
def results() -> list[dict]:
    return run_distributed(_everything, 2, tempfile.mkdtemp(prefix="hfzero-async-"), timeout=300)


@pytest.mark.parametrize("case", [f"{s}-{d}-{p}" for s, d, p in CASES])
def test_async_save_equals_sync_and_resumes_exactly(case):
    for rank, r in enumerate(results()):
        r = r[case]
        assert r["same_files"], f"rank {rank}: the asynchronous checkpoint's files differ from the synchronous one's"
        assert r["resumed"] == r["ref"], f"rank {rank}: losses after resume differ: {r['resumed']} vs {r['ref']}"
        # the staging buffer holds the rank's master and optimizer-state slices (AdamW: 3 x master) + RNG
        assert r["staged_bytes"] >= 3 * r["master_bytes"] > 0, (rank, r["staged_bytes"], r["master_bytes"])
        assert r["reused"], f"rank {rank}: the next asynchronous save allocated a new staging buffer"


def test_background_failure_raised_on_every_rank():
    for rank, r in enumerate(results()):
        r = r["failure"]
        assert r["message"] is not None, f"rank {rank}: the failed background save was not reported"
        assert "rank 1" in r["message"] and "No space left on device (injected)" in r["message"], r["message"]
        assert r["kept"] == {"step": 1}, f"rank {rank}: the previous checkpoint was not kept"
        assert r["extra_next"] is None
