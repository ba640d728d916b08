"""Batches of a split sequence: every rank of an SP group takes the same samples and its own chunk.

[Note: sequence-parallel batches]
``split_batch`` turns a whole batch (B, T) into rank ``sp_rank``'s chunk of T' / S positions, T' = T
rounded up to a multiple of S:
- labels are shifted on the whole sequence first (position t predicts token t + 1; the last position
  predicts nothing, -100), so the chunk boundaries lose no target. The model gets them as ``shift_labels``
  (transformers' causal-LM loss then does not shift again) and ``labels``;
- a right-padding ``attention_mask`` becomes ignored labels (-100) and is dropped: under a causal mask
  padding on the right changes no earlier position, so the loss is unchanged. Left or inner padding is
  refused (it needs a mask, which is not built for a split sequence: attention.py);
- T' - T extra positions are padded with ``pad_token_id`` and label -100: the loss is unchanged;
- ``position_ids`` are the global ones (the user's, else 0..T'-1 as one (1, T') row shared by the batch),
  so RoPE sees the whole sequence;
- ``num_items_in_batch`` counts the targets of the whole batch (every rank of the group computes the
  same count from the same samples, no collective), so each rank's loss is its chunk's sum over the
  group's count: the token-weighted mean over the SP group (see loss.py).
The checks read the tensors on the host: split batches where they are built (a collator, on CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from hfzero.config import ConfigError

IGNORE = -100


def shift_labels(labels: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) labels of the whole sequence shifted left by one (position t -> label t + 1), -100 last and
    wherever the target is padding (``attention_mask`` 0, right padding only)."""
    shifted = torch.full_like(labels, IGNORE)
    shifted[:, :-1] = labels[:, 1:]
    if attention_mask is not None:
        mask = attention_mask.bool()
        if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
            raise ConfigError("hfzero sequence parallelism: the attention_mask pads on the left (or inside) a "
                              "sequence; only right padding is supported (padding_side='right'), since no mask "
                              "is built for a split sequence")
        shifted[:, :-1].masked_fill_(~mask[:, 1:], IGNORE)
    return shifted


def split_batch(batch: Mapping[str, Any], sp_rank: int, sp_size: int, *, pad_token_id: int = 0) -> dict[str, Any]:
    """Rank ``sp_rank``'s chunk of a whole causal-LM batch. See [Note: sequence-parallel batches]."""
    if "input_ids" not in batch:
        raise ConfigError("hfzero sequence parallelism: the batch has no input_ids (inputs_embeds are not split)")
    unknown = sorted(set(batch) - {"input_ids", "labels", "attention_mask", "position_ids"})
    if unknown:
        raise ConfigError(f"hfzero sequence parallelism: batch keys {unknown} cannot be split along the sequence; "
                          "give input_ids, labels, attention_mask (right padding) and position_ids only")
    ids = batch["input_ids"]  # (B, T)
    labels = batch.get("labels")
    targets = shift_labels(ids if labels is None else labels, batch.get("attention_mask"))
    positions = batch.get("position_ids")
    if positions is None:  # (1, T): the rotary tables are computed once, not once per row
        positions = torch.arange(ids.shape[1], device=ids.device)[None]
    pad = -ids.shape[1] % sp_size
    if pad:
        ids = torch.nn.functional.pad(ids, (0, pad), value=pad_token_id)
        targets = torch.nn.functional.pad(targets, (0, pad), value=IGNORE)
        extra = positions[:, -1:] + torch.arange(1, pad + 1, device=positions.device)
        positions = torch.cat([positions, extra], dim=1)
    chunk = slice(sp_rank * (ids.shape[1] // sp_size), (sp_rank + 1) * (ids.shape[1] // sp_size))
    mine = targets[:, chunk].contiguous()  # (B, T' / S)
    return {"input_ids": ids[:, chunk].contiguous(), "labels": mine, "shift_labels": mine,
            "position_ids": positions[:, chunk].contiguous(), "num_items_in_batch": (targets != IGNORE).sum()}


class SequenceCollator:
    """A collator that splits what ``collate`` builds (the whole batch) into this rank's chunk.

    Attributes:
        collate: the collator of whole batches (e.g. transformers' DataCollatorForLanguageModeling).
        sp_rank, sp_size: this rank's chunk and the SP group's size.
        pad_token_id: the token padding the sequence to a multiple of sp_size (its labels are ignored).
    """

    def __init__(self, collate: Callable[[list[Any]], Mapping[str, Any]], sp_rank: int, sp_size: int,
                 pad_token_id: int = 0) -> None:
        self.collate, self.sp_rank, self.sp_size, self.pad_token_id = collate, sp_rank, sp_size, pad_token_id

    def __call__(self, features: list[Any]) -> dict[str, Any]:
        return split_batch(self.collate(features), self.sp_rank, self.sp_size, pad_token_id=self.pad_token_id)
