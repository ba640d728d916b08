"""Stage 3 never lets a model be saved empty: model.state_dict() is refused while parameters are
partitioned, and hfzero.full_state_dict gives the whole tensors to save instead."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import hfzero
from hfzero.testing.models import tiny_causal_lm


def test_state_dict_refused_full_state_dict_saves_a_loadable_model(tmp_path):
    reference = tiny_causal_lm("gpt2")
    model = tiny_causal_lm("gpt2")
    model, _ = hfzero.prepare(model, torch.optim.AdamW(model.parameters()),
                              hfzero.ZeroConfig(stage=3, param_persistence_threshold=0))
    with pytest.raises(RuntimeError, match="full_state_dict"):
        model.state_dict()
    with pytest.raises(RuntimeError, match="full_state_dict"):
        model.transformer.h[0].state_dict()  # a submodule's state dict would be empty too
    with pytest.raises(RuntimeError, match="full_state_dict"):
        model.save_pretrained(tmp_path / "empty")
    full = hfzero.full_state_dict(model)
    model.save_pretrained(tmp_path / "full", state_dict=full)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "full")
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, atol=0, rtol=0)
