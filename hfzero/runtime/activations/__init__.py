"""ZeRO-R activation memory: saved-tensor accounting, checkpointing through hfzero, P_a (partitioned
checkpoints over the tensor-parallel group) and P_a+cpu (checkpoints offloaded to the host)."""

from hfzero.runtime.activations.accounting import ActivationAccounting, LiveBytes
from hfzero.runtime.activations.checkpoint import CheckpointPolicy, HfzeroCheckpoint, enable_checkpointing

__all__ = ["ActivationAccounting", "CheckpointPolicy", "HfzeroCheckpoint", "LiveBytes", "enable_checkpointing"]
