"""Activations in the profiler and checkpointing through hfzero, on one process (no spawn).

The saved-tensor measurement of a tiny GPT-2 is compared with the estimator's activation model; the
test model is chosen so the estimator's assumptions hold (a 4h MLP with exact GELU, eager attention,
no dropout: the estimator still counts dropout masks, so it leans high by 2 bytes of 66 per s*b*h).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import hfzero
from hfzero.config import ConfigError
from hfzero.estimate import TransformerShape, activation_bytes
from hfzero.profiler import ZeroProfiler, load_run

SEQ, BATCH, HIDDEN, LAYERS, VOCAB = 16, 2, 128, 2, 128


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=HIDDEN, n_layer=LAYERS, n_head=4,
                        activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    config._attn_implementation = "eager"
    model = GPT2LMHeadModel(config)
    model.config.use_cache = False
    return model


def _profiled_step(tmp_path, checkpointing: bool, **options) -> tuple[dict, list[float]]:
    """One profiled training step; returns the step record's role peaks and the parameters after it."""
    model = _gpt2().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = hfzero.prepare(model, optimizer, hfzero.ZeroConfig(stage=0, **options))
    if checkpointing:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with ZeroProfiler(model, optimizer, tmp_path / f"run{checkpointing}"):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    step = load_run(tmp_path / f"run{checkpointing}").ranks[0].of_kind("step")[0]
    return step["roles"], torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_measured_activations_match_the_estimate_and_checkpoints_are_the_layer_inputs(tmp_path) -> None:
    shape = TransformerShape.from_hf_config(_gpt2().config)
    plain, params_plain = _profiled_step(tmp_path, False)
    estimate = activation_bytes(shape, SEQ, BATCH, dtype_bytes=4)
    assert plain["activations"] == pytest.approx(estimate.total, rel=0.10)
    assert "act_checkpoint" not in plain

    ckpt, params_ckpt = _profiled_step(tmp_path, True, contiguous_checkpoints=True)
    # Each layer keeps its input, measured by hfzero's checkpoint function: L * e*s*b*h, plus the
    # (b, 1, s, s) attention mask all layers share, counted once.
    assert ckpt["act_checkpoint"] == LAYERS * 4 * SEQ * BATCH * HIDDEN + 4 * BATCH * SEQ * SEQ
    # Outside the checkpoints only the head's saved tensors remain (and the first layer's ids).
    assert ckpt["activations"] == pytest.approx(estimate.head, rel=0.10)
    torch.testing.assert_close(params_ckpt, params_plain, rtol=0, atol=0)


def test_partition_activations_without_tensor_parallelism_is_refused() -> None:
    with pytest.raises(ConfigError, match="nothing to partition"):
        hfzero.ZeroConfig(partition_activations=True)
    with pytest.raises(ConfigError, match="tp_size"):
        hfzero.ZeroConfig(tp_size=0)


def test_reentrant_checkpointing_is_refused() -> None:
    model = _gpt2()
    model, _ = hfzero.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), hfzero.ZeroConfig(stage=0))
    with pytest.raises(ConfigError, match="use_reentrant"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
