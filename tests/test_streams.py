"""The CPU side of the copy machinery (issue 19, items 4 and 5), one process, no spawn: exact-size pinned
allocation and its unregistration, which offload buffers are flagged to be pinned, the host step's thread
count, the offload's gradient folds running on the fold thread as copies land, in push order, and the
offload's CUDA calls on a faked torch.cuda (every one with the rank's device index).
The same paths on a GPU are in tests/test_streams_cuda.py."""

from __future__ import annotations

import contextlib
import gc
import threading
import time

import pytest
import torch
from torch import nn

from hfzero.runtime import streams
from hfzero.runtime.layout import FlatLayout
from hfzero.runtime.offload import HostOffload, host_step_threads


# ---- exact-size pinned memory -----------------------------------------------------------------------
def test_pinned_empty_registers_exact_pages_and_unregisters_when_the_last_view_dies(monkeypatch):
    calls = []
    monkeypatch.setattr(streams, "_register", lambda address, nbytes: calls.append(("register", address, nbytes)))
    monkeypatch.setattr(streams, "_unregister", lambda address: calls.append(("unregister", address)))
    numel = 5 * 2**20 + 3  # 20 MiB + 12 bytes of fp32: the caching host allocator would lock 32 MiB
    buffer = streams.pinned_empty(numel, torch.float32, pin=True)
    assert buffer.numel() == numel and buffer.dtype == torch.float32
    exact = -(-numel * 4 // streams.PAGE) * streams.PAGE
    assert streams.pinned_nbytes(numel, torch.float32) == exact < 2**25
    assert calls == [("register", buffer.data_ptr(), exact)]
    view = buffer[10:20]
    view.fill_(2.0)
    del buffer
    gc.collect()
    assert len(calls) == 1 and float(view.sum()) == 20.0  # a view keeps the pages registered
    address = view.data_ptr() - 10 * 4
    del view
    gc.collect()
    assert calls[1:] == [("unregister", address)]


def test_pinned_empty_without_pin_is_an_ordinary_tensor(monkeypatch):
    monkeypatch.setattr(streams, "_register", lambda *a: pytest.fail("nothing to register"))
    assert streams.pinned_empty(10, torch.bfloat16, pin=False).numel() == 10
    assert streams.pinned_empty(0, torch.float32, pin=True).numel() == 0


# ---- offload: what is pinned, how many threads step -----------------------------------------------
def _layout(sizes: list[int], bucket_size: int) -> FlatLayout:
    params = [(i, f"p{i}", nn.Parameter(torch.zeros(n))) for i, n in enumerate(sizes)]
    return FlatLayout([params], bucket_size, 1, 0)


@pytest.mark.parametrize("param_dtype, master_is_pinned", [(torch.float32, True), (torch.bfloat16, False)])
def test_offload_flags_only_what_dma_touches_to_be_pinned(param_dtype, master_is_pinned):
    offload = HostOffload(_layout([64, 64], 64), torch.device("cpu"), param_dtype, accumulate=True)
    assert offload.pin_plan == {"staging": True, "master": master_is_pinned, "grad": False, "states": False}
    assert not offload.pinned and offload.pinned_bytes() == 0  # a CPU device pins nothing
    assert not offload.grad.is_pinned() and offload.staging.dtype == param_dtype


def test_offload_pins_flagged_buffers_at_exact_size(monkeypatch):
    registered = []
    monkeypatch.setattr(streams, "_register", lambda address, nbytes: registered.append(nbytes))
    monkeypatch.setattr(streams, "_unregister", lambda address: None)
    offload = HostOffload(_layout([3000, 1000], 10_000), torch.device("cpu"), torch.float32, accumulate=True)
    offload.pinned = True  # what a CUDA device sets; the allocation path is the same
    staging = offload.empty(4000, torch.float32, pin=offload.pin_plan["staging"])
    master = offload.empty_master(4000, torch.float32)
    states = offload.empty(4000, torch.float32)
    assert registered == [16384, 16384] and offload.pinned_bytes() == 32768  # 16000 bytes -> 4 pages each
    assert staging.numel() == master.numel() == states.numel() == 4000


@pytest.mark.parametrize("cores, local_world, current, expected",
                         [(16, 4, 1, 4), (16, 4, 8, 8), (2, 4, 1, 1), (64, 1, 1, 64), (7, 2, 1, 3)])
def test_host_step_threads_is_the_ranks_share_of_the_cores(cores, local_world, current, expected):
    assert host_step_threads(cores, local_world, current) == expected


def test_host_step_raises_the_threads_and_restores_them():
    offload = HostOffload(_layout([8], 8), torch.device("cpu"), torch.float32, accumulate=True)
    before = torch.get_num_threads()
    offload.step_threads = before + 1
    seen = []
    try:
        with offload.host_step():
            seen.append(torch.get_num_threads())
            raise RuntimeError("the step failed")
    except RuntimeError:
        pass
    assert seen == [before + 1] and torch.get_num_threads() == before


# ---- offload: folds as copies land ------------------------------------------------------------------
class _SlowEvent:
    """A copy event the fold thread waits on: done after ``delay`` seconds."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def synchronize(self) -> None:
        time.sleep(self.delay)


@pytest.mark.parametrize("accumulate", [True, False])
def test_folds_run_on_the_fold_thread_in_push_order(accumulate):
    layout = _layout([4, 4, 4], 4)
    offload = HostOffload(layout, torch.device("cpu"), torch.float32, accumulate=accumulate)
    delays = iter([0.2, 0.0, 0.0, 0.0])  # the first copy lands last: later folds still wait for it
    offload.copies.record = lambda: _SlowEvent(next(delays))
    threads = set()
    fold = offload._fold
    offload._fold = lambda bucket, done: (threads.add(threading.get_ident()), fold(bucket, done))
    b0, b1, b2 = layout.buckets
    n = b0.chunk  # each bucket's slice (the layout pads)
    offload.push(b0, torch.full((n,), 1.0))
    offload.push(b1, torch.full((n,), 2.0))
    offload.push(b2, torch.full((n,), 3.0))
    offload.push(b1, torch.full((n,), 5.0))  # pushed again: waits for its first fold, then folds once more
    offload._folds[b2.index].result()  # the copy of b2 landed: folded without a drain
    assert offload._slice(offload.grad, b2).tolist() == [3.0] * n
    offload.drain()
    assert offload.fold_order == [0, 1, 2, 1]
    assert threads and threading.get_ident() not in threads
    assert offload.gradient(b1).tolist() == ([7.0] if accumulate else [5.0]) * n
    assert offload.gradient(b0).tolist() == [1.0] * n
    offload.reset()
    assert offload.gradient(b0).tolist() == [0.0] * n  # forgotten after the step


def test_a_failed_fold_is_raised_by_drain():
    layout = _layout([4], 4)
    offload = HostOffload(layout, torch.device("cpu"), torch.float32, accumulate=True)

    class _Failed:
        def synchronize(self) -> None:
            raise RuntimeError("copy failed")

    offload.copies.record = _Failed
    offload.push(layout.buckets[0], torch.ones(layout.buckets[0].chunk))
    with pytest.raises(RuntimeError, match="copy failed"):
        offload.drain()


# ---- offload on a CUDA device given without an index (faked: torch.cuda's calls recorded) --------------
class _FakeCuda:
    """What the offload's CUDA path calls of torch.cuda, recorded; copies stay synchronous CPU copies.
    ``set_device`` refuses an index-less device, as torch's does."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, current: int) -> None:
        self.calls: list[tuple[str, str, str]] = []  # (call, device, thread name)
        fake = self

        class Stream:
            def __init__(self, device=None, priority=0):
                fake._call("Stream", device)
                self.device = torch.device(device)

            def wait_stream(self, other) -> None:
                pass

            def synchronize(self) -> None:
                pass

        class Event:
            def record(self, stream=None) -> None:
                pass

            def synchronize(self) -> None:
                pass

            def query(self) -> bool:
                return True

        def set_device(device) -> None:
            fake._call("set_device", device)
            if torch.device(device).index is None:
                raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(streams, "Event", Event)
        monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: fake._call("current_stream", device))
        monkeypatch.setattr(torch.cuda, "set_device", set_device)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
        monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
        monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda"))
        monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: current)
        monkeypatch.setattr(streams, "_register", lambda address, nbytes: None)
        monkeypatch.setattr(streams, "_unregister", lambda address: None)

    def _call(self, name: str, device) -> "_FakeCuda":
        self.calls.append((name, str(device), threading.current_thread().name))
        return self  # as the compute stream: waits on it are device-side, nothing to do here

    def wait_event(self, event) -> None:
        pass


