"""The user's activation-checkpointing settings under hfzero, on one process (no spawn): honoured
(torch's keywords, transformers' offload as hfzero's cpu policy) or refused with one message (reentrant),
the same way whether checkpointing is enabled before or after ``hfzero.prepare``, and under the Trainer.
See [Note: the user's checkpoint settings] in runtime/activations/checkpoint.py.
"""

from __future__ import annotations

import contextlib
import re
import warnings

import pytest
import torch
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import hfzero
from hfzero.config import ConfigError
from hfzero.runtime.activations.checkpoint import REENTRANT_MESSAGE
from hfzero.testing.models import tiny_causal_lm

SEQ, BATCH = 8, 2


def _enable(model: torch.nn.Module, offload: bool = False, **kwargs) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, offload=offload)


def _prepared(before: dict | None = None, after: dict | None = None) -> torch.nn.Module:
    model = tiny_causal_lm("llama").train()
    if before is not None:
        _enable(model, **before)
    model, _ = hfzero.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), hfzero.ZeroConfig(stage=0))
    if after is not None:
        _enable(model, **after)
    return model


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    ids = torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    model(input_ids=ids, labels=ids).loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("kwargs", [{"use_reentrant": True}, {"preserve_rng_state": False}],
                         ids=["use_reentrant", "reentrant_by_default"])
def test_reentrant_is_refused_the_same_way_before_and_after_prepare(when: str, kwargs: dict) -> None:
    with pytest.raises(ConfigError, match=re.escape(REENTRANT_MESSAGE)):
        _prepared(**{when: kwargs})


@pytest.mark.parametrize("when", ["before", "after"])
def test_torch_keywords_are_honoured(when: str) -> None:
    """context_fn (selective checkpointing) runs, preserve_rng_state reaches torch, checkpoints are measured."""
    calls = []

    def context_fn():
        calls.append(1)
        return create_selective_checkpoint_contexts([torch.ops.aten.mm.default])

    settings = {"use_reentrant": False, "preserve_rng_state": False, "context_fn": context_fn}
    model = _prepared(**{when: settings})
    checkpoint = model.hfzero_checkpoint
    assert checkpoint.inner.keywords["preserve_rng_state"] is False
    reference = _grads(tiny_causal_lm("llama").train())
    got = _grads(model)
    assert calls, "context_fn was not called: the user's checkpoint function was replaced"
    assert checkpoint.stored.peak > 0  # hfzero still measures the checkpoints
    for g, r in zip(got, reference):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("when", ["before", "after"])
def test_transformers_offload_becomes_cpu_checkpointing(when: str, monkeypatch) -> None:
    monkeypatch.setenv("HFZERO_FORCE_CPU_CHECKPOINTING", "1")  # the host path runs on a CPU device
    model = _prepared(**{when: {"use_reentrant": False, "offload": True}})
    checkpoint = model.hfzero_checkpoint
    assert checkpoint.policy.cpu and not checkpoint.configured.cpu
    reference = _grads(tiny_causal_lm("llama").train())
    got = _grads(model)
    assert checkpoint.stored.peak > 0 and checkpoint._host_buffers, "offloaded checkpoints bypassed hfzero"
    for g, r in zip(got, reference):
        torch.testing.assert_close(g, r)
    _enable(model, use_reentrant=False)  # re-enabled without offload: back to the configured policy
    assert not model.hfzero_checkpoint.policy.cpu


def test_trainer_gradient_checkpointing_reentrant_is_refused(tmp_path) -> None:
    """--gradient_checkpointing with use_reentrant=True: the Trainer enables it before ZeroTrainer prepares."""
    args = hfzero.ZeroTrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2,
                                        report_to=[], use_cpu=True, gradient_checkpointing=True,
                                        gradient_checkpointing_kwargs={"use_reentrant": True}, zero_stage=1)
    ids = torch.randint(0, 128, (4, SEQ), generator=torch.Generator().manual_seed(3))
    data = [{"input_ids": row, "labels": row} for row in ids]
    trainer = hfzero.ZeroTrainer(model=tiny_causal_lm("llama"), args=args, train_dataset=data)
    with pytest.raises(ConfigError, match=re.escape(REENTRANT_MESSAGE)), contextlib.suppress(FutureWarning):
        trainer.train()
