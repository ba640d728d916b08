"""Every model a script loads works, whether or not hfzero prepares it (issue 32), in one process: a model
loaded under sharded loading that is used before (or without) ``hfzero.prepare`` loads its weights whole, once,
with a log line, and then computes exactly what transformers' own ``from_pretrained`` model computes; what
needs no values (metadata, moves, casts, deep copies, peft) loads nothing, so the prepared model keeps its
memory win; nothing hfzero registers keeps a pending model alive; a frozen model prepared for evaluation
(TRL's reference model) is partitioned at stage 3 with the default persistence threshold and whole at stage 2.
See [Note: pending weights] in hfzero/runtime/pending.py. The multi-rank scripts (TRL's DPO, a teacher beside
a trained model, a model run before its Trainer) are tests/test_loading_scripts.py.
"""

from __future__ import annotations

import copy
import gc
import logging
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import hfzero
from hfzero.runtime import pending
from hfzero.testing.models import tiny_causal_lm

IDS = torch.tensor([[1, 2, 3, 4, 5]])
WEIGHT = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("lazy")
    tiny_causal_lm("llama", seed=3).save_pretrained(root / "llama", max_shard_size="20KB")  # an indexed save
    return str(root / "llama")


def _plain(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


def _pending(path: str):
    from transformers import AutoModelForCausalLM

    with hfzero.sharded_init():
        model = AutoModelForCausalLM.from_pretrained(path)
    assert all(p.device.type == "meta" for p in model.parameters())
    return model


def _loaded(model) -> bool:
    """Whole and ordinary: no meta parameter, no guard class, no hook, nothing pending."""
    return (pending.find_pending(model) is None
            and all(type(p) is torch.nn.Parameter and p.device.type != "meta" for p in model.parameters())
            and not any(h is pending._load_before_forward for m in model.modules() for h in m._forward_pre_hooks.values()))


def _same(a, b) -> bool:
    """Equal; outputs of matrix products within fp32 rounding: BLAS takes a path by the data's alignment, and
    transformers' weights are views into a memory-mapped file at arbitrary offsets (measured: 3e-8 apart for
    ``F.linear`` on bit-equal weights)."""
    if isinstance(a, torch.Tensor):
        return torch.allclose(a, b, rtol=1e-6, atol=1e-7) if a.is_floating_point() else torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


def _zeros_then_state(model, weight):
    torch.nn.init.zeros_(weight)  # a write: lands in the values, the rest of the model is the checkpoint's
    return torch.cat([t.reshape(-1) for t in model.state_dict().values()])


READS = {
    "forward": lambda m, w: m(input_ids=IDS).logits,
    "generate on model.device": lambda m, w: m.generate(IDS.to(m.device), max_new_tokens=3, do_sample=False),
    "state_dict": lambda m, w: m.state_dict()[WEIGHT],
    "cpu": lambda m, w: w.cpu(),
    "item": lambda m, w: w[0, 0].item(),
    "derived item": lambda m, w: w.float().sum().item(),
    "tolist": lambda m, w: w.tolist(),
    "numpy": lambda m, w: w.detach().numpy().copy(),
    ".data": lambda m, w: w.data.clone(),
    "linear on a real input": lambda m, w: F.linear(torch.ones(1, w.shape[1]), w),
    "print": lambda m, w: repr(w),
    "in-place write": _zeros_then_state,
}


@pytest.mark.parametrize("read", list(READS))
def test_a_read_loads_the_model_once_and_gives_transformers_values(path, read, caplog):
    plain, model = _plain(path), _pending(path)
    model.to("cpu")  # a move before the read, as scripts do: still pending, its device recorded
    want = READS[read](plain, plain.get_parameter(WEIGHT))
    with caplog.at_level(logging.INFO, logger="hfzero.runtime.pending"):
        got = READS[read](model, model.get_parameter(WEIGHT))
        again = READS[read](model, model.get_parameter(WEIGHT)) if read != "in-place write" else got
    assert _same(got, want) and _same(again, want), read
    assert _loaded(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # ties kept
    loads = [r for r in caplog.records if "before hfzero prepared it" in r.getMessage()]
    assert len(loads) == 1 and "LlamaForCausalLM" in loads[0].getMessage(), [r.getMessage() for r in loads]


def test_what_needs_no_values_loads_nothing(path, caplog):
    """The window between from_pretrained and prepare of a trained model: none of this reads a weight."""
    from peft import LoraConfig, get_peft_model

    model = _pending(path)
    with caplog.at_level(logging.INFO, logger="hfzero.runtime.pending"):
        model.to("cpu")
        model.half()
        model.float()
        model.requires_grad_(False)
        model.requires_grad_(True)
        assert model.device == torch.device("cpu") and model.dtype == torch.float32
        assert model.num_parameters() == _plain(path).num_parameters()
        assert [p.shape for p in model.parameters()] and sum(p.numel() for p in model.parameters())
        model.config.use_cache = False
        model.gradient_checkpointing_enable()
        norm_copy = copy.deepcopy(model.model.norm)
        peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["norm"]))
    assert not [r for r in caplog.records if "before hfzero prepared it" in r.getMessage()]
    base = [p for n, p in peft_model.named_parameters() if "lora_" not in n]
    assert all(p.device.type == "meta" for p in base) and pending.find_pending(peft_model) is not None
    assert isinstance(norm_copy.weight, pending.PendingParameter)


