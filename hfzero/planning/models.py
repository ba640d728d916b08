"""The estimators applied to a live model: which update rule its optimizer runs and its activation estimate.

Shared by the profile header (what the run is predicted to hold) and ``--zero_stage auto`` (autostage.py). Both
read attributes only: no collective, no tensor allocated.
"""

from __future__ import annotations

from typing import Any

import torch

from hfzero.logging import get_logger

logger = get_logger(__name__)


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str | None:
    """The estimator's name for ``optimizer``'s update rule ("adam", "sgd_momentum", "sgd"), or None.

    Read from the first parameter group's hyperparameters, which a sharded optimizer keeps from the
    optimizer it wraps: Adam-family groups carry ``betas``, SGD groups ``momentum``.
    """
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    if "betas" in group:
        return "adam"
    if "momentum" in group:
        return "sgd_momentum" if group["momentum"] else "sgd"
    return None


def model_activation_estimate(model: torch.nn.Module, zero: Any, batch_size: int, seq_len: int, *,
                              dtype: str | int, device: torch.device) -> Any:
    """The decoder activation model's ``DecoderActivationEstimate`` for ``model`` trained under the
    ZeRO config ``zero`` (its ``tp_size``, ``partition_activations``, ``cpu_checkpointing``; the model's
    own checkpointing flag), or None (logged) when ``model`` is not a whole transformers model whose
    config the model reads. Shared by the profile header and ``--zero_stage auto``. Reads attributes only."""
    from transformers import PreTrainedModel

    from hfzero.planning import estimate as est

    config = getattr(model, "config", None)
    if not isinstance(model, PreTrainedModel) or config is None:
        # e.g. a pipeline stage: it carries the whole model's config but holds some of its layers
        logger.debug("no decoder activation estimate: %s is not a whole transformers model", type(model).__name__)
        return None
    flag = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else "is_gradient_checkpointing"
    checkpointing = bool(getattr(model, flag, False))  # transformers 5 renamed it (the old name warns)
    try:
        if est.is_encoder_config(config):  # BERT, RoBERTa, BART, T5 families: See [Note: encoder activation model]
            head = "classifier" if "SequenceClassification" in type(model).__name__ else "lm"
            return est.encoder_activation_bytes(
                est.EncoderShape.from_hf_config(config, head=head), seq_len, batch_size, dtype=dtype,
                attention=getattr(config, "_attn_implementation", None), checkpointing=checkpointing,
                tp=int(getattr(zero, "tp_size", 1) or 1),
                cpu=checkpointing and bool(getattr(zero, "cpu_checkpointing", False)), device=device.type)
        shape = est.DecoderShape.from_hf_config(config)
        return est.decoder_activation_bytes(
            shape, seq_len, batch_size, dtype=dtype, attention=getattr(config, "_attn_implementation", None),
            checkpointing=checkpointing, tp=int(getattr(zero, "tp_size", 1) or 1),
            partition=checkpointing and bool(getattr(zero, "partition_activations", False)),
            cpu=checkpointing and bool(getattr(zero, "cpu_checkpointing", False)), device=device.type)
    except est.EstimateError as err:
        logger.info("no activation estimate for %s: %s", type(model).__name__, err)
        return None
