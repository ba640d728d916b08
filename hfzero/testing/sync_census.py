"""Who synchronized the host: each synchronizing call, counted with the Python frame that made it.

[Note: host-sync attribution]
A synchronizing call is charged to the innermost Python frame *outside torch* on the calling thread
(``attribute``): a sync made inside a torch helper (an optimizer's step, ``clip_grad_norm_``, a
collective's Python wrapper) is charged to whoever called the helper, so hfzero pays for what the torch
functions it calls do. The frame's module names the owner:

- ``hfzero``: hfzero's library (``hfzero.*`` outside ``hfzero.testing``): the budget of [Note: host-sync
  budget] (hfzero/testing/host_syncs.py) is on these alone;
- ``transformers`` / ``accelerate``: the model's or accelerate's own code (e.g. transformers'
  masking_utils reads a device tensor on every forward without an attention mask);
- ``caller``: everything else outside torch: the training loop, hfzero.testing, a test, a script;
- ``autograd``: a C++ kernel of the backward pass. Its warnings are replayed after the backward at the
  frame that called ``.backward()`` (autograd's engine defers them), and on CPU its ops run under that
  frame, so a sync whose innermost frame is autograd's ``_engine_run_backward`` belongs to no caller
  (a Python hook running in the backward has frames of its own and is charged to them);
- ``torch.distributed`` / ``torch``: no frame outside torch (a thread torch started).

Two counters share it:

- ``CudaSyncWarnings`` (CUDA only): torch's own reports under ``torch.cuda.set_sync_debug_mode("warn")``,
  a Python warning raised at the frame that called the synchronizing function, caught by a
  ``warnings.showwarning`` hook (any Python thread). C++ threads with no Python caller (gloo's work
  threads synchronizing their streams) print the warning to the process's stderr instead: those lines
  are counted from file descriptor 2 as ``cpp_thread_lines``, attributable to nobody.
- ``SyncCensus`` (any device; the proxy on CPU, where nothing synchronizes): a ``TorchFunctionMode`` and a
  ``TorchDispatchMode`` see every torch call, including those inside torch helpers, and count the ones
  that synchronize on an accelerator: host reads (``.item()``, ``bool()``/``int()``/``float()`` of a
  tensor, ``.tolist()``, ``.numpy()``), device-to-host copies (``.cpu()``, ``.to("cpu")``, a blocking
  ``copy_``/``to`` between host and device), host data to a device (``torch.tensor``/``as_tensor`` with a
  device), data-dependent shapes (``nonzero``, boolean-mask indexing and assignment, ``masked_select``,
  ``unique``, ``repeat_interleave`` without ``output_size``, ``bincount``), ``torch.equal``, and the
  explicit ``synchronize`` calls (device, stream, event). On CPU every tensor stands for a device tensor
  except those registered with ``host()`` (e.g. an optimizer's ``step`` counters, which torch keeps on
  the host): the proxy cannot tell the two placements apart otherwise, so ``.to(device)`` between
  placements it cannot see is not counted there (CUDA counts the real copies at the dispatch level).

Test tooling only (nothing of the library imports it): ``TorchDispatchMode`` is torch's documented extension
point for dispatch-level modes, though it lives in ``torch.utils._python_dispatch``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import linecache
import os
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterable, Iterator
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

OWNERS = ("hfzero", "transformers", "accelerate", "caller", "autograd", "torch.distributed", "torch")
"""Who a synchronization is charged to (see [Note: host-sync attribution])."""

SYNC_WARNING = "called a synchronizing CUDA operation"
"""The text of torch's warning under ``torch.cuda.set_sync_debug_mode("warn")``."""

_PASS_THROUGH = frozenset({"warnings", "contextlib", "functools", __name__})
"""Modules whose frames are machinery between a caller and torch, never the caller (this module's: the
census's own handlers sit between the caller and torch)."""


@dataclasses.dataclass(frozen=True)
class SyncSite:
    """Where one kind of synchronization happened.

    Attributes:
        owner: one of ``OWNERS``.
        where: ``module:line function`` of the frame charged (the innermost outside torch; the innermost
            frame of all when there is none).
        code: that frame's source line.
        via: the innermost torch module on the way ("" when the frame called the synchronizing API
            itself), e.g. ``torch.optim.adamw`` or ``torch.nn.utils.clip_grad``.
        api: what synchronized (the census's label; "sync" for torch's warnings, which do not say).
    """

    owner: str
    where: str
    code: str
    via: str
    api: str


