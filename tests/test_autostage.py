"""`zero_stage="auto"`: the lowest stage whose per-rank memory fits the budget, as the estimator's table says
(three model sizes, an explicit budget), the accumulation buffer and activations counted, and a clear error
with every stage's figures when nothing fits. In process, no ranks: the world size is an argument."""

from __future__ import annotations

import logging

import pytest
import torch

from hfzero.planning import estimate as est
from hfzero.planning.autostage import activation_reserve, resolve_auto_stage
from hfzero.config import ConfigError, ZeroConfig
from hfzero.planning.estimate import EstimateError
from hfzero.testing.models import tiny_causal_lm

BUDGET = 500_000  # bytes per rank: fp32 + AdamW GPT-2s of 1, 2 and 4 layers need stages 0, 1 and 3 at world 2


def _resolve(model: torch.nn.Module, budget: int, **kwargs) -> ZeroConfig:
    optimizer = torch.optim.AdamW(model.parameters())
    config = ZeroConfig(stage="auto", memory_budget_bytes=budget, param_persistence_threshold=0)
    return resolve_auto_stage(config, model, optimizer, world_size=2, **kwargs)


@pytest.mark.parametrize("layers, stage", [(1, 0), (2, 1), (4, 3)])
def test_auto_picks_the_estimators_stage(layers: int, stage: int, caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_causal_lm("gpt2", layers=layers)
    psi = sum(p.numel() for p in set(model.parameters()))
    rows = est.stage_table(psi, 2, BUDGET, param_bytes=4, grad_bytes=4, optimizer_k=8)
    assert est.pick_stage(rows, BUDGET) == stage
    with caplog.at_level(logging.INFO, logger="hfzero"):
        config = _resolve(model, BUDGET)
    assert config.stage == stage and isinstance(config.stage, int)
    assert f"zero_stage auto: stage {stage}" in caplog.text and "budget 0.5 MB per rank" in caplog.text


def test_auto_counts_activations_and_frozen_parameters() -> None:
    model = tiny_causal_lm("gpt2", layers=1)
    assert _resolve(model, BUDGET).stage == 0
    assert _resolve(model, BUDGET, batch=(2, 32)).stage > 0  # the activation estimate takes room
    frozen_model = tiny_causal_lm("gpt2", layers=4)
    for p in frozen_model.transformer.h.parameters():
        p.requires_grad_(False)  # frozen: parameter bytes only, no gradient or optimizer state
    optimizer = torch.optim.AdamW([p for p in frozen_model.parameters() if p.requires_grad])
    config = resolve_auto_stage(ZeroConfig(stage="auto", memory_budget_bytes=BUDGET), frozen_model, optimizer,
                                world_size=2)
    assert config.stage == 0  # the 4-layer model needs stage 3 when everything trains


def _picks(psi: int, budget: float, activations: float) -> int:
    rows = est.stage_table(psi, 2, budget, activation_bytes=activations, param_bytes=4, grad_bytes=4, optimizer_k=8)
    return est.pick_stage(rows, budget)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_auto_reserves_the_decoder_activation_model(checkpointing: bool, caplog: pytest.LogCaptureFixture) -> None:
    # a Llama whose decoder-model figure and older per-layer (Korthikanti) figure pick different stages
    model = tiny_causal_lm("llama", layers=2)
    if checkpointing:
        model.activation_checkpointing_enable()
    psi = sum(p.numel() for p in set(model.parameters()))
    batch, seq = 2, 32
    decoder = est.decoder_activation_bytes(est.DecoderShape.from_hf_config(model.config), seq, batch, dtype=4,
                                           checkpointing=checkpointing, device="cpu").total
    older = est.activation_bytes(est.TransformerShape.from_hf_config(model.config), seq, batch, dtype_bytes=4,
                                 checkpointing=checkpointing).total
    budget = 620_000 if not checkpointing else 600_000
    assert _picks(psi, budget, decoder) != _picks(psi, budget, older)
    with caplog.at_level(logging.INFO, logger="hfzero"):
        config = _resolve(model, budget, batch=(batch, seq))
    assert config.stage == _picks(psi, budget, decoder)
    assert "activations from the decoder activation model" in caplog.text
    assert f"activations {decoder / 1e6:,.1f} MB" in caplog.text


def test_auto_falls_back_to_the_per_layer_estimate() -> None:
    # not a transformers model (e.g. a wrapper): the older per-layer estimate of its config's transformer
    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = tiny_causal_lm("llama", layers=2)
            self.config = self.inner.config

    model = Wrapper()
    reserve, source = activation_reserve(model, ZeroConfig(), (2, 32), 4, torch.device("cpu"))
    older = est.activation_bytes(est.TransformerShape.from_hf_config(model.config), 32, 2, dtype_bytes=4).total
    assert (reserve, source) == (older, "per-layer estimate")
    assert activation_reserve(torch.nn.Linear(2, 2), ZeroConfig(), (2, 32), 4, torch.device("cpu")) == (0.0, "none")


def test_accumulation_buffer_is_counted_under_local_policy() -> None:
    # the engine holds the whole accumulator beside the shard (tests/test_memory_and_comm.py measures it)
    assert est.accumulation_bytes(1000, 2, 2, grad_bytes=2, accumulation="local", accumulation_steps=4) == 2000
    assert est.accumulation_bytes(1000, 2, 2, grad_bytes=2, accumulation="auto", accumulation_steps=4) == 0
    assert est.accumulation_bytes(1000, 2, 1, grad_bytes=2, accumulation="local", accumulation_steps=4) == 0
    assert est.accumulation_bytes(1000, 2, 3, grad_bytes=2, accumulation="local", accumulation_steps=1) == 0


def test_auto_errors_with_the_numbers_when_nothing_fits() -> None:
    with pytest.raises(EstimateError, match=r"no ZeRO stage fits(.|\n)*stage 3: model states 0\.2 MB"):
        _resolve(tiny_causal_lm("gpt2", layers=1), 10_000)


def test_auto_in_config_and_prepare() -> None:
    assert ZeroConfig.from_strings({"stage": "auto", "memory_budget_bytes": "1000"}).stage == "auto"
    with pytest.raises(ConfigError, match="stage must be 0, 1, 2, 3 or \"auto\""):
        ZeroConfig(stage="best")
    import hfzero

    model = tiny_causal_lm("gpt2", layers=1)
    with pytest.raises(ConfigError, match="must be resolved first"):
        hfzero.prepare(model, torch.optim.AdamW(model.parameters()), ZeroConfig(stage="auto"))


FREE = {0: 10**9, 1: None}  # rank 1's free memory is set in the worker: only the resident bytes make it fit


def _auto_worker(rank: int, world: int) -> dict:
    from hfzero import autostage

    model = tiny_causal_lm("gpt2", layers=2)
    resident = autostage.resident_bytes(model, torch.device("cpu"))
    fits_stage1 = BUDGET / (1 - est.DEFAULT_HEADROOM)  # the measured bytes that leave BUDGET after headroom
    free = {0: FREE[0], 1: fits_stage1 - resident}[rank]
    autostage.free_bytes = lambda device, ranks: free  # this rank's probe: ranks measure different figures
    config = ZeroConfig(stage="auto", param_persistence_threshold=0)
    picked = resolve_auto_stage(config, model, torch.optim.AdamW(model.parameters()), world_size=world).stage
    alone = autostage.device_budget_bytes(torch.device("cpu"), 1, resident)
    return {"stage": picked, "resident": resident, "alone": alone}


def test_measured_budget_adds_resident_parameters_and_takes_the_min_over_ranks() -> None:
    """Rank 0 measures 1 GB free (stage 0 alone), rank 1 just what stage 1 needs once its loaded parameters
    (resident, counted by the table as model states) are added back; both pick stage 1."""
    from hfzero.testing.spawn import run_distributed

    ranks = run_distributed(_auto_worker, 2)
    psi = sum(p.numel() for p in set(tiny_causal_lm("gpt2", layers=2).parameters()))
    assert ranks[0]["resident"] == 4 * psi  # fp32 parameters, the tied embedding once
    rows = est.stage_table(psi, 2, BUDGET, param_bytes=4, grad_bytes=4, optimizer_k=8)
    assert est.pick_stage(rows, BUDGET) == 1
    assert [r["stage"] for r in ranks] == [1, 1]
    assert ranks[0]["alone"] == FREE[0] + ranks[0]["resident"]
