"""What the estimators share: their error type and the shape of a transformer read from a Hugging Face config.

``estimate.py`` (the memory model) and ``activations.py`` (the activation model) both use these; keeping them here
lets each import the other's pieces in one direction only (estimate -> activations -> shapes).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any


class EstimateError(ValueError):
    """An input to the estimator is invalid or unreadable; the message names it and what to do."""


def load_hf_config(source: Any) -> Any:
    """A ``transformers.PretrainedConfig`` from a config object, a ``config.json`` path or a local
    model directory holding one. Reads local files only (no hub, no network).

    Raises:
        EstimateError: the file is missing, is not valid JSON, or names no known ``model_type``.
    """
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(source, PretrainedConfig):
        return source
    path = os.path.join(source, "config.json") if os.path.isdir(source) else os.fspath(source)
    if not os.path.isfile(path):
        raise EstimateError(f"config file {path!r} not found; pass a config.json or a model directory holding one")
    try:
        with open(path, encoding="utf-8") as handle:
            values = json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EstimateError(f"cannot read {path!r} as JSON ({exc}); pass a valid Hugging Face config.json") from None
    if not isinstance(values, dict) or "model_type" not in values:
        raise EstimateError(f"{path!r} has no \"model_type\" key; pass a Hugging Face config.json")
    model_type = values.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **values)
    except (ValueError, TypeError, KeyError) as exc:
        raise EstimateError(f"{path!r}: cannot build a config for model_type {model_type!r} ({exc})") from None


@dataclass(frozen=True, kw_only=True)
class TransformerShape:
    """The sizes of a decoder-only transformer that set its activation memory.

    Attributes:
        hidden_size: h, the model width.
        num_layers: L, the transformer layers.
        num_heads: a, the attention heads.
        vocab_size: V, the output vocabulary.
        ffn_size: the MLP's inner width (4h in GPT-style models).
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    ffn_size: int

    @classmethod
    def from_hf_config(cls, source: Any) -> "TransformerShape":
        """Read the shape from a Hugging Face config (object, config.json or model directory), using
        its standard attribute names (``hidden_size``, ``num_hidden_layers``, ...; GPT-2's ``n_embd``
        etc. map onto them). The MLP width is ``intermediate_size`` or ``n_inner`` when set, else 4h.

        Raises:
            EstimateError: the config lacks one of these sizes (not a decoder transformer).
        """
        config = load_hf_config(source)
        sizes: dict[str, int] = {}
        for field, attr in (("hidden_size", "hidden_size"), ("num_layers", "num_hidden_layers"),
                            ("num_heads", "num_attention_heads"), ("vocab_size", "vocab_size")):
            value = getattr(config, attr, None)
            if not isinstance(value, int) or value < 1:
                raise EstimateError(
                    f"{type(config).__name__} has no positive integer {attr!r}; the activation estimate needs a "
                    "decoder transformer config (hidden_size, num_hidden_layers, num_attention_heads, vocab_size)"
                )
            sizes[field] = value
        ffn = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
        return cls(**sizes, ffn_size=int(ffn) if ffn else 4 * sizes["hidden_size"])
