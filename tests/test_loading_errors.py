"""Sharded loading (``hfzero.sharded_init`` around ``from_pretrained``) refuses bad checkpoints with one
error naming the tensor and the file, raised inside ``from_pretrained`` (before any training), leaving no
pending model behind. Single process: every rank reads the headers itself, so every rank raises the same.
Also: what from_pretrained leaves (meta parameters, ties), reads refused once prepare has claimed the weights,
and ``hfzero run``'s stage-3 switch."""

from __future__ import annotations

import gc
import json
import os
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

import hfzero
from hfzero.runtime import pending
from hfzero.runtime.stage3.weights import WeightLoadError
from hfzero.testing.models import tiny_causal_lm


def _load(path):
    from transformers import AutoModelForCausalLM

    with hfzero.sharded_init():
        return AutoModelForCausalLM.from_pretrained(path)


@pytest.fixture()
def single(tmp_path):
    tiny_causal_lm("llama").save_pretrained(tmp_path / "m")
    return tmp_path / "m"


@pytest.fixture()
def sharded(tmp_path):
    tiny_causal_lm("llama").save_pretrained(tmp_path / "s", max_shard_size="20KB")
    return tmp_path / "s"


def _shards(path):
    with open(path / "model.safetensors.index.json", encoding="utf-8") as f:
        return json.load(f)["weight_map"]


def _refused(path, *fragments):
    with pytest.raises(WeightLoadError) as info:
        _load(str(path))
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    gc.collect()
    assert not pending._live, "a refused load left a pending model behind"


def test_loads_sharded_and_leaves_weights_in_the_checkpoint(single):
    model = _load(str(single))
    assert all(p.device.type == "meta" for p in model.parameters())
    assert pending.find_pending(model) is not None
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.to("cpu")  # a move keeps them pending
    assert model.model.embed_tokens.weight.device.type == "meta"
    assert model.device == torch.device("cpu")  # where the weights go (see [Note: pending weights])


def test_claimed_weights_refuse_reads_saying_why(single):
    """Once prepare has claimed a pending model's weights (``source``), no read loads them: every way of reading
    raises hfzero's message (naming the weight where it can), never torch's bare meta-tensor error nor empty
    values; after prepare the parameters are plain ``nn.Parameter`` again (training pays nothing for the guard).
    Before prepare the same reads load the model whole: tests/test_loading_lazy.py."""
    model = _load(str(single))
    weight = model.model.layers[0].self_attn.q_proj.weight
    claimed = pending.find_pending(model)
    claimed.source(model, torch.device("cpu")).close()  # what prepare does first
    reads = {
        "cpu": lambda: weight.cpu(),
        "item": lambda: weight[0, 0].item(),
        "tolist": lambda: weight.tolist(),
        "derived item": lambda: weight.float().sum().item(),
        "numpy": lambda: weight.detach().numpy(),
        "copy into a real tensor": lambda: torch.zeros(weight.shape).copy_(weight),
        "forward": lambda: model(input_ids=torch.tensor([[1, 2, 3]])),
        "state_dict value": lambda: model.state_dict()["model.norm.weight"].clone().cpu(),
    }
    for what, read in reads.items():
        with pytest.raises((NotImplementedError, RuntimeError, TypeError)) as info:
            read()
        message = str(info.value)
        assert "before hfzero.prepare" in message and "after prepare" in message, f"{what}: {message}"
    with pytest.raises(NotImplementedError, match="'model.layers.0.self_attn.q_proj.weight'"):
        weight.cpu()
    assert weight.shape == (32, 32) or weight.dim() == 2  # metadata still reads
    assert all(p.device.type == "meta" for p in model.parameters())  # nothing was loaded
    pending.release(model)
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert not any(h is pending._load_before_forward for m in model.modules() for h in m._forward_pre_hooks.values())


def test_prepare_leaves_plain_parameters_and_no_hooks(single):
    model = _load(str(single))
    model.half()  # dtype casts work and keep the weights pending
    assert isinstance(model.model.norm.weight, pending.PendingParameter)
    model.float()
    model, _ = hfzero.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), hfzero.ZeroConfig(stage=2))
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert not any(h is pending._load_before_forward for m in model.modules() for h in m._forward_pre_hooks.values())
    assert torch.isfinite(model(input_ids=torch.tensor([[1, 2, 3]])).logits).all()