def test_offload_on_cuda_without_an_index_sets_the_ranks_device_on_the_fold_thread(monkeypatch):
    """Issue 33 item 4: ``HostOffload(layout, torch.device("cuda"), ...)`` made its fold thread call
    ``torch.cuda.set_device(torch.device("cuda"))`` (ValueError: the pool broke, the first push raised). The device
    is resolved once to the current one, cuda:1 here, and every stream, current-stream query and set_device
    gets it: on the fold thread too, whose own current device would be 0. See [Note: device index]."""
    fake = _FakeCuda(monkeypatch, current=1)
    layout = _layout([4, 4], 4)
    offload = HostOffload(layout, torch.device("cuda"), torch.bfloat16, accumulate=True)
    for value in (1.0, 2.0):
        for bucket in layout.buckets:  # the old code: BrokenThreadPool here (its initializer's ValueError)
            offload.order_after(offload.push(bucket, torch.full((bucket.chunk,), value, dtype=torch.bfloat16)))
    offload.drain()
    assert offload.device == torch.device("cuda", 1) and offload.copies.device == torch.device("cuda", 1)
    assert offload.pinned and offload.pinned_bytes() > 0
    assert offload.fold_order == [0, 1, 0, 1]
    assert all(offload.gradient(b).tolist() == [3.0] * b.chunk for b in layout.buckets)
    assert {device for _, device, _ in fake.calls} == {"cuda:1"}
    folds = [thread for call, _, thread in fake.calls if call == "set_device"]
    assert len(folds) == 1 and folds[0].startswith("hfzero-offload-fold")
    assert [call for call, _, _ in fake.calls].count("Stream") == 1