_TORCH_MACHINERY = ("torch._dynamo", "torch._compile", "torch.utils._python_dispatch", "torch._ops", "torch.overrides")
"""torch modules between a caller and the census's modes (dynamo's disable wrappers, the mode dispatch):
never named as the torch helper a synchronization went through."""


def _module(frame: FrameType) -> str:
    return frame.f_globals.get("__name__", "") or ""


def _in_torch(module: str) -> bool:
    return module == "torch" or module.startswith("torch.")


def owner_of(module: str) -> str:
    """The owner of a frame outside torch, by its module name."""
    if module.startswith("hfzero.testing"):
        return "caller"
    if module == "hfzero" or module.startswith("hfzero."):
        return "hfzero"
    for package in ("transformers", "accelerate"):
        if module == package or module.startswith(package + "."):
            return package
    return "caller"


def attribute(frame: FrameType | None, api: str) -> SyncSite:
    """Charge a synchronization seen at ``frame`` (the innermost Python frame of the calling thread,
    machinery included) to its owner; see [Note: host-sync attribution]."""
    innermost: FrameType | None = None
    via = ""
    while frame is not None:
        module = _module(frame)
        if module in _PASS_THROUGH or module.startswith(_TORCH_MACHINERY):
            frame = frame.f_back
            continue
        if innermost is None:
            innermost = frame
        if not _in_torch(module):
            break
        via = via or module
        frame = frame.f_back
    if innermost is None:  # no Python frame on this thread: a C++ thread (autograd's device threads)
        return SyncSite("autograd", "<no Python frame>", "", "", api)
    charged = frame if frame is not None else innermost
    where = f"{_module(charged)}:{charged.f_lineno} {charged.f_code.co_name}"
    code = linecache.getline(charged.f_code.co_filename, charged.f_lineno).strip()[:120]
    if innermost.f_code.co_name == "_engine_run_backward" and _module(innermost).startswith("torch.autograd"):
        owner = "autograd"
    elif frame is None:
        owner = "torch.distributed" if via.startswith("torch.distributed") else "torch"
    else:
        owner = owner_of(_module(frame))
    return SyncSite(owner, where, code, "" if via == _module(charged) else via, api)


class SiteCounts:
    """Synchronizations counted per phase and site (thread-safe: hooks and backward threads add to it)."""

    def __init__(self) -> None:
        self.counts: collections.Counter[tuple[str, SyncSite]] = collections.Counter()
        self._lock = threading.Lock()
        self.phase = "unphased"

    def add(self, site: SyncSite) -> None:
        with self._lock:
            self.counts[(self.phase, site)] += 1

    def total(self, owner: str | None = None, phases: Iterable[str] | None = None) -> int:
        wanted = None if phases is None else set(phases)
        return sum(n for (phase, site), n in self.counts.items()
                   if (owner is None or site.owner == owner) and (wanted is None or phase in wanted))

    def by_owner(self) -> dict[str, int]:
        out: collections.Counter[str] = collections.Counter()
        for (_, site), n in self.counts.items():
            out[site.owner] += n
        return dict(out)

    def sites(self) -> list[dict[str, Any]]:
        """Every (phase, site) with its count, most frequent first (JSON-ready)."""
        rows = [{"phase": phase, **dataclasses.asdict(site), "count": n} for (phase, site), n in self.counts.items()]
        return sorted(rows, key=lambda r: (-r["count"], r["owner"], r["where"]))


# ---- the census (any device; the proxy on CPU) ----------------------------------------------------

_READS = {"item": "Tensor.item", "__bool__": "bool(tensor)", "__int__": "int(tensor)", "__float__": "float(tensor)",
          "__index__": "index(tensor)", "__complex__": "complex(tensor)", "tolist": "Tensor.tolist",
          "numpy": "Tensor.numpy"}
"""Tensor methods that read a value on the host (``numpy`` of a device tensor fails, of a copy it is the read)."""

_DATA_DEPENDENT = ("nonzero", "masked_select", "_unique", "_unique2", "unique_dim", "unique_consecutive",
                   "unique_dim_consecutive", "bincount", "equal", "is_nonzero", "_local_scalar_dense")
"""aten ops whose result shape or value the host must read before going on."""