def test_a_deep_copy_is_pending_over_the_same_files(path):
    plain, model = _plain(path), _pending(path)
    twin = copy.deepcopy(model)
    assert pending.find_pending(twin) is not None and pending.find_pending(twin) is not pending.find_pending(model)
    assert twin.lm_head.weight is twin.model.embed_tokens.weight
    want = plain(input_ids=IDS).logits
    assert _same(twin(input_ids=IDS).logits, want) and _loaded(twin)
    assert all(p.device.type == "meta" for p in model.parameters())  # the original is still pending
    assert _same(model(input_ids=IDS).logits, want) and _loaded(model)


def test_nothing_keeps_a_pending_model_alive(path):
    model = _pending(path)
    model.to("cpu")
    twin = copy.deepcopy(model)
    refs = [weakref.ref(model), weakref.ref(pending.find_pending(model)), weakref.ref(twin),
            weakref.ref(model.model.norm.weight)]
    del model, twin
    gc.collect()
    assert all(ref() is None for ref in refs)
    assert not pending._live


def test_prepare_after_a_load_trains_as_the_ordinary_path(path):
    """A model run before its Trainer (a sample generated first): loaded whole then, prepared as any model."""
    results = []
    for model in (_plain(path), _pending(path)):
        model(input_ids=IDS)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = hfzero.prepare(model, optimizer, hfzero.ZeroConfig(stage=3))
        steps = []
        for _ in range(2):
            loss = model(input_ids=IDS, labels=IDS).loss
            optimizer.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            steps.append(loss.item())
        results.append(steps)
    assert results[0] == results[1]


@pytest.mark.parametrize("stage", [3, 2])
def test_a_frozen_model_prepared_for_evaluation_follows_the_stage(path, stage, caplog):
    """TRL's reference model (``accelerator.prepare_model(ref, evaluation_mode=True)``) with the default
    persistence threshold (its small tensors kept whole, read at prepare): stage 3 partitions it, stage 2 holds
    it whole (read at prepare_model); either computes what transformers' model computes."""
    from hfzero.integrations.state import is_partitioned

    want = _plain(path)(input_ids=IDS).logits
    accelerator = hfzero.ZeroAccelerator(zero_config=hfzero.ZeroConfig(stage=stage), cpu=True)
    with caplog.at_level(logging.INFO, logger="hfzero.runtime.pending"):
        ref = accelerator.prepare_model(_pending(path), evaluation_mode=True)
    assert is_partitioned(ref) is (stage == 3)
    if stage == 2:
        assert _loaded(ref) and any("prepared for evaluation at stage 2" in r.getMessage() for r in caplog.records)
    with torch.no_grad():
        assert _same(ref(input_ids=IDS).logits, want)


def test_a_module_copied_out_of_a_pending_model_loads_alone(path):
    """A copy of one module used on its own (a value head started from the LM head, say): read from its original's
    file and key; the model it came from stays pending."""
    plain, model = _plain(path), _pending(path)
    head = copy.deepcopy(model.model.layers[1].mlp)
    x = torch.randn(2, 32)
    assert _same(head(x), plain.model.layers[1].mlp(x))
    assert all(type(p) is torch.nn.Parameter and p.device.type != "meta" for p in head.parameters())
    assert all(p.device.type == "meta" for p in model.parameters()) and pending.find_pending(model) is not None
