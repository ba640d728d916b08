"""The private torch entry points the engine calls, each behind a feature test (docs/engine.md, "Torch versions").

Each test runs once, at import, and keeps the private callable (or None) in a module global that the public
function here reads at every call, so a test can force the fallback by setting that global to None
(tests/test_torch_api.py runs the engine that way). Nothing here holds memory.

- ``graph_task_id()``: ``torch._C._current_graph_task_id`` names the backward pass running on this thread (-1
  outside one). The engine uses it for two diagnostics only: a gradient from a new pass while an earlier pass
  that raised was never closed (FAILED_PASS_MESSAGE), and ``zero_grad()`` called from inside a backward pass.
  Fallback: -1 always, so both diagnostics are off (gradients of such a pass then mix as plain torch's ``.grad``
  would) and everything else is unchanged.
- ``queue_backward_callback(fn)``: autograd's end-of-pass callback
  (``torch.autograd.Variable._execution_engine.queue_callback``, the one FSDP2 uses too). The engine closes each
  backward pass with it (its last bucket reductions, stage 3's releases). No public API runs code when a
  backward pass ends, so there is no fallback: without it the first backward raises a RuntimeError that says so.
- ``is_compile_wrapper(module)``: whether ``module`` is the wrapper ``torch.compile(module)`` returns
  (``torch._dynamo.eval_frame.OptimizedModule``, which torch exports nowhere public). Fallback: a class named
  ``OptimizedModule`` in the module's class hierarchy.
- ``view_base(tensor)``: the allocation a view was cut from (``Tensor._base``), for the reducer's staging pool.
  Fallback: the tensor itself (a pooled buffer is then the view, and the pool counts the view's elements).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

_graph_task_id: Callable[[], int] | None = getattr(torch._C, "_current_graph_task_id", None)
_queue_callback: Callable[[Callable[[], None]], None] | None = getattr(
    getattr(torch.autograd.Variable, "_execution_engine", None), "queue_callback", None)
_has_base: bool = hasattr(torch.Tensor, "_base")


def _find_optimized_module() -> type | None:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:
        return None
    return OptimizedModule


_optimized_module: type | None = _find_optimized_module()

NO_BACKWARD_CALLBACK = (
    "hfzero: this torch ({version}) has no end-of-backward callback "
    "(torch.autograd.Variable._execution_engine.queue_callback), which the engine needs to finish each backward "
    "pass; use a torch that README \"Tested versions\" lists")


def graph_task_id() -> int:
    """The id of the backward pass running on this thread, -1 outside one (and always -1 without the private
    id: see the module docstring)."""
    return _graph_task_id() if _graph_task_id is not None else -1


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the backward pass running now has finished; a clear RuntimeError where torch cannot."""
    if _queue_callback is None:
        raise RuntimeError(NO_BACKWARD_CALLBACK.format(version=torch.__version__))
    _queue_callback(fn)


def is_compile_wrapper(module: nn.Module) -> bool:
    """True when ``module`` is the wrapper that ``torch.compile(module)`` returns."""
    if _optimized_module is not None:
        return isinstance(module, _optimized_module)
    return any(cls.__name__ == "OptimizedModule" for cls in type(module).__mro__)


def view_base(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor ``tensor`` is a view of, or ``tensor`` itself when it is no view (or torch does not say)."""
    base = tensor._base if _has_base else None
    return base if base is not None else tensor
