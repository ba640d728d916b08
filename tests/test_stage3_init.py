"""Stage-3 sharded construction: load each rank's shard straight from safetensors (single-file and
index-sharded saves, tied embeddings), fresh sharded init, parity with hfzero.prepare on the full
model, peak RSS while loading, and bad input. One 2-rank spawn."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist

import hfzero
from hfzero.config import ConfigError
from hfzero.roles import MemoryRole
from hfzero.runtime.stage3 import full_state_dict
from hfzero.loading.construct import from_pretrained_sharded, init_sharded
from hfzero.runtime.stage3.weights import WeightLoadError
from hfzero.testing import run_distributed
from hfzero.testing.models import micro_batches, tiny_causal_lm, token_batches
from hfzero.testing.procmem import reset_peak, status

STEPS = 3
LR = 1e-3


def _config(**kw) -> hfzero.ZeroConfig:
    return hfzero.ZeroConfig(stage=3, param_persistence_threshold=0, reduce_bucket_size=4000, **kw)


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def _big_llama():
    """About 8M parameters (32 MB in fp32): large enough for RSS figures to stand out of the noise."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=16000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("stage3_init")
    dirs = {}
    for label, kind, shard in (("gpt2", "gpt2", None), ("llama", "llama", None), ("llama_sharded", "llama", "20KB")):
        model = tiny_causal_lm(kind)
        dirs[label] = str(root / label)
        model.save_pretrained(dirs[label], **({"max_shard_size": shard} if shard else {}))
    dirs["big"] = str(root / "big")
    _big_llama().save_pretrained(dirs["big"])
    return dirs


def _rss_case(rank, world, path, warmup):
    """Peak RSS growth while loading sharded, then while loading whole and preparing (for contrast)."""
    from transformers import AutoModelForCausalLM

    # warm up on a tiny model of the same class: lazy imports and first-use allocations are not loading
    from_pretrained_sharded(warmup, _adamw, _config())
    AutoModelForCausalLM.from_pretrained(warmup)
    base = reset_peak()
    model, opt = from_pretrained_sharded(path, _adamw, _config())
    sharded_peak = status("VmHWM") - base
    roles = hfzero.get_engine(model).memory_by_role()
    # the sharded model stays alive meanwhile: freed, its memory would be reused by the whole-model path without
    # raising the peak (engines are collected since issue 33), and the contrast would measure nothing
    base = reset_peak()
    full = AutoModelForCausalLM.from_pretrained(path)
    whole, whole_opt = hfzero.prepare(full, _adamw(full), _config())
    full_peak = status("VmHWM") - base
    del whole, whole_opt, model, opt
    return {"sharded_peak": sharded_peak, "full_peak": full_peak,
            "param_shard": roles.get(MemoryRole.PARAM_SHARD, 0), "grad_shard": roles.get(MemoryRole.GRAD_SHARD, 0)}


def _train(model, opt, rank, world) -> list[float]:
    losses = []
    for batch in token_batches(STEPS, 8, 16):
        (mb,) = micro_batches(batch, rank, world, 1)
        loss = model(input_ids=mb, labels=mb).loss
        opt.backward(loss)
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _load_case(rank, world, path):
    from transformers import AutoModelForCausalLM

    model, opt = from_pretrained_sharded(path, _adamw, _config())
    loaded = full_state_dict(model, rank0_only=False)
    plain = AutoModelForCausalLM.from_pretrained(path)
    prompt = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        ours = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        theirs = plain.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    buffers_equal = all(torch.equal(b, dict(plain.named_buffers())[n]) for n, b in model.named_buffers())
    losses = _train(model, opt, rank, world)
    trained = full_state_dict(model, rank0_only=False)
    ref_model, ref_opt = hfzero.prepare(plain, _adamw(plain), _config())
    ref_losses = _train(ref_model, ref_opt, rank, world)
    ref_trained = full_state_dict(ref_model, rank0_only=False)
    return {"loaded": loaded, "generate_equal": torch.equal(ours, theirs), "buffers_equal": buffers_equal,
            "losses": losses, "ref_losses": ref_losses,
            "trained_equal": trained.keys() == ref_trained.keys()
            and all(torch.equal(trained[k], ref_trained[k]) for k in trained)}


def _init_case(rank, world, kind):
    model, _ = init_sharded(tiny_causal_lm(kind).config, _adamw, _config(), seed=3)
    return full_state_dict(model, rank0_only=False)


def _worker(rank, world, saved):
    out = {"rss": _rss_case(rank, world, saved["big"], saved["llama"])}  # first, in a fresh process
    for label in ("gpt2", "llama", "llama_sharded"):
        out[label] = _load_case(rank, world, saved[label])
    out["init_llama"] = _init_case(rank, world, "llama")
    out["init_gpt2"] = _init_case(rank, world, "gpt2")
    return out


