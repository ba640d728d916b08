"""Side streams, events and exact-size pinned host memory: the one place device differences live.

Offload (runtime/offload.py) and CPU checkpointing (runtime/activations/checkpoint.py) move tensors between
the device and the host on a stream of their own, ordered against the compute stream by events. On a CPU
device (the forced test paths) there is no stream: ``SideStream`` then runs every copy synchronously on the
calling thread and its events are None, so the callers' ordering code runs unchanged and is tested on CPU.

[Note: exact-size pinned memory]
``torch.empty(n, pin_memory=True)`` goes through torch's caching host allocator, which rounds every block
up to a power of two: a 1.1 GiB staging buffer pins 2 GiB of page-locked memory, which the OS can neither
swap nor give to another rank. Buffers pinned for the life of an engine (offload staging, fp32 master
weights) are therefore allocated by ``pinned_empty``: anonymous pages of exactly the buffer's size (rounded
to the page, 4 KiB) registered with CUDA by ``cudaHostRegister``, so that asynchronous copies from and to
them are true DMA. The pages are unregistered, then unmapped, when the last tensor viewing them is freed:
the tensor holds the mapping (``torch.frombuffer``), and the mapping's subclass runs the unregistration
from its weak-reference callback, which CPython calls before the base type unmaps the pages. Buffers
allocated and freed every step (P_a+cpu checkpoints) keep the caching allocator: registering costs a
system call per page range, far more than a cache hit.
"""

from __future__ import annotations

import contextlib
import mmap
import weakref
from collections.abc import Callable, Iterator

import torch

from hfzero.devices import with_index
from hfzero.logging import get_logger

logger = get_logger(__name__)

PAGE = mmap.PAGESIZE

Event = torch.cuda.Event  # the events a SideStream hands out on CUDA (None on CPU)


class SideStream:
    """A stream for copies beside the compute stream of ``device``; synchronous on a CPU device.

    Holds no memory. ``run()`` is the context under which copies are issued: on CUDA they run on the side
    stream after everything the compute stream had queued; on CPU they run now.
    """

    def __init__(self, device: torch.device):
        self.device = with_index(device)  # the compute stream is this device's on every thread: [Note: device index]
        self.stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None

    @property
    def asynchronous(self) -> bool:
        return self.stream is not None

    def _compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def after_compute(self) -> None:
        """Order the next copies after the work the compute stream has queued so far."""
        if self.stream is not None:
            self.stream.wait_stream(self._compute())

    @contextlib.contextmanager
    def run(self) -> Iterator[None]:
        """Issue the enclosed copies on the side stream (CPU: nothing to switch)."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield

    def record(self) -> Event | None:
        """An event after the copies issued so far on the side stream (None on CPU: they are done)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def keep_alive(self, tensor: torch.Tensor) -> None:
        """Tell the caching allocator that ``tensor`` is used on the side stream: if its owner drops it
        before the copies end, the block is not handed to a new tensor until they have (record_stream)."""
        if self.stream is not None and tensor.device.type == "cuda":
            tensor.record_stream(self.stream)

    def compute_waits(self, event: Event | None) -> None:
        """Make later compute-stream work wait for ``event`` (a device-side wait; the host goes on)."""
        if event is not None:
            self._compute().wait_event(event)

    def synchronize(self) -> None:
        """Block the host until every copy issued on the side stream is done."""
        if self.stream is not None:
            self.stream.synchronize()


def wait_host(event: Event | None) -> None:
    """Block the calling host thread until ``event`` has happened (None: already done). Releases the GIL."""
    if event is not None:
        event.synchronize()


def event_done(event: Event | None) -> bool:
    """Whether ``event`` has happened, without blocking."""
    return event is None or event.query()


# ---- exact-size pinned host memory -------------------------------------------------------------------
def pinned_nbytes(numel: int, dtype: torch.dtype) -> int:
    """Bytes ``pinned_empty`` page-locks for ``numel`` elements of ``dtype``: the size rounded to a page."""
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    return -(-nbytes // PAGE) * PAGE


def _cuda_register(address: int, nbytes: int) -> None:
    torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0))


def _cuda_unregister(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)  # at teardown a failure is not worth raising


_register: Callable[[int, int], None] = _cuda_register
_unregister: Callable[[int], None] = _cuda_unregister


class _Pages(mmap.mmap):
    """Anonymous pages; a subclass so that weak references (and the unregistration they carry) run
    before ``mmap`` unmaps the pages. See [Note: exact-size pinned memory]."""


def pinned_empty(numel: int, dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
    """An uninitialized host tensor of ``numel`` elements; page-locked at its exact size when ``pin``
    (see [Note: exact-size pinned memory]), an ordinary host tensor otherwise."""
    if not pin or numel == 0:
        return torch.empty(numel, dtype=dtype, device="cpu")
    nbytes = pinned_nbytes(numel, dtype)
    pages = _Pages(-1, nbytes)
    tensor = torch.frombuffer(pages, dtype=dtype, count=numel)  # the tensor keeps ``pages`` alive
    address = tensor.data_ptr()
    _register(address, nbytes)
    finalizer = weakref.finalize(pages, _unregister, address)
    finalizer.atexit = False  # the process is leaving: its pages go with it
    return tensor
