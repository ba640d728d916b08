"""LoRA (peft) on a Llama from a config, world 2: stage 3 partitions the frozen base weights too.

- stage 3 (every tensor partitioned): each rank holds Ψ_frozen/N of the base weights (within bucket
  padding) and no frozen parameter whole; losses equal DDP's (1e-5); the adapter saved from the
  gathered state dict loads with ``PeftModel.from_pretrained`` and equals DDP's trained adapter;
- stages 1-3: the profile's measured model states lie within [0.995, 1.01] of the header's prediction,
  which counts the frozen parameters (whole at stages 1-2, /N at stage 3);
- a stage-3 ``save_checkpoint`` / ``load_checkpoint`` round trip restores the partitioned frozen weights;
- ``from_pretrained_sharded(..., wrap=get_peft_model)`` builds the LoRA model sharded from a checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import hfzero
from hfzero.planning.estimate import model_states_bytes, precision_bytes
from hfzero.profiler import ZeroProfiler, load_run, summarize
from hfzero.testing.models import tiny_causal_lm, train_causal_lm
from hfzero.testing.spawn import run_distributed

pytest.importorskip("peft")
pytestmark = pytest.mark.slow

STEPS = 3


def _wrap(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))


def _lora_model(seed: int = 0) -> torch.nn.Module:
    model = tiny_causal_lm("llama", seed=seed)
    torch.manual_seed(1)
    return _wrap(model)


def _trainable_adamw(model: torch.nn.Module, lr: float = 1e-2) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)


def _sharded_construction(rank: int, world: int, root: str) -> dict:
    """from_pretrained_sharded(dir, ..., wrap=peft) equals peft over from_pretrained, and trains like DDP."""
    from transformers import AutoModelForCausalLM

    from hfzero.runtime.stage3 import full_state_dict
    from hfzero.loading.construct import from_pretrained_sharded

    saved = Path(root) / "base"
    if rank == 0:
        tiny_causal_lm("llama", seed=3).save_pretrained(saved)
    dist.barrier()
    model, optimizer = from_pretrained_sharded(saved, _trainable_adamw,
                                               hfzero.ZeroConfig(stage=3, param_persistence_threshold=0), wrap=_wrap)
    model.train()
    full = full_state_dict(model, rank0_only=False)
    reference = _wrap(AutoModelForCausalLM.from_pretrained(saved))
    want = reference.state_dict()
    lora = [k for k in want if "lora_" in k]
    same_base = sorted(full) == sorted(want) and all(torch.equal(full[k], want[k]) for k in want if k not in lora)
    b_zero = all(full[k].abs().max() == 0 for k in lora if "lora_B" in k)
    reference.load_state_dict({k: full[k] for k in lora}, strict=False)  # the same LoRA init on both sides
    reference.config.use_cache = model.config.use_cache = False
    ddp = torch.nn.parallel.DistributedDataParallel(reference)
    return {"same_base": same_base, "b_zero": b_zero, "lora": len(lora),
            "losses": _train(model, optimizer, rank, world), "want": _train(ddp, _trainable_adamw(ddp), rank, world)}


def _train(model: torch.nn.Module, optimizer, rank: int, world: int) -> list[float]:
    return train_causal_lm(model, optimizer, rank, world, STEPS, 16)


def _adapter(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def _lora_runs(rank: int, world: int, root: str) -> dict:
    from peft import PeftModel

    from hfzero.checkpoint import load_checkpoint, save_checkpoint
    from hfzero.runtime.stage3 import full_state_dict

    ddp_model = _lora_model()
    ddp = torch.nn.parallel.DistributedDataParallel(ddp_model)
    want = _train(ddp, torch.optim.AdamW([p for p in ddp.parameters() if p.requires_grad], lr=1e-2), rank, world)
    want_adapter = _adapter(ddp_model)

    model = _lora_model()
    model, optimizer = hfzero.prepare(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                                               lr=1e-2),
                                      hfzero.ZeroConfig(stage=3, param_persistence_threshold=0))
    engine = hfzero.get_engine(model)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    result = {"losses": _train(model, optimizer, rank, world), "want": want,
              "frozen_shard": engine.frozen_shard.numel(), "frozen_total": engine.num_frozen_params,
              "frozen_buckets": len(engine.frozen_layout.buckets), "whole_frozen": sum(p.numel() for p in frozen),
              "frozen_count": len(frozen)}
    full = full_state_dict(model)
    if rank == 0:
        model.save_pretrained(Path(root) / "adapter", state_dict=full)
        loaded = PeftModel.from_pretrained(tiny_causal_lm("llama"), Path(root) / "adapter")
        got = _adapter(loaded)
        result["adapter_diff"] = max((got[n] - want_adapter[n]).abs().max().item() for n in want_adapter)
        result["adapter_keys"] = sorted(got) == sorted(want_adapter)
    dist.barrier()
    # a stage-3 checkpoint restores partitioned frozen weights too (into a model initialized differently)
    save_checkpoint(Path(root) / "ckpt", model, optimizer)
    other = _lora_model(seed=5)
    other, other_optimizer = hfzero.prepare(
        other, torch.optim.AdamW([p for p in other.parameters() if p.requires_grad], lr=1e-2),
        hfzero.ZeroConfig(stage=3, param_persistence_threshold=0))
    load_checkpoint(Path(root) / "ckpt", other, other_optimizer)
    restored = full_state_dict(other)
    if rank == 0:
        result["restored"] = sorted(restored) == sorted(full) and all(torch.equal(restored[k], full[k]) for k in full)

    result["sharded"] = _sharded_construction(rank, world, root)

    for stage in (1, 2, 3):
        model = _lora_model()
        config = hfzero.ZeroConfig(stage=stage, param_persistence_threshold=0)
        model, optimizer = hfzero.prepare(
            model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3), config)
        with ZeroProfiler(model, optimizer, Path(root) / f"stage{stage}"):
            _train(model, optimizer, rank, world)
    return result


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("lora")
    return root, run_distributed(_lora_runs, 2, str(root), timeout=300)


def test_stage3_lora_shards_frozen_weights_and_matches_ddp(lora) -> None:
    _, results = lora
    for r in results:
        half = r["frozen_total"] / 2
        assert half <= r["frozen_shard"] <= half + 8 * r["frozen_buckets"], r  # Ψ_frozen / N within padding
        assert r["frozen_count"] > 0 and r["whole_frozen"] == 0  # every frozen tensor partitioned
        assert r["losses"][-1] != r["losses"][0]
        for got, want in zip(r["losses"], r["want"]):
            assert abs(got - want) <= 1e-5 * abs(want), (r["losses"], r["want"])
    assert results[0]["adapter_keys"] and results[0]["adapter_diff"] < 1e-6
    assert results[0]["restored"]  # save_checkpoint / load_checkpoint restore the partitioned frozen weights


def test_sharded_construction_of_a_peft_model(lora) -> None:
    """from_pretrained_sharded(dir, ..., wrap=get_peft_model): base weights from the checkpoint (found by
    identity under peft's names), LoRA B zero as peft initializes it, and DDP's losses."""
    _, results = lora
    for r in (result["sharded"] for result in results):
        assert r["same_base"] and r["b_zero"] and r["lora"] == 8
        for got, want in zip(r["losses"], r["want"]):
            assert abs(got - want) <= 1e-5 * abs(want), (r["losses"], r["want"])


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_lora_profile_prediction_counts_frozen_parameters(lora, stage: int) -> None:
    root, _ = lora
    run = load_run(root / f"stage{stage}")
    inputs = run.header["prediction"]["inputs"]
    assert inputs["frozen_params"] > 10 * inputs["num_params"] > 0
    p, g, k = precision_bytes("fp32", "adam")
    predicted = model_states_bytes(inputs["num_params"], 2, stage, param_bytes=p, grad_bytes=g, optimizer_k=k,
                                   persistent_params=inputs["persistent_params"],
                                   frozen_params=inputs["frozen_params"])
    assert run.header["prediction"]["model_state_bytes"] == predicted
    for rank in summarize(run)["ranks"]:
        assert 0.995 <= rank["model_state_bytes"] / predicted <= 1.01, (stage, rank)