def _saved_state(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    state = {}
    for f in files:
        state.update(load_file(os.path.join(path, f)))
    return state


def test_world2_sharded_loading(saved):
    assert len([f for f in os.listdir(saved["llama_sharded"]) if f.endswith(".safetensors")]) > 1
    results = run_distributed(_worker, 2, saved, timeout=150)
    for rank, out in enumerate(results):
        for label in ("gpt2", "llama", "llama_sharded"):
            r = out[label]
            stored = _saved_state(saved[label])
            # every stored tensor is loaded exactly; names absent from the checkpoint are tied aliases
            for key, value in stored.items():
                assert torch.equal(r["loaded"][key], value), (label, key)
            extra = set(r["loaded"]) - set(stored)
            assert extra <= {"lm_head.weight", "model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}, extra
            assert r["generate_equal"] and r["buffers_equal"], (label, rank)
            assert r["losses"] == r["ref_losses"], (label, r["losses"], r["ref_losses"])
            assert r["trained_equal"], label
        # fresh init: identical on both ranks and independent of the world size
        for kind in ("llama", "gpt2"):
            world1, _ = init_sharded(tiny_causal_lm(kind).config, _adamw, _config(), seed=3)
            expected = full_state_dict(world1, rank0_only=False)
            got = out[f"init_{kind}"]
            assert got.keys() == expected.keys()
            assert all(torch.equal(got[k], expected[k]) for k in got), kind
            weights = [v for k, v in got.items() if k.endswith("proj.weight") or k.endswith("c_attn.weight")]
            assert all(0.005 < w.std().item() < 0.05 for w in weights), kind  # initializer_range 0.02, not zeros

    # Peak RSS growth per rank (VmHWM after clear_refs, minus VmRSS then) while loading the 32 MB model:
    # the rank's parameter shard plus the engine's gradient shard (a model state prepare also
    # allocates) plus transient reads; the whole-model path costs at least a full model more.
    model_bytes = sum(v.numel() * v.element_size() for v in _saved_state(saved["big"]).values())
    for rank, out in enumerate(results):
        rss = out["rss"]
        print(f"rank {rank}: model {model_bytes / 2**20:.1f} MiB, sharded load peak +{rss['sharded_peak'] / 2**20:.1f} "
              f"MiB (param shard {rss['param_shard'] / 2**20:.1f}, grad shard {rss['grad_shard'] / 2**20:.1f}), "
              f"from_pretrained + prepare peak +{rss['full_peak'] / 2**20:.1f} MiB")
        assert rss["param_shard"] <= model_bytes / 2 + 2**16
        assert rss["sharded_peak"] - rss["grad_shard"] < model_bytes, rss
        # beyond the two shards: the read chunk (4 MiB), the skeleton's buffers, and allocator noise
        # (some runs show ~10 MiB more on one rank; not yet explained)
        assert rss["sharded_peak"] <= rss["param_shard"] + rss["grad_shard"] + 16 * 2**20, rss
        assert rss["full_peak"] >= model_bytes, rss  # the method sees a full model when there is one
        assert rss["full_peak"] - rss["sharded_peak"] > 0.5 * model_bytes, rss


def test_bad_input(saved, tmp_path):
    empty = tmp_path / "no_weights"
    empty.mkdir()
    shutil.copy(os.path.join(saved["gpt2"], "config.json"), empty / "config.json")
    with pytest.raises(WeightLoadError, match="holds no safetensors weights"):
        from_pretrained_sharded(str(empty), _adamw, _config())
    with pytest.raises(WeightLoadError, match="no config.json"):
        from_pretrained_sharded(str(tmp_path), _adamw, _config())

    mismatch = tmp_path / "mismatch"
    shutil.copytree(saved["gpt2"], mismatch)
    config = json.loads((mismatch / "config.json").read_text())
    config["n_embd"] = 64
    (mismatch / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightLoadError, match=r"shape mismatch.*transformer\.wte\.weight: checkpoint \[128, 32\], "
                                              r"model \[128, 64\]"):
        from_pretrained_sharded(str(mismatch), _adamw, _config())

    index = tmp_path / "bad_index"
    shutil.copytree(saved["llama_sharded"], index)
    (index / sorted(f for f in os.listdir(index) if f.endswith(".safetensors"))[0]).unlink()
    with pytest.raises(WeightLoadError, match="which does not exist"):
        from_pretrained_sharded(str(index), _adamw, _config())

    truncated = tmp_path / "truncated"
    shutil.copytree(saved["gpt2"], truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(WeightLoadError, match="inconsistent offsets"):
        from_pretrained_sharded(str(truncated), _adamw, _config())

    with pytest.raises(ConfigError, match="stage=3"):
        from_pretrained_sharded(saved["gpt2"], _adamw, hfzero.ZeroConfig(stage=2))


def test_frozen_parameter_sharded_from_checkpoint(saved):
    """A frozen parameter is partitioned like a trainable one and its shard read from the checkpoint
    (world 1, in process); see [Note: stage-3 frozen parameters]."""
    def factory(model):
        model.model.norm.weight.requires_grad_(False)
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)

    model, _ = from_pretrained_sharded(saved["llama"], factory, _config())
    stored = _saved_state(saved["llama"])
    assert not model.model.norm.weight.requires_grad
    assert model.model.norm.weight.numel() == 0  # partitioned between uses
    assert hfzero.get_engine(model).frozen_shard.numel() >= stored["model.norm.weight"].numel()
    state = full_state_dict(model, rank0_only=False)
    assert all(torch.equal(state[k], v) for k, v in stored.items())
