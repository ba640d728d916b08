"""Tiled MLP: each decoder layer's MLP computed over slices of the sequence, one slice's intermediate alive.

[Note: tiled MLP]
A decoder layer's MLP is position-wise: ``mlp(x)[:, i]`` depends on ``x[:, i]`` alone. At long sequences
its intermediate activations (a gated MLP saves gate's output, the activation's output, up's output and
their product: 4 tensors of B x T x f, f the intermediate width, often 3-4x the hidden size) are the
largest tensors a layer saves. With ``enable_tiled_mlp(model, tiles)`` every layer's ``mlp`` runs on
``tiles`` slices of its input along the sequence (dim 1), each under torch's non-reentrant checkpoint:

- forward: one slice's intermediate is alive at a time and none is kept; the slices' outputs
  (B x T/tiles x h each) are concatenated;
- backward: autograd reaches the slices last-first (a later slice's nodes have higher sequence
  numbers, so its whole backward runs before the previous slice's starts); each slice's checkpoint
  recomputes that slice's intermediate when its backward begins and frees it as it is consumed. Resident
  during the MLP's backward: one slice's intermediate (B x T/tiles x f, x4 gated) plus the input's gradient.
- saved across the forward: the slices of the MLP's input, which are views of one tensor the untiled
  MLP saves too (the projections' input). So the layer saves the MLP's intermediates of *no* position.

Gradients are the untiled ones up to summation order of the weight gradients (each slice adds its part;
fp32: within 1e-6, tested). The parameters are used once per slice inside one module call, so the engine's
module hooks (stage 3's gather) fire once; a recompute runs inside the layer's backward, where the layer's
stage-3 unit is gathered. Works with transformers' activation checkpointing (the slices' checkpoints nest
inside the layer's), with sequence parallelism (the slices are of the rank's chunk) and without it.
Mixture-of-experts blocks (an ``mlp`` with ``experts``) are refused when tiling is enabled (their router
outputs are per call); any other MLP that returns anything but one tensor with its input's positions is
refused at its first call: its output might not be position-wise.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from hfzero.config import ConfigError
from hfzero.runtime.lifetime import Installed

_ATTR = "hfzero_mlp_tiles"


def mlp_modules(model: nn.Module) -> list[nn.Module]:
    """The ``mlp`` child of every module that has one (the decoder layers of Llama, Qwen, Mistral, GPT-2, ...)."""
    found = []
    for module in model.modules():
        mlp = getattr(module, "mlp", None)
        if isinstance(mlp, nn.Module) and all(mlp is not m for m in found):
            found.append(mlp)
    return found


def _tile_bounds(length: int, tiles: int) -> list[tuple[int, int]]:
    """``tiles`` contiguous [lo, hi) ranges covering ``length`` positions, sizes differing by at most one."""
    cuts = [round(i * length / tiles) for i in range(tiles + 1)]  # host ints, no device sync
    return [(lo, hi) for lo, hi in zip(cuts[:-1], cuts[1:]) if hi > lo]


def _tiled(untiled: Any, tiles: int, name: str) -> Any:
    @functools.wraps(untiled)
    def forward(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or not isinstance(hidden, torch.Tensor) or hidden.dim() < 3 or hidden.shape[1] < 2:
            return untiled(hidden, *args, **kwargs)
        parts = []
        for lo, hi in _tile_bounds(hidden.shape[1], tiles):  # (B, t, h) each
            piece = hidden[:, lo:hi]
            if torch.is_grad_enabled():
                out = torch.utils.checkpoint.checkpoint(untiled, piece, use_reentrant=False)
            else:
                out = untiled(piece)
            if not isinstance(out, torch.Tensor) or out.shape[:2] != piece.shape[:2]:
                raise ConfigError(f"hfzero: mlp_tiles: {name} returns {type(out).__name__}, not one tensor with "
                                  "its input's positions; tiling needs a position-wise MLP (leave mlp_tiles at 1 "
                                  "for mixture-of-experts blocks)")
            parts.append(out)
        return torch.cat(parts, dim=1)  # (B, T, h)

    return forward


def enable_tiled_mlp(model: nn.Module, tiles: int, installed: Installed | None = None) -> int:
    """Run every decoder layer's ``mlp`` over ``tiles`` slices of the sequence (in place; see [Note: tiled
    MLP]). Returns the number of MLPs tiled. Raises ConfigError when ``tiles`` < 2, the model is tiled already
    or has no ``mlp`` modules. ``installed``: where the patched ``forward``s are recorded, to be restored by
    ``unprepare`` (prepare passes its engine's)."""
    if not isinstance(tiles, int) or isinstance(tiles, bool) or tiles < 2:
        raise ConfigError(f"hfzero: mlp_tiles={tiles!r} must be an integer >= 2 to tile the MLPs")
    if getattr(model, _ATTR, None) is not None:
        raise ConfigError("hfzero: the MLPs of this model are tiled already")
    mlps = mlp_modules(model)
    if not mlps:
        raise ConfigError(f"hfzero: mlp_tiles needs a transformer whose layers have an ``mlp`` module; "
                          f"{type(model).__name__} has none (leave mlp_tiles at 1)")
    experts = [type(m).__name__ for m in mlps if hasattr(m, "experts")]
    if experts:
        raise ConfigError(f"hfzero: mlp_tiles does not tile mixture-of-experts blocks ({experts[0]}): their router "
                          "outputs (auxiliary loss, captured router logits) are per call, not per position; leave "
                          "mlp_tiles at 1 for this model")
    installed = installed or Installed()
    for mlp in mlps:
        installed.set_attr(mlp, "forward", _tiled(mlp.forward, tiles, type(mlp).__name__))
    installed.set_attr(model, _ATTR, tiles)
    return len(mlps)


def mlp_tiles_of(model: nn.Module) -> int:
    """The tiles ``model``'s MLPs run in (1: untiled)."""
    return getattr(model, _ATTR, None) or 1