def test_index_naming_a_missing_file(sharded):
    name = sorted(set(_shards(sharded).values()))[1]
    os.remove(sharded / name)
    _refused(sharded, name, "does not exist")


def test_tensor_missing_from_its_file(sharded):
    key, name = sorted(_shards(sharded).items())[3]
    tensors = load_file(sharded / name)
    del tensors[key]
    save_file(tensors, sharded / name, metadata={"format": "pt"})
    _refused(sharded, key, name, "missing")


def test_shape_mismatch(single):
    with open(single / "config.json", encoding="utf-8") as f:
        config = json.load(f)
    config["intermediate_size"] += 8
    with open(single / "config.json", "w", encoding="utf-8") as f:
        json.dump(config, f)
    _refused(single, "mlp.up_proj.weight", "model.safetensors", "checkpoint shape")


def test_file_truncated_inside_a_tensor(single):
    path = single / "model.safetensors"
    os.truncate(path, os.path.getsize(path) - 100)
    _refused(single, "model.safetensors", "truncated")


def test_dtype_the_checkpoint_cannot_provide(single):
    path = single / "model.safetensors"
    tensors = load_file(path)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int32)
    save_file(tensors, path, metadata={"format": "pt"})
    _refused(single, "model.norm.weight", "model.safetensors", "cannot provide")


def test_dtype_unknown_to_hfzero(single):
    path = single / "model.safetensors"
    with open(path, "rb") as f:
        data = f.read()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    header["model.norm.weight"]["dtype"] = "F4"  # a dtype safetensors knows and hfzero does not read
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(length)
    assert len(raw) == length
    with open(path, "wb") as f:
        f.write(data[:8] + raw + data[8 + length:])
    _refused(single, "model.norm.weight", "model.safetensors", "dtype")


def test_hfzero_run_switches_sharded_loading_on(monkeypatch):
    from hfzero.integrations import launch
    from hfzero.loading import disable, is_enabled

    monkeypatch.setenv("HFZERO_STAGE", "auto")
    launch._load_through_hfzero()
    assert not is_enabled()
    monkeypatch.setenv("HFZERO_STAGE", "3")
    launch._load_through_hfzero()
    try:
        assert is_enabled()
    finally:
        disable()
    assert not is_enabled()


def test_missing_and_unexpected_keys_reported_and_initialized_as_transformers_does(single):
    from transformers import AutoModelForCausalLM

    from hfzero.runtime.stage3 import full_state_dict

    path = single / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.0.mlp.up_proj.weight"]
    tensors["model.extra.weight"] = torch.ones(3)
    save_file(tensors, path, metadata={"format": "pt"})
    torch.manual_seed(5)
    plain, plain_info = AutoModelForCausalLM.from_pretrained(str(single), output_loading_info=True)
    torch.manual_seed(5)
    with hfzero.sharded_init():
        model, info = AutoModelForCausalLM.from_pretrained(str(single), output_loading_info=True)
    assert info == plain_info and "model.layers.0.mlp.up_proj.weight" in info["missing_keys"]
    assert "model.extra.weight" in info["unexpected_keys"]
    assert model.model.layers[0].mlp.up_proj.weight.device.type == "cpu"  # initialized by transformers
    model, _ = hfzero.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              hfzero.ZeroConfig(stage=3, param_persistence_threshold=0))
    got, want = full_state_dict(model, rank0_only=False), plain.state_dict()
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_keep_in_fp32_modules_and_fp16_load_as_transformers_does(tmp_path):
    from transformers import AutoModelForSeq2SeqLM, T5Config, T5ForConditionalGeneration

    from hfzero.runtime.stage3 import full_state_dict

    torch.manual_seed(0)
    config = T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
    T5ForConditionalGeneration(config).save_pretrained(tmp_path / "t5")  # _keep_in_fp32_modules = ["wo"]
    plain = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "t5", dtype=torch.float16)
    with hfzero.sharded_init():
        model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "t5", dtype=torch.float16)
    assert {n: p.dtype for n, p in model.named_parameters()} == {n: p.dtype for n, p in plain.named_parameters()}
    assert model.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.float32
    got = []
    for m in (plain, model):
        m, _ = hfzero.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1),
                              hfzero.ZeroConfig(stage=3, param_persistence_threshold=0))
        got.append(full_state_dict(m, rank0_only=False))
    assert sorted(got[0]) == sorted(got[1]) and all(torch.equal(got[0][k], got[1][k]) for k in got[0])
