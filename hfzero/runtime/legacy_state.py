"""Optimizer state dicts of state format 1 (written before parameter slots were aligned), upgraded
to the running layout by ``ZeroOptimizer.load_state_dict``.

Format 1 packed the parameters of a bucket back to back (``FlatLayout.realigned(1)``); the
running layout starts each at a multiple of ``ALIGN`` elements (see [Note: slot alignment] in
layout.py). Bucket membership does not depend on the alignment, so both layouts have the same
buckets holding the same parameters; only offsets inside a bucket and each rank's slice differ.

Where the layout does not shard (stage 0, or world 1) each rank holds its buckets whole and moves
each parameter's elements locally. Where it shards, the elements a rank owns now may have been
another rank's: per bucket and per flat tensor (the fp32 master and each element-wise optimizer
state), every rank places its old slice in a zeroed old-layout bucket, one all-reduce (a sum with
zeros: exact) makes the whole old bucket on every rank, and each rank cuts out its new slice.
That is a collective, launched the same number of times on every rank: the layout is the same on all
of them, and one all-gather first checks that every rank's state holds the same state tensors (else
ConfigError on every rank). So every rank of the group must call ``load_state_dict``, as resuming
does anyway.
Transient memory: two fp32 buckets of ``reduce_bucket_size`` elements at a time.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from hfzero.config import ConfigError
from hfzero.runtime.engine import ZeroEngine
from hfzero.runtime.layout import Bucket, FlatLayout


def _old_layout(engine: ZeroEngine) -> FlatLayout:
    if len(engine.layout.partitions) > 1:  # written before expert parallelism existed: never one of its layouts
        raise ConfigError("hfzero: an optimizer state of format 1 cannot be loaded into an expert-parallel engine "
                          "(its buckets are sharded over two groups); load it without ep_size and save a hfzero "
                          "checkpoint (hfzero.checkpoint.save_checkpoint), which any layout can read")
    old = engine.layout.realigned(1)
    if [[s.param for s in b.slots] for b in old.buckets] != [[s.param for s in b.slots] for b in engine.layout.buckets]:
        raise ConfigError("hfzero: this optimizer state (format 1) has buckets other than the running layout's; "
                          "load it with the hfzero version that saved it and save a hfzero checkpoint "
                          "(hfzero.checkpoint.save_checkpoint), which any version and layout can read")
    return old


def _move(engine: ZeroEngine, old: FlatLayout, old_bucket: Bucket, new_bucket: Bucket,
          flat: torch.Tensor) -> torch.Tensor:
    """This rank's new-layout slice of ``new_bucket`` from its old-layout slice ``flat`` of the same bucket."""
    sharded = old.shard_world > 1
    if sharded:
        lo, hi = old_bucket.owned(engine.rank)
        whole = torch.zeros(old_bucket.padded, dtype=flat.dtype, device=engine.comm_device)
        whole[lo:hi].copy_(flat)
        engine.comm.all_reduce(whole)
    else:
        whole = flat
    new = torch.zeros(new_bucket.padded, dtype=flat.dtype, device=whole.device)
    for was, now in zip(old_bucket.slots, new_bucket.slots):
        new[now.offset: now.offset + now.numel].copy_(whole[was.offset: was.offset + was.numel])
    lo, hi = new_bucket.owned(engine.rank) if sharded else (0, new_bucket.padded)
    return new[lo:hi].to(flat.device)


def _is_flat(value: object, bucket: Bucket) -> bool:
    """An element-wise state of ``bucket`` (shaped like the rank's old slice), as opposed to a scalar."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == bucket.chunk


def upgrade_v1(engine: ZeroEngine, state_dict: dict[str, Any], buckets_of_index: list[int]) -> dict[str, Any]:
    """``state_dict`` (format 1, this rank's) with its flat tensors moved to the running layout.

    ``buckets_of_index[i]`` is the bucket of the inner optimizer's parameter ``i``.
    """
    old = _old_layout(engine)
    new_buckets = engine.layout.buckets
    out = dict(state_dict)
    master = state_dict.get("master")
    inner = state_dict["inner"]
    flat = {index: sorted(k for k, v in inner["state"].get(index, {}).items() if _is_flat(v, old.buckets[b]))
            for index, b in enumerate(buckets_of_index)}
    if old.shard_world > 1:  # the all-reduces below follow ``flat`` and ``master``: the same on every rank?
        mine = json.dumps([None if master is None else master.numel(), flat]).encode()
        if any(other != mine for other in engine.comm.all_gather_bytes(mine)):
            raise ConfigError("hfzero: the ranks' optimizer states (format 1) hold different tensors; each rank "
                              "must load the state dict its own rank saved, all from the same save")
    if master is not None:
        if master.numel() != old.shard_numel:
            raise ConfigError(f"hfzero: this optimizer state (format 1) holds {master.numel()} master elements, "
                              f"its layout {old.shard_numel}; it was saved from another model or configuration")
        moved = [_move(engine, old, b, n, master[b.shard_offset: b.shard_offset + b.chunk])
                 for b, n in zip(old.buckets, new_buckets)]
        out["master"] = torch.cat(moved) if moved else master
    states = {}
    for index, bucket_index in enumerate(buckets_of_index):
        saved = inner["state"].get(index)
        if saved is None:  # no step taken yet for this bucket
            continue
        was, now = old.buckets[bucket_index], new_buckets[bucket_index]
        states[index] = {k: _move(engine, old, was, now, v) if k in flat[index] else v for k, v in saved.items()}
    out["inner"] = {**inner, "state": states}
    return out