_BOOL_INDEXED = ("index", "index_put", "index_put_", "_index_put_impl_")
"""aten ops that turn a boolean mask into indices (a ``nonzero``) on the device."""


def _target_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | None:
    """The device ``Tensor.to(...)`` moves to, or None when it keeps the device."""
    if kwargs.get("device") is not None:
        return torch.device(kwargs["device"])
    for arg in args[1:]:
        if isinstance(arg, (str, torch.device)):
            return torch.device(arg)
        if isinstance(arg, torch.Tensor):
            return arg.device
    return None


def _spelled_cpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``Tensor.to(...)`` names the host by the string "cpu" (not through a device variable)."""
    return kwargs.get("device") == "cpu" or any(arg == "cpu" for arg in args[1:] if isinstance(arg, str))


class SyncCensus:
    """Counts the calls that synchronize on an accelerator, with their sites; see [Note: host-sync attribution].

    ``device_type``: the run's accelerator ("cuda"), or "cpu" for the proxy, where every tensor stands for a
    device tensor except those passed to ``host()``. ``counts``: a ``SiteCounts``; ``phase(name)`` labels
    what is counted inside it.
    """

    def __init__(self, device_type: str = "cpu") -> None:
        self.device_type = device_type
        self.counts = SiteCounts()
        self._host: set[int] = set()
        self._local = threading.local()  # depth: inside a call already counted (its aten ops are not)
        aten = torch.ops.aten
        self._data_dependent = {p for p in (getattr(aten, n, None) for n in _DATA_DEPENDENT) if p is not None}
        self._bool_indexed = {p for p in (getattr(aten, n, None) for n in _BOOL_INDEXED) if p is not None}
        self._copies = {p for p in (getattr(aten, n, None) for n in ("_to_copy", "copy_", "copy")) if p is not None}
        self._repeat = getattr(aten, "repeat_interleave", None)
        self._reads = {getattr(torch.Tensor, name): label for name, label in _READS.items()
                       if hasattr(torch.Tensor, name)}

    def host(self, tensors: Iterable[torch.Tensor]) -> None:
        """Tensors that live on the host on an accelerator too (their reads are not synchronizations)."""
        for t in tensors:
            self._host.add(t.untyped_storage().data_ptr())

    # -- what counts --------------------------------------------------------------------------------
    def _on_device(self, t: Any) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        if self.device_type != "cpu":
            return t.device.type == self.device_type
        if t.device.type != "cpu":
            return False
        try:
            return t.untyped_storage().data_ptr() not in self._host
        except (RuntimeError, NotImplementedError, TypeError):  # a wrapper subclass without storage
            return True

    def _count(self, api: str) -> None:
        self.counts.add(attribute(sys._getframe(1), api))

    def _function_api(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """The label of a synchronizing torch function call, else None."""
        self_ = args[0] if args else None
        if func in self._reads:
            return self._reads[func] if self._on_device(self_) else None
        if func is torch.Tensor.cpu:
            return "Tensor.cpu" if self._on_device(self_) else None
        if func is torch.Tensor.to:
            target = _target_device(args, kwargs)
            if target is None or target.type != "cpu" or kwargs.get("non_blocking", False) \
                    or not self._on_device(self_):
                return None
            # the proxy: only a placement spelled "cpu" is surely the host's (a device variable is "cpu" too)
            return "Tensor.to(cpu)" if self.device_type != "cpu" or _spelled_cpu(args, kwargs) else None
        if func in (torch.tensor, torch.as_tensor):
            device = kwargs.get("device", args[2] if func is torch.as_tensor and len(args) > 2 else None)
            if device is None:
                return None
            if self.device_type == "cpu" or torch.device(device).type == self.device_type:
                return f"torch.{func.__name__}(device=)"
        return None

    def _dispatch_api(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """The label of a synchronizing aten op, else None."""
        packet = func.overloadpacket
        if packet in self._data_dependent:
            return f"aten.{packet.__name__}" if any(self._on_device(a) for a in args[:2]) else None
        if packet in self._bool_indexed:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            masks = [i for i in indices or () if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)]
            return f"aten.{packet.__name__} (boolean mask)" if any(self._on_device(m) for m in masks) else None
        if packet is self._repeat and not func.__name__.endswith(".self_int") and kwargs.get("output_size") is None:
            return "aten.repeat_interleave (no output_size)" if any(self._on_device(a) for a in args[:2]) else None
        if packet in self._copies and self.device_type != "cpu" and not kwargs.get("non_blocking", False):
            if packet.__name__ == "_to_copy":
                src, dst = args[0], kwargs.get("device")
                dst_type = torch.device(dst).type if dst is not None else src.device.type
            else:
                dst, src = args[0], args[1]
                dst_type = dst.device.type
                if len(args) > 2 and args[2]:  # non_blocking passed positionally
                    return None
            if isinstance(src, torch.Tensor) and {src.device.type, dst_type} == {"cpu", self.device_type}:
                return f"aten.{packet.__name__} ({src.device.type} -> {dst_type})"
        return None

    # -- the modes ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[SyncCensus]:
        """Count inside the block under ``name``: the torch-function and dispatch modes and the patched
        ``synchronize`` functions are active (undone on exit, also on error)."""
        census = self
        self.counts.phase = name

        class _Functions(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                api = census._function_api(func, args, kwargs)
                if api is None:
                    return func(*args, **kwargs)
                census._count(api)
                return census._uncounted(func, args, kwargs)

        class _Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if not getattr(census._local, "depth", 0):
                    api = census._dispatch_api(func, args, kwargs)
                    if api is not None:
                        census._count(api)
                return func(*args, **kwargs)

        with contextlib.ExitStack() as stack:
            for owner, name_ in _synchronize_functions():
                stack.enter_context(_patched(owner, name_, self))
            stack.enter_context(_Functions())
            stack.enter_context(_Dispatch())
            yield self

    def _uncounted(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run a call already counted, its aten ops uncounted (one ``.item()`` is one sync, not two)."""
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            return func(*args, **kwargs)
        finally:
            self._local.depth -= 1