def test_devices_kept_for_later_carry_their_index(monkeypatch):
    """The communicator's scratch device, its timer and the profiler's allocator probe, given "cuda"."""
    from hfzero.comm.collectives import Communicator
    from hfzero.comm.timing import DeviceTimer
    from hfzero.profiler.allocator import AllocatorProbe

    _FakeCuda(monkeypatch, current=3)
    assert Communicator(device=torch.device("cuda")).device == torch.device("cuda", 3)
    assert DeviceTimer("cuda").device == torch.device("cuda", 3)
    probe = AllocatorProbe(torch.device("cuda"))
    assert probe.device == torch.device("cuda", 3)
    probe.close()


# ---- P_a+cpu checkpoints: copies beside compute, the next one prefetched -------------------------
def _checkpointed_grads(monkeypatch, cpu: bool, steps: int = 2):
    from hfzero.runtime.activations.checkpoint import FORCE_ENV, CheckpointPolicy, enable_checkpointing
    from hfzero.testing.models import tiny_causal_lm

    monkeypatch.setenv(FORCE_ENV, "1")
    torch.manual_seed(0)
    model = tiny_causal_lm("gpt2", hidden=32, layers=3, vocab=64).train()
    checkpoint = enable_checkpointing(model, CheckpointPolicy(cpu=cpu))
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    buffers = []
    for _ in range(steps):
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        buffers.append([b.data_ptr() for b in checkpoint._host_buffers])
    return {n: p.grad.clone() for n, p in model.named_parameters()}, checkpoint, buffers


def test_cpu_checkpoints_prefetch_the_next_layer_and_reuse_host_buffers(monkeypatch):
    reference, _, _ = _checkpointed_grads(monkeypatch, cpu=False)
    grads, checkpoint, buffers = _checkpointed_grads(monkeypatch, cpu=True)
    for name, grad in reference.items():
        assert torch.equal(grads[name], grad), name  # the host round trip changes no bit
    # 3 layers: unpacking layer k's input prefetches layer k-1's; layer 0 has none before it
    assert checkpoint.prefetches == 2 * 2
    assert len(buffers[0]) == 3 and buffers[0] == buffers[1]  # one host buffer per checkpoint, reused
    assert checkpoint.stored.live == 0 and checkpoint.pinned_bytes() == 0  # a CPU device pins nothing
