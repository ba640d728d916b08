"""Bad input gets a clear error naming the problem and what to do."""

from __future__ import annotations

import pytest
import torch

import hfzero
from hfzero.testing import run_distributed
from hfzero.testing.models import tiny_causal_lm


@pytest.mark.parametrize("field,value", [
    ("stage", 5), ("dtype", "fp8"), ("reduce_bucket_size", -1), ("allgather_bucket_size", -1), ("reduce_bucket_size", 1.5),
    ("overlap_comm", "yes"), ("loss_scale", -1.0), ("reduce_scatter_impl", "magic"),
    ("param_persistence_threshold", -1), ("max_inflight_buckets", 0),
])
def test_invalid_config_value_names_field(field, value):
    with pytest.raises(hfzero.ConfigError, match=field):
        hfzero.ZeroConfig(**{field: value})


def test_unknown_option_lists_valid_ones():
    with pytest.raises(hfzero.ConfigError, match="valid options are.*stage"):
        hfzero.ZeroConfig.from_dict({"stag": 2})
    with pytest.raises(hfzero.ConfigError, match="cannot read 'two' as int"):
        hfzero.ZeroConfig.from_strings({"stage": "two"})


def test_optimizer_over_other_parameters():
    model = tiny_causal_lm("gpt2")
    other = torch.nn.Linear(3, 3)
    optimizer = torch.optim.AdamW(list(model.parameters()) + list(other.parameters()))
    with pytest.raises(hfzero.ConfigError, match="not a parameter of the model"):
        hfzero.prepare(model, optimizer, hfzero.ZeroConfig(stage=1))


def test_world_size_without_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = tiny_causal_lm("gpt2")
    with pytest.raises(RuntimeError, match="init_process_group"):
        hfzero.prepare(model, torch.optim.AdamW(model.parameters()), hfzero.ZeroConfig())


def test_non_elementwise_optimizer_is_refused():
    model = tiny_causal_lm("gpt2")
    with pytest.raises(hfzero.ConfigError, match="element-wise"):
        hfzero.prepare(model, torch.optim.LBFGS(model.parameters()), hfzero.ZeroConfig())


def test_stepped_optimizer_is_refused():
    model = tiny_causal_lm("gpt2")
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.zeros(1, 4, dtype=torch.long)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    with pytest.raises(hfzero.ConfigError, match="already has state"):
        hfzero.prepare(model, optimizer, hfzero.ZeroConfig())


def test_prepare_twice_is_refused():
    model = tiny_causal_lm("gpt2")
    model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters()), hfzero.ZeroConfig())
    with pytest.raises(hfzero.ConfigError, match="already prepared"):
        hfzero.prepare(model, torch.optim.AdamW(model.parameters()), hfzero.ZeroConfig())


def test_fp16_needs_scaled_backward():
    model = tiny_causal_lm("gpt2")
    model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters()),
                                      hfzero.ZeroConfig(stage=2, dtype="fp16"))
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(RuntimeError, match=r"optimizer.backward\(loss\)"):
        model(input_ids=ids, labels=ids).loss.backward()


def _mismatched(rank: int, world: int) -> str:
    model = tiny_causal_lm("gpt2")
    config = hfzero.ZeroConfig(stage=2 if rank == 0 else 1)
    try:
        hfzero.prepare(model, torch.optim.AdamW(model.parameters()), config)
    except hfzero.ConfigError as err:
        return str(err)
    return "no error"


def test_mismatched_configs_across_ranks():
    messages = run_distributed(_mismatched, 2, timeout=120)
    for message in messages:
        assert "ranks disagree" in message and "stage=1 (rank 0: 2)" in message, message
