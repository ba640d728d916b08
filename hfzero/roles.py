"""Memory roles: one enum shared by the engine, the profiler and the dashboard.

Each role names a kind of tensor memory the engine holds. Model states (the paper's term) are the
parameters, gradients and optimizer states in the form the stage keeps them; everything else is
transient and bounded separately (ZeRO-R's constant-size buffers).
"""

from __future__ import annotations

import enum


class MemoryRole(str, enum.Enum):
    """What a block of engine-held memory is for.

    Attributes:
        PARAM_FULL: unsharded 16-bit (or fp32) parameters resident on every rank (stages 0-2, and
            stage-3 parameters below the persistence threshold). Frozen parameters count here.
        PARAM_SHARD: this rank's slice of the flat parameters (stage 3).
        GRAD_FULL: full gradients kept until the step (stages 0-1): a flat buffer shaped like the
            trainable parameters.
        GRAD_SHARD: this rank's slice of the reduced gradients (stages 2-3).
        GRAD_ACCUM: full local gradients accumulated across micro-batches before their one
            reduction (the "local" accumulation policy at stages 2-3): held across micro-batches,
            so a model state.
        MASTER_SHARD: fp32 master weights for this rank's slice (mixed precision only; in fp32
            the parameters are their own master copy).
        OPTIM_STATE: optimizer states (e.g. Adam's exp_avg and exp_avg_sq) for this rank's slice.
        GRAD_BUCKET: gradients waiting in a fixed-size bucket for their reduction within one
            backward pass (transient staging).
        GRAD_FP32: fp32 gradients of the rank's slice, materialized between the end of
            accumulation and the optimizer step (transient).
        PARAM_GATHERED: stage-3 units gathered for compute (transient).
        PARAM_SECONDARY: hpZ's secondary partition (``secondary_partition``, stage 3): the node-local
            slices of the units a training forward released, kept for their backward gathers inside the
            node; at most (Ψ - P) / ranks_per_node elements, held within one micro-batch (transient).
        COMM_BUFFER: communication scratch buffers (transient).
        ACT_CHECKPOINT: activation checkpoints kept for the backward pass, as stored (a 1/tp slice
            with partition_activations, in host memory with cpu_checkpointing); measured by hfzero's
            checkpoint function (transient).
        ACTIVATIONS: other tensors saved for the backward pass (autograd's saved tensors, parameters
            and checkpoints excluded), measured with saved-tensor hooks (transient).
        CKPT_STAGING: host memory an asynchronous checkpoint save (``ZeroConfig.async_save``) copies the
            rank's shard into (fp32 master and optimizer-state slices, RNG states, persistent buffers), so
            the step can go on while a background thread writes it; allocated at the first such save and
            reused by the next ones: held across steps, so a model state (in host memory).
        QUANT_RESIDUAL: qgZ's error-feedback residuals (``quantize_error_feedback``): per bucket and hop, the fp32
            quantization error of what this rank last sent, added to the next reduction; the padded parameter
            count for the intra-node hop (groups with several ranks per node) plus 1/L of it for the inter-node hop
            (groups spanning nodes), per rank; held across steps, so a model state.
    """

    PARAM_FULL = "param_full"
    PARAM_SHARD = "param_shard"
    GRAD_FULL = "grad_full"
    GRAD_SHARD = "grad_shard"
    GRAD_ACCUM = "grad_accum"
    MASTER_SHARD = "master_shard"
    OPTIM_STATE = "optim_state"
    GRAD_BUCKET = "grad_bucket"
    GRAD_FP32 = "grad_fp32"
    PARAM_GATHERED = "param_gathered"
    COMM_BUFFER = "comm_buffer"
    ACT_CHECKPOINT = "act_checkpoint"
    ACTIVATIONS = "activations"
    CKPT_STAGING = "ckpt_staging"
    PARAM_SECONDARY = "param_secondary"
    QUANT_RESIDUAL = "quant_residual"


MODEL_STATE_ROLES: frozenset[MemoryRole] = frozenset(
    {
        MemoryRole.PARAM_FULL,
        MemoryRole.PARAM_SHARD,
        MemoryRole.GRAD_FULL,
        MemoryRole.GRAD_SHARD,
        MemoryRole.GRAD_ACCUM,
        MemoryRole.MASTER_SHARD,
        MemoryRole.OPTIM_STATE,
        MemoryRole.CKPT_STAGING,
        MemoryRole.QUANT_RESIDUAL,
    }
)
"""Roles that make up the paper's "model states"; the rest are transient."""
