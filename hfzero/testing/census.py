"""A census of the device work one stretch of code dispatches: aten ops and the bytes they read and write.

``Census`` is a ``TorchDispatchMode``: while it is active every aten op is recorded under a **site** and its
name, with the bytes of the tensors it reads and writes:
- views, allocations (``empty*``) and metadata ops move nothing (counted as ops, 0 bytes);
- an op reads its tensor arguments and writes its outputs; an argument it mutates (``Tensor(a!)`` in its
  schema) is read and written, except ``out=`` arguments and the targets of ``copy_``, ``zero_`` and
  ``fill_``, which are written only, and the gradients of the fused optimizers (mutable in their schema for
  the unscale they do with a grad scaler), which are read only;
- collectives (``c10d`` ops) are counted as ops with no bytes: what they move is communication volume
  (``CommStats``), and at world 1 or on the fake process group they move nothing.
The site is the innermost hfzero function on the Python stack when the op was dispatched
(``runtime/reducer.py:_on_grad``: the engine's passes, by name), else ``optimizer`` for torch.optim's code,
else ``model`` (forward, autograd's backward and autocast's casts). hfzero's own test harness
(``hfzero/testing``) is not a site. Used by benchmarks/device_proxy.py and tests/test_step_kernels.py.
"""

from __future__ import annotations

import collections
import os
import sys
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_HFZERO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_HARNESS = os.path.dirname(os.path.abspath(__file__))
_OPTIM = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "optim")
_NO_BYTES = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "set_", "resize_",
                       "detach", "alias", "lift_fresh", "_record_function_enter_new", "_record_function_exit"})
_WRITE_ONLY = frozenset({"copy_", "zero_", "fill_", "_foreach_copy_", "_foreach_zero_"})
_READ_ONLY_ARGS = {"_fused_adamw_": {"grads", "state_steps"}, "_fused_adam_": {"grads", "state_steps"},
                   "_fused_sgd_": {"grads"}, "_fused_adagrad_": {"grads", "state_steps"}}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def site_of(frame: Any) -> str:
    """The site of an op dispatched with ``frame`` innermost: see the module docstring."""
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_OPTIM):
            return "optimizer"
        if name.startswith(_HFZERO) and not name.startswith(_HARNESS):
            return f"{os.path.relpath(name, _HFZERO)}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "model"


class Census(TorchDispatchMode):
    """Ops and bytes per (site, op name) while active: ``rows[(site, op)] = [ops, bytes read, bytes written]``."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        namespace, _, name = func._schema.name.partition("::")
        row = self.rows[(site_of(sys._getframe(1)), f"c10d.{name}" if namespace == "c10d" else name)]
        row[0] += 1
        if namespace == "c10d" or func.is_view or name in _NO_BYTES:
            return out
        mutated: set[int] = set()
        read_only = _READ_ONLY_ARGS.get(name, ())
        for position, arg in enumerate(func._schema.arguments):
            value = kwargs.get(arg.name) if arg.name in kwargs else (args[position] if position < len(args) else None)
            tensors = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
            size = sum(_nbytes(t) for t in tensors)
            if arg.alias_info is not None and arg.alias_info.is_write and arg.name not in read_only:
                row[2] += size
                mutated.update(id(t) for t in tensors)
                if not (arg.is_out or name in _WRITE_ONLY):
                    row[1] += size
            else:
                row[1] += size
        row[2] += sum(_nbytes(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor) and id(t) not in mutated)
        return out

    def table(self) -> list[dict[str, Any]]:
        """The rows as dicts: site, op, ops, read, written (bytes)."""
        return [{"site": site, "op": op, "ops": n, "read": r, "written": w} for (site, op), (n, r, w) in self.rows.items()]


def by_site(rows: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Ops and bytes read / written per site (collectives' ops included in ``ops``)."""
    sites: dict[str, dict[str, int]] = {}
    for row in rows:
        s = sites.setdefault(row["site"], {"ops": 0, "read": 0, "written": 0})
        for key in ("ops", "read", "written"):
            s[key] += row[key]
    return sites


def total_bytes(rows: list[dict[str, Any]]) -> int:
    return sum(row["read"] + row["written"] for row in rows)


def kernel_ops(rows: list[dict[str, Any]]) -> int:
    """Ops that move bytes (a kernel each on an accelerator): views, allocations and collectives left out."""
    return sum(row["ops"] for row in rows if row["read"] + row["written"] > 0)
