"""One process-spawning harness for every multi-process test, example check and benchmark.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` fresh processes, initializes a gloo process
group in each, calls ``fn(rank, world_size, *args)`` and returns the list of per-rank results. A failing rank's
traceback is raised in the parent; a run past ``timeout`` is killed and reported instead of hanging.

[Note: worker start]
Workers are never forked from the caller (fork deadlocks once torch has started its thread pool, and would hand
each worker the caller's engines, hooks and allocator). Where the platform has it, they come from
multiprocessing's "forkserver": one clean server process, started at the first run, imports torch, transformers
and hfzero's test workloads once (``PRELOAD``) and runs nothing else; each worker is a fork of that idle server,
so it starts with those modules imported instead of importing them itself (a 2-rank start fell from ~9 s to
~0.2 s on a 2-core machine, and the suite spawns a few hundred times). Each worker is still a fresh process: no
state of an earlier worker or of the caller reaches it. The caller's current environment variables, working
directory and ``sys.path`` are applied in the worker before ``fn`` runs, as a spawned process would inherit them;
only what a preloaded module read from the environment at its import is the server's (the caller's environment
when the server started). ``HFZERO_WORKER_START=spawn`` (or a platform without forkserver) starts every worker
with "spawn" instead, each importing everything itself.

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


START_ENV = "HFZERO_WORKER_START"
"""Environment variable: "spawn" makes every worker import everything itself (See [Note: worker start])."""

PRELOAD = ("torch", "torch.distributed", "transformers", "transformers.models.gpt2.modeling_gpt2",
           "transformers.models.llama.modeling_llama", "hfzero.testing.workloads")
"""What the forkserver imports once for every worker (See [Note: worker start]): the modules nearly every worker
needs. A module missing from a torch or transformers version is skipped (multiprocessing ignores it)."""


def start_method() -> str:
    """How workers start: "forkserver" where the platform has it, unless ``HFZERO_WORKER_START`` says "spawn"."""
    chosen = os.environ.get(START_ENV, "")
    if chosen not in ("", "spawn", "forkserver"):
        raise ValueError(f"{START_ENV}={chosen!r}: use 'spawn' or 'forkserver' (or leave it unset)")
    if chosen == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    return "forkserver"


def _context() -> Any:
    method = start_method()
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))  # takes effect when the server starts (the first run)
    return ctx


class WorkerFailure(RuntimeError):
    """A spawned rank raised, died or timed out; the message holds its traceback or exit code."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn: Callable[..., Any], rank: int, world_size: int, port: int, backend: str, threads: int,
            results: Any, args: tuple[Any, ...], environ: dict[str, str]) -> None:
    if os.environ != environ:  # a forkserver's child starts with the server's: See [Note: worker start]
        os.environ.clear()
        os.environ.update(environ)
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
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh ranks; return their results by rank.

    ``fn`` and ``args`` must be picklable (module-level functions). Raises WorkerFailure with the failing ranks'
    tracebacks (See ``_failures``), or with the ranks still running after ``timeout`` seconds.
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


_GRACE_S = 5.0
"""How long a failure waits for the other ranks' reports: a rank that fails first in time may only be reacting to
another's failure (its collective's peer is gone)."""


def _failures(rank: int, payload: str, results: Any, others: int) -> str:
    """Every failing rank's traceback (the first reported, then any other arriving within ``_GRACE_S``)."""
    reports = [f"rank {rank} failed:\n{payload}"]
    deadline = time.monotonic() + _GRACE_S
    while others > 0 and time.monotonic() < deadline:
        try:
            other, status, more = results.get(timeout=0.2)
        except queue.Empty:
            continue
        others -= 1
        if status == "error":
            reports.append(f"rank {other} failed:\n{more}")
    return "\n".join(reports)


def _run(fn: Callable[..., Any], ranks: list[int], world_size: int, backend: str, timeout: float, threads: int,
         args: tuple[Any, ...]) -> list[Any]:
    """Start one process per rank of ``ranks`` and collect their results, in the order of ``ranks``."""
    ctx = _context()
    results = ctx.Queue()
    port = _free_port()
    environ = dict(os.environ)
    procs = {r: ctx.Process(target=_worker, args=(fn, r, world_size, port, backend, threads, results, args, environ),
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
                raise WorkerFailure(_failures(rank, payload, results, len(ranks) - len(outputs) - 1))
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
