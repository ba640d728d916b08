"""torch.compile with hfzero: the engine's hooks are graph boundaries, and regional compilation of the blocks.

[Note: compiled regions]
Nothing of hfzero runs inside a compiled graph. Every hook hfzero registers on a module that a user may
compile (the root's forward hooks at stages 0-2, the stage-3 gather / release hooks of every unit, the
profiler's and the activation accounting's phase hooks) is wrapped with ``eager_hook``
(``torch.compiler.disable``): dynamo does not trace it, and what it calls (collectives and their timing,
logging, Python bookkeeping, host synchronizations) runs eagerly. Where such a hook sits on a module
inside a compiled region, dynamo ends the graph before it and starts a new one after it: the graph
breaks are exactly at the unit boundaries (the start and end of the root's forward, and of each
stage-3 unit's forward), never inside a decoder block. Hooks that run in backward (post-accumulate-grad
hooks of the reducer, pre-hooks on the nodes that made a unit's outputs) run in the autograd engine, outside compiled
code, unless compiled autograd is enabled (not supported: hfzero's gradient hooks must see each
parameter's gradient as it is accumulated).

Stage 3 keeps each parameter a view of its unit's full buffer while the unit is gathered and a
0-element tensor otherwise (see [Note: stage-3 release] in stage3/unit.py). A compiled block reads its
parameters as graph inputs, after its unit's pre-forward hook (outside the graph) gathered them, so
the guards see the same shapes every step and nothing recompiles; tensors the compiled forward saved
for backward share the unit's storage exactly as eager autograd's saved views do.

Regional compilation (``compile_regions``) compiles each block's ``forward`` in place, not
``Module.__call__``: the hooks stay outside the compiled function altogether, so a block's graph has
no break at all, the model keeps its module names (state dicts, unit names, checkpoints unchanged),
and the N identical blocks share one compiled graph (compiled once, reused by every block).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from hfzero.config import ConfigError
from hfzero.logging import get_logger
from hfzero.runtime.torch_api import is_compile_wrapper

logger = get_logger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])

_COMPILED_ATTR = "_hfzero_compiled_forward"
_BODY_ATTR = "_hfzero_compiled_body"

_compilations = 0
"""How many times ``compile_regions`` compiled something in this process (``compilations``)."""

BLOCKS_ATTR = "hfzero_block_names"
"""A module that holds a model's blocks under its own names (a pipeline stage: parallel/pipeline/split.py's
DecoderStage) lists their qualified names in this attribute; ``region_names`` compiles those."""


def eager_hook(fn: _F) -> _F:
    """``fn`` (a hook of hfzero's) never traced by dynamo: under torch.compile it runs eagerly between two
    graphs, and so does everything it calls. See [Note: compiled regions]."""
    return torch.compiler.disable(fn, recursive=True)


def region_names(model: nn.Module) -> list[str]:
    """The modules ``compile_regions`` compiles: the children of the model's block stacks (the decoder
    blocks, the stage-3 units by default; see [Note: stage-3 units]). A pipeline's stage module (``pipe.module``:
    a DecoderStage, or the StageChunks of a multi-stage schedule) names its own blocks (``BLOCKS_ATTR``)."""
    from hfzero.runtime.stage3.units import default_unit_names  # stage3 imports this module

    stages = [(name, m) for name, m in model.named_modules() if hasattr(m, BLOCKS_ATTR)]
    if stages:
        return [f"{name}.{block}" if name else block for name, stage in stages for block in getattr(stage, BLOCKS_ATTR)]
    return default_unit_names(model)


def compile_regions(model: nn.Module, names: list[str] | None = None, **compile_kwargs: Any) -> nn.Module:
    """Compile the ``forward`` of each repeated block of ``model`` in place; return ``model``.

    ``names``: the modules to compile (default: ``region_names(model)``, the decoder blocks).
    ``compile_kwargs`` go to ``torch.compile`` (``backend``, ``mode``, ``dynamic``, ``options``...).
    Call it before or after ``hfzero.prepare``: the module tree and parameter names do not change, and
    hfzero's hooks stay outside the compiled functions (see [Note: compiled regions]). The model keeps
    its class; no memory is allocated here (compilation happens at the first forward of each block).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"hfzero.compile_regions: model must be a torch.nn.Module, got {type(model).__name__}")
    names = region_names(model) if names is None else list(names)
    if not names:
        raise ConfigError("hfzero.compile_regions: the model has no stack of repeated blocks (no nn.ModuleList of "
                          "layers holding parameters here; after a tensor-parallel prepare at stage 3 the blocks' "
                          "shards count as empty: compile before prepare_tensor_parallel); compile the whole model "
                          "instead (torch.compile(model)) or pass names=[...]")
    modules = dict(model.named_modules())
    unknown = [n for n in names if n not in modules]
    if unknown:
        raise ConfigError(f"hfzero.compile_regions: {unknown} are not submodules of the model; pass names from "
                          "model.named_modules(), e.g. 'model.layers.0'")
    check_no_tensor_parallel(model, names)
    global _compilations
    _compilations += 1
    for name in names:
        module = modules[name]
        if holds_compiled_region(module):
            continue  # already compiled: keep its compiled function (no second wrapper)
        compiled = torch.compile(module.forward, **compile_kwargs)
        module.forward = compiled
        setattr(module, _COMPILED_ATTR, compiled)
        body = getattr(type(module).forward, "__wrapped__", None)
        if body is not None:  # a checkpointing layer's wrapper: the body it checkpoints, compiled for checkpointed_body
            setattr(module, _BODY_ATTR, torch.compile(body, **compile_kwargs))
    logger.info("compiled %d block(s) in place (%s ... %s) with %s", len(names), names[0], names[-1],
                compile_kwargs or "torch.compile's defaults")
    return model


