"""Tiled logits + loss for causal LMs: the vocabulary projection of a long sequence without its full logits.

[Note: tiled loss]
A causal LM's forward projects every position to the vocabulary (B, T, V) and takes the cross entropy; at
long T that tensor (and its fp32 log-softmax, saved for backward) is often the step's peak. With
``enable_tiled_loss(model, tiles)`` a forward given labels runs the decoder, then for each of ``tiles``
slices of the positions computes that slice's logits and summed token losses under a non-reentrant
checkpoint: the slice's logits are freed as soon as its loss is computed and recomputed, one slice at a
time, in backward. Live: one slice's logits and log-softmax (B x T/tiles x V, fp32), never T's. The loss
is the sum over slices divided by the target count (``num_items_in_batch`` when given, as transformers'
loss divides, else the count of targets): the same value and gradients as the untiled loss, up to
summation order. Such a forward returns no logits (``logits=None``); without labels (generation,
evaluation with metrics) the model's own forward runs. Labels are shifted on the whole sequence (or taken
as ``shift_labels``, e.g. from split_batch under sequence parallelism). Works with or without SP; under SP
T is the rank's chunk.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hfzero.config import ConfigError
from hfzero.parallel.sequence.data import IGNORE, shift_labels as shift_whole
from hfzero.runtime.lifetime import Installed

_ATTR = "hfzero_loss_tiles"


def _tile_loss(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()  # (B, t, V)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE,
                           reduction="sum")


def enable_tiled_loss(model: nn.Module, tiles: int, installed: Installed | None = None) -> None:
    """Compute ``model``'s logits and loss in ``tiles`` slices of the sequence (in place; see [Note: tiled loss]).
    ``installed``: where the patched ``forward`` is recorded, to be restored by ``hfzero.unprepare``."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if not isinstance(tiles, int) or isinstance(tiles, bool) or tiles < 2:
        raise ConfigError(f"hfzero: loss_tiles={tiles!r} must be an integer >= 2 to tile the loss")
    if getattr(model, _ATTR, None) is not None:
        raise ConfigError("hfzero: the loss of this model is tiled already")
    config = getattr(model, "config", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    decoder = getattr(model, "model", None)
    if head is None or not isinstance(decoder, nn.Module) or getattr(config, "is_encoder_decoder", False):
        raise ConfigError(f"hfzero: tiled loss needs a decoder-only causal LM (model.model + an output embedding); "
                          f"{type(model).__name__} is not one")
    for name in ("final_logit_softcapping", "logit_scale"):
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise ConfigError(f"hfzero: tiled loss does not apply config.{name}; leave loss_tiles at 1 for this model")
    untiled = model.forward

    @functools.wraps(untiled)
    def forward(input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        targets = kwargs.pop("shift_labels", None)
        if (labels is None and targets is None) or kwargs.get("return_dict") is False:
            return untiled(input_ids=input_ids, labels=labels, shift_labels=targets, **kwargs)
        count = kwargs.pop("num_items_in_batch", None)
        for unsupported in ("logits_to_keep", "use_cache"):
            kwargs.pop(unsupported, None)
        out = decoder(input_ids=input_ids, use_cache=False, **kwargs)
        hidden = out.last_hidden_state  # (B, T, h)
        targets = shift_whole(labels) if targets is None else targets  # (B, T)
        bounds = torch.linspace(0, hidden.shape[1], tiles + 1).round().long().tolist()  # host ints, no device sync
        total = hidden.new_zeros((), dtype=torch.float32)
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            if hi > lo:
                total = total + torch.utils.checkpoint.checkpoint(_tile_loss, head, hidden[:, lo:hi], targets[:, lo:hi],
                                                                  use_reentrant=False)
        if count is None:
            count = (targets != IGNORE).sum()
        loss = total / count
        return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=out.hidden_states,
                                      attentions=out.attentions)

    installed = installed or Installed()
    installed.set_attr(model, "forward", forward)
    installed.set_attr(model, _ATTR, tiles)
