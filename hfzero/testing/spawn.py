"""One process-spawning harness for every multi-process test, example check and benchmark.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` spawned processes (fork deadlocks
once torch has started its thread pool), initializes a gloo process group in each, calls
``fn(rank, world_size, *args)`` and returns the list of per-rank results. A failing rank's traceback
is raised in the parent; a run past ``timeout`` is killed and reported instead of hanging.

``run_fake_rank(fn, world_size, *args, rank=0)`` spawns one process that acts as rank ``rank`` of a
world of ``world_size`` on torch's fake process group (backend "fake": every collective returns at once
and moves nothing), for shapes and memory at world sizes this machine cannot spawn; results are
numerically meaningless wherever a collective would have combined ranks.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch


class WorkerFailure(RuntimeError):
    """A spawned rank raised, died or timed out; the message holds its traceback or exit code."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn: Callable[..., Any], rank: int, world_size: int, port: int, backend: str, threads: int,
            results: Any, args: tuple[Any, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    code = 0
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        if backend == "fake":
            # importing it registers the "fake" backend; its store needs no other process
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        else:
            dist.init_process_group(backend, rank=rank, world_size=world_size)
        try:
            out = fn(rank, world_size, *args)
            if dist.is_initialized():
                # The store lives in rank 0's process: a rank that left while another still waited on it (the
                # handshake of a group created last) would reset that rank's connection (seen in CI)
                dist.barrier()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        # Serialized in band with torch.save (torch's queue reducers share tensors through file
        # descriptors that die with this process) and read back with weights_only=True: results are
        # tensors and plain containers, never arbitrary objects.
        buffer = io.BytesIO()
        torch.save(out, buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything to the parent, then exit non-zero
        results.put((rank, "error", traceback.format_exc()))
        code = 1
    results.close()
    results.join_thread()  # flush the result before leaving: os._exit skips the queue's feeder thread
    # Workers may abort in interpreter teardown after destroy_process_group; the result is already
    # reported, so leave without running it (a real failure above still exits 1).
    os._exit(code)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
                    timeout: float = 300.0, threads: int | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return their results by rank.

    ``fn`` and ``args`` must be picklable (module-level functions). Raises WorkerFailure with the
    failing rank's traceback, or with the ranks still running after ``timeout`` seconds.
    """
    if backend == "fake":
        raise ValueError("run_distributed: the fake backend runs one rank per process; use run_fake_rank")
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    return _run(fn, list(range(world_size)), world_size, backend, timeout, threads, args)


def run_fake_rank(fn: Callable[..., Any], world_size: int, *args: Any, rank: int = 0, timeout: float = 300.0,
                  threads: int | None = None) -> Any:
    """Run ``fn(rank, world_size, *args)`` in one spawned process, as rank ``rank`` of a fake world of
    ``world_size`` (torch's fake process group: collectives are no-ops); return its result."""
    if not 0 <= rank < world_size:
        raise ValueError(f"run_fake_rank: rank {rank} is outside a world of {world_size}")
    threads = threads or max(1, os.cpu_count() or 1)
    return _run(fn, [rank], world_size, "fake", timeout, threads, args)[0]


def _run(fn: Callable[..., Any], ranks: list[int], world_size: int, backend: str, timeout: float, threads: int,
         args: tuple[Any, ...]) -> list[Any]:
    """Spawn one process per rank of ``ranks`` and collect their results, in the order of ``ranks``."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = {r: ctx.Process(target=_worker, args=(fn, r, world_size, port, backend, threads, results, args),
                            daemon=True) for r in ranks}
    for p in procs.values():
        p.start()
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) < len(ranks):
            try:
                rank, status, payload = results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in procs.items() if not p.is_alive() and p.exitcode not in (0, None)
                        and r not in outputs]
                if dead:
                    raise WorkerFailure(f"rank(s) {dead} died with exit code(s) "
                                        f"{[procs[r].exitcode for r in dead]} before reporting") from None
                if time.monotonic() > deadline:
                    running = [r for r in ranks if r not in outputs]
                    raise WorkerFailure(f"timed out after {timeout:.0f}s; ranks {running} never finished "
                                        "(a collective mismatch or a hang)") from None
                continue
            if status == "error":
                raise WorkerFailure(f"rank {rank} failed:\n{payload}")
            try:
                outputs[rank] = torch.load(io.BytesIO(payload), weights_only=True)
            except Exception as error:  # noqa: BLE001 - name the contract that was broken
                raise WorkerFailure(f"rank {rank} returned something other than tensors and plain containers "
                                    f"(dict, list, tuple, str, numbers, None): {error}") from None
        return [outputs[r] for r in ranks]
    finally:
        for p in procs.values():
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