TP_COMPILE_TORCH = (2, 14)
"""The first torch release whose dynamo compiles blocks with hfzero's DTensor (tensor-parallel) parameters.
hfzero keeps each DTensor parameter's local shard in its flat buffer; dynamo in torch 2.11 and 2.13 fails to fake
such a DTensor ('Attempted to set the storage of a tensor on device "cpu" to a storage on different device
"meta"'), torch 2.14.1 compiles it and trains as eagerly (tests/test_compile_parallel.py: parity where torch
compiles; hfzero's refusals on every torch, with this gate forced off on a newer one; torch's own failure where it
still fails, which CI's torch does not reach: seen by hand on 2.11 and 2.13). 2.14.0 is assumed like 2.14.1."""

TP_REFUSAL = ("torch.compile of tensor-parallel blocks under hfzero needs torch>=2.14, found torch {version}: "
              "hfzero keeps each DTensor parameter's local shard in its flat buffer, and dynamo before 2.14 fails "
              "to fake such a DTensor ('Attempted to set the storage of a tensor on device \"cpu\" to a storage on "
              "different device \"meta\"'). Upgrade torch (pip install 'torch>=2.14'), train tensor parallelism "
              "eagerly (tp_size=1 to compile, or do not compile), or use pipeline parallelism with "
              "compile_regions(pipe.module)")


def tensor_parallel_compiles(version: str | None = None) -> bool:
    """Whether torch ``version`` (default: the one imported) compiles hfzero's tensor-parallel blocks
    (``TP_COMPILE_TORCH``); an unreadable version is taken as new enough."""
    from hfzero.version import torch_release

    release = torch_release(torch.__version__ if version is None else version)
    return release is None or release >= TP_COMPILE_TORCH


def check_no_tensor_parallel(model: nn.Module, names: list[str]) -> None:
    """Refuse compiling blocks with DTensor (tensor-parallel) parameters on a torch that cannot
    (``tensor_parallel_compiles``); see docs/compile.md."""
    from torch.distributed.tensor import DTensor

    if tensor_parallel_compiles():
        return
    modules = dict(model.named_modules())
    if any(isinstance(p, DTensor) for name in names for p in modules[name].parameters()):
        raise ConfigError("hfzero.compile_regions: " + TP_REFUSAL.format(version=torch.__version__))


def is_compiled(model: nn.Module) -> bool:
    """True when ``model`` is a ``torch.compile`` wrapper or holds blocks ``compile_regions`` compiled."""
    return any(is_compile_wrapper(m) or holds_compiled_region(m)
               for m in model.modules())


def compilations() -> int:
    """A count that changes whenever ``compile_regions`` compiles modules: a cache of ``holds_compiled_region``'s
    answers is stale once it moved."""
    return _compilations


def holds_compiled_region(module: nn.Module) -> bool:
    """Whether ``compile_regions`` compiled ``module``'s own forward (not its submodules')."""
    return getattr(module, _COMPILED_ATTR, None) is not None


def checkpointed_body(function: Callable[..., Any]) -> Callable[..., Any]:
    """What a checkpoint function should run for ``function``: the compiled body of a block that
    ``compile_regions`` compiled, else ``function`` itself.

    transformers' checkpointing layers checkpoint inside ``forward``: their wrapper calls the checkpoint
    function with ``partial(body, layer, **kwargs)``, ``body`` being the class's own forward. hfzero's
    checkpoint function runs eagerly (its saved-tensor hooks cannot be traced), so under regional
    compilation the block's graph is the compiled body, run (and recomputed in backward) inside it.
    """
    if isinstance(function, functools.partial) and function.args:
        layer = function.args[0]
        body = getattr(layer, _BODY_ATTR, None)
        if body is not None and function.func is getattr(type(layer).forward, "__wrapped__", None):
            return functools.partial(body, *function.args, **function.keywords)
    return function
