"""Issue 19 items 4, 5, 9 and 12 on a GPU: exact-size registered pinned memory, the offload's copies and
folds on their stream and thread, CPU checkpoints copied beside compute with a prefetch, and CUDA-event
timings resolved lazily (timer, profiler, NCCL collectives). Runnable on one H100: one process for most,
NCCL world 1 for the profiler; the NCCL world-2 test skips with one GPU. The CPU semantics of the same
code are in tests/test_streams.py and tests/test_timing.py."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from torch import nn

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device (page-locked memory, side streams, CUDA events); the CPU "
                              "paths are tested in tests/test_streams.py and tests/test_timing.py"),
]


def test_pinned_empty_is_registered_at_exact_size_and_copies_asynchronously():
    from hfzero.runtime.streams import PAGE, pinned_empty, pinned_nbytes

    numel = 3 * 2**20 + 5  # 12 MiB + 20 bytes: the caching host allocator would lock 16 MiB
    host = pinned_empty(numel, torch.float32, pin=True)
    assert host.is_pinned() and pinned_nbytes(numel, torch.float32) == -(-numel * 4 // PAGE) * PAGE
    host.copy_(torch.arange(numel, dtype=torch.float32))
    device = torch.empty(numel, device="cuda")
    device.copy_(host, non_blocking=True)
    back = pinned_empty(numel, torch.float32, pin=True)
    back.copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, host)
    del host, back  # unregistered with the last view; registering new pages must still work
    assert pinned_empty(1024, torch.float32, pin=True).is_pinned()


def test_offload_folds_gradients_copied_on_the_copy_stream():
    from hfzero.runtime.layout import FlatLayout
    from hfzero.runtime.offload import HostOffload
    from hfzero.runtime.streams import pinned_nbytes

    params = [(i, f"p{i}", nn.Parameter(torch.zeros(4096, device="cuda"))) for i in range(3)]
    layout = FlatLayout([params], 4096, 1, 0)
    offload = HostOffload(layout, torch.device("cuda"), torch.bfloat16, accumulate=True)
    assert offload.copy_stream is not None and offload.staging.is_pinned() and not offload.grad.is_pinned()
    assert offload.pinned_bytes() == pinned_nbytes(offload.staging.numel(), torch.bfloat16)  # staging alone
    for value in (1.0, 2.0):
        for bucket in layout.buckets:
            reduced = torch.full((bucket.chunk,), value * (bucket.index + 1), dtype=torch.bfloat16, device="cuda")
            torch.cuda._sleep(1_000_000)  # the copy waits for this compute-stream work, the host does not
            offload.order_after(offload.push(bucket, reduced))
            del reduced  # record_stream keeps its block from reuse until the copy is done
    offload.drain()
    assert offload.fold_order == [0, 1, 2, 0, 1, 2]
    for bucket in layout.buckets:
        assert torch.equal(offload.gradient(bucket), torch.full((bucket.chunk,), 3.0 * (bucket.index + 1)))


def test_cpu_checkpoints_on_cuda_are_exact_prefetched_and_pinned():
    from hfzero.runtime.activations.checkpoint import CheckpointPolicy, enable_checkpointing
    from hfzero.runtime.streams import pinned_nbytes
    from hfzero.testing.models import tiny_causal_lm

    grads, checkpoints = [], []
    for cpu in (False, True):
        torch.manual_seed(0)
        model = tiny_causal_lm("gpt2", hidden=64, layers=3, vocab=128).cuda().train()
        checkpoint = enable_checkpointing(model, CheckpointPolicy(cpu=cpu))
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        ids = torch.randint(0, 128, (2, 32), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        for _ in range(2):
            model.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        checkpoints.append(checkpoint)
    for name, grad in grads[0].items():
        assert torch.equal(grads[1][name], grad), name
    hosted = checkpoints[1]
    assert hosted.prefetches == 2 * 2 and all(b.is_pinned() for b in hosted._host_buffers)
    assert hosted.pinned_bytes() == sum(pinned_nbytes(b.numel(), b.dtype) for b in hosted._host_buffers) > 0


def test_event_timer_resolves_lazily_with_device_time():
    from hfzero.comm.timing import DeviceTimer

    timer = DeviceTimer("cuda")
    got = []
    start = timer.mark()
    torch.cuda._sleep(50_000_000)  # tens of milliseconds of device time, launched in microseconds
    timer.interval(start, timer.mark(), got.append)
    assert timer.kind == "cuda_event" and timer.pending == 1 and got == []
    timer.settle(wait=True)
    assert timer.pending == 0 and got[0] > 0.001


def _profiled_on_cuda(rank: int, world: int, run_dir: str) -> dict:
    import hfzero
    from hfzero.profiler import ZeroProfiler
    from hfzero.testing.models import tiny_causal_lm, token_batches

    torch.cuda.set_device(rank)
    model = tiny_causal_lm("gpt2").cuda()
    model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      hfzero.ZeroConfig(stage=2, reduce_bucket_size=4096))
    engine = hfzero.get_engine(model)
    with ZeroProfiler(model, optimizer, run_dir) as profiler:
        for batch in token_batches(2, 8, 16):
            mine = batch.chunk(world)[rank].cuda()
            optimizer.backward(model(input_ids=mine, labels=mine).loss)
            optimizer.step()
            optimizer.zero_grad()
        pending = profiler._timer.pending
    return {"timing": engine.comm.timing, "pending": pending}


@pytest.mark.parametrize("world", [1, 2])
def test_profiler_on_nccl_reads_event_times_at_the_step(world):
    from hfzero.profiler.reader import load_run
    from hfzero.testing import run_distributed

    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices, {torch.cuda.device_count()} present")
    with tempfile.TemporaryDirectory() as run_dir:
        results = run_distributed(_profiled_on_cuda, world, run_dir, backend="nccl", timeout=600)
        run = load_run(run_dir)
        assert run.header["comm_timing"] == "cuda_event"
        for result, log in zip(results, run.ranks.values()):
            assert result == {"timing": "cuda_event", "pending": 0}
            for step in log.of_kind("step"):
                assert all(seconds > 0 for seconds in step["phase_seconds"].values())
                if world > 1:  # a world of one moves and counts nothing
                    assert all(stats["seconds"] > 0 for stats in step["comm"].values()), os.linesep + str(step)
