"""Sharded checkpoints: save/load at any world size and stage, and export to a Hugging Face directory.

- ``save_checkpoint(dir, model, optimizer, extra=...)``: every rank writes its own shard, atomically.
- ``load_checkpoint(dir, model, optimizer) -> extra``: validates, then reshards on the fly.
- ``save_checkpoint_node_local`` / ``load_checkpoint_node_local``: the same without a file system every rank
  sees (each node keeps its own ranks' files; see node_local.py).
- ``wait_for_save()``: wait for an asynchronous save (``ZeroConfig.async_save``); raise its failure.
- ``consolidate(ckpt_dir, out_dir, max_shard_size=...)``: a ``from_pretrained``-loadable directory.

The format is described in docs/checkpoints.md and hfzero/checkpoint/format.py.
"""

from hfzero.checkpoint.background import wait as wait_for_save
from hfzero.checkpoint.consolidate import ConsolidateResult, consolidate
from hfzero.checkpoint.errors import CheckpointError
from hfzero.checkpoint.format import FORMAT_VERSION
from hfzero.checkpoint.load import load_checkpoint
from hfzero.checkpoint.node_local import load_checkpoint_node_local, save_checkpoint_node_local
from hfzero.checkpoint.save import save_checkpoint

__all__ = ["CheckpointError", "ConsolidateResult", "FORMAT_VERSION", "consolidate", "load_checkpoint",
           "load_checkpoint_node_local", "save_checkpoint", "save_checkpoint_node_local", "wait_for_save"]