def _synchronize_functions() -> list[tuple[Any, str]]:
    """(owner, name) of every explicit host wait the census patches: the device's, a stream's, an event's."""
    found: list[tuple[Any, str]] = [(torch.cuda, "synchronize")]
    if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "synchronize"):
        found.append((torch.accelerator, "synchronize"))
    for cls in (torch.cuda.Stream, torch.cuda.Event):
        if "synchronize" in vars(cls):
            found.append((cls, "synchronize"))
    return found


@contextlib.contextmanager
def _patched(owner: Any, name: str, census: SyncCensus) -> Iterator[None]:
    original = vars(owner)[name] if name in vars(owner) else getattr(owner, name)
    label = f"{getattr(owner, '__name__', owner)}.{name}"

    def counted(*args: Any, **kwargs: Any) -> Any:
        census._count(label)
        return original(*args, **kwargs)

    setattr(owner, name, counted)
    try:
        yield
    finally:
        setattr(owner, name, original)


# ---- torch's own reports (CUDA) ---------------------------------------------------------------------

class CudaSyncWarnings:
    """torch's synchronization warnings on CUDA, attributed; see [Note: host-sync attribution].

    ``counts``: a ``SiteCounts`` of the warnings raised in Python threads; ``cpp_thread_lines``: the ones
    C++ threads printed to stderr while ``watching()`` (other stderr output is passed through).
    """

    def __init__(self) -> None:
        self.counts = SiteCounts()
        self.cpp_thread_lines = 0

    @contextlib.contextmanager
    def watching(self) -> Iterator[CudaSyncWarnings]:
        """Capture file descriptor 2 (C++ threads' warnings) for the block; count its sync lines."""
        sys.stderr.flush()
        saved = os.dup(2)
        with tempfile.TemporaryFile() as captured:
            os.dup2(captured.fileno(), 2)
            try:
                yield self
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)
                captured.seek(0)
                text = captured.read().decode(errors="replace")
                lines = text.splitlines(keepends=True)
                self.cpp_thread_lines += sum(SYNC_WARNING in line for line in lines)
                sys.stderr.write("".join(line for line in lines if SYNC_WARNING not in line))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[CudaSyncWarnings]:
        """Warn on every synchronization inside the block and count each under ``name`` at its frame."""
        counts = self.counts
        counts.phase = name

        def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
            if SYNC_WARNING in str(message):
                counts.add(attribute(sys._getframe(1), "sync"))
            else:
                shown(message, category, filename, lineno, file, line)

        with warnings.catch_warnings():
            warnings.filterwarnings("always", message=".*" + SYNC_WARNING)  # every one, not once per site
            shown = warnings.showwarning
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield self
            finally:
                torch.cuda.set_sync_debug_mode("default")
