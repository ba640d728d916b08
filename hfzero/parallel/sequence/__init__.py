"""Sequence parallelism (Ulysses-style) x ZeRO: each sequence split over the sp_size ranks of an SP group.

- mesh.py: the dp x sp mesh (SP ranks neighbours);
- alltoall.py: the differentiable sequence <-> head all-to-all;
- attention.py: the attention registered in transformers' AttentionInterface ([Note: sequence-parallel
  attention]);
- data.py: batches split along the sequence ([Note: sequence-parallel batches]);
- loss.py: the token-weighted loss and why gradients are summed over the SP group and averaged over the dp
  replicas ([Note: sequence-parallel gradients]);
- tiled_loss.py: logits + loss in slices of the sequence ([Note: tiled loss]; usable without SP);
- prepare.py: ``prepare_sequence_parallel`` (mesh, attention, hooks, then ``hfzero.prepare``).
ZeRO runs over the whole world: an SP group is a data-parallel group for the optimizer (its ranks hold
identical replicas and their gradient parts add up), so model states are sharded over dp x sp ranks.
See docs/sequence.md.
"""

from hfzero.parallel.sequence.attention import NAME, apply_sequence_attention, kv_replication
from hfzero.parallel.sequence.data import SequenceCollator, shift_labels, split_batch
from hfzero.parallel.sequence.loss import group_loss
from hfzero.parallel.sequence.mesh import SequenceMesh, build_sp_mesh, check_sp_size
from hfzero.parallel.sequence.prepare import install_sequence_parallel, prepare_sequence_parallel
from hfzero.parallel.sequence.tiled_loss import enable_tiled_loss

__all__ = ["NAME", "SequenceCollator", "SequenceMesh", "apply_sequence_attention", "build_sp_mesh", "check_sp_size",
           "enable_tiled_loss",
           "group_loss", "install_sequence_parallel", "kv_replication", "prepare_sequence_parallel", "shift_labels",
           "split_batch"]
