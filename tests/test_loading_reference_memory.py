"""A reference model's memory at stage 3 is 1/N of its size (issue 32 item 4), two gloo ranks.

TRL's DPO reference model is loaded under sharded loading and prepared for evaluation
(``accelerator.prepare_model(ref, evaluation_mode=True)``, which at stage 3 freezes it and gives it to
``hfzero.prepare`` with an optimizer of no parameters: integrations/accelerate.py). Each rank here does the same
with a saved tiny Llama, every tensor partitioned (``param_persistence_threshold=0``): the rank holds only its
slice of the model's elements (the frozen shard, Ψ/N within the bucket padding), no parameter keeps memory of
its own between forwards, and the model computes what transformers' own model computes.
"""

from __future__ import annotations

from pathlib import Path

import torch

import hfzero
from hfzero.roles import MemoryRole
from hfzero.testing import run_distributed
from hfzero.testing.models import tiny_causal_lm

IDS = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])


def _rank(rank: int, world: int, path: str) -> dict:
    from transformers import AutoModelForCausalLM

    want = AutoModelForCausalLM.from_pretrained(path)(input_ids=IDS).logits
    with hfzero.sharded_init():
        ref = AutoModelForCausalLM.from_pretrained(path)
    total = sum(p.numel() for p in ref.parameters())
    ref.requires_grad_(False)
    nothing = torch.optim.SGD([{"params": []}], lr=0.0)
    ref, _ = hfzero.prepare(ref, nothing, hfzero.ZeroConfig(stage=3, param_persistence_threshold=0))
    engine = hfzero.get_engine(ref)
    held_by_params = sum(p.untyped_storage().nbytes() for p in ref.parameters())
    with torch.no_grad():
        got = ref(input_ids=IDS).logits
    return {"total": total, "shard": engine.frozen_shard.numel(), "padded": sum(b.padded for b in engine.frozen_layout.buckets),
            "buckets": len(engine.frozen_layout.buckets), "held_by_params": held_by_params,
            "shard_bytes": engine.memory_by_role().get(MemoryRole.PARAM_SHARD, 0),
            "element": engine.frozen_shard.element_size(), "close": torch.allclose(got, want, rtol=1e-5, atol=1e-6)}


def test_a_reference_model_prepared_at_stage_3_holds_1_over_n(tmp_path: Path) -> None:
    tiny_causal_lm("llama", seed=3).save_pretrained(tmp_path / "llama")
    world = 2
    for rank, r in enumerate(run_distributed(_rank, world, str(tmp_path / "llama"))):
        assert r["close"], rank
        assert r["padded"] == world * r["shard"]  # every bucket split evenly over the ranks
        assert r["total"] / world <= r["shard"] <= r["total"] / world + r["buckets"] * world, r
        assert r["shard_bytes"] == r["shard"] * r["element"], r  # nothing trainable: the frozen shard is all of it
        assert r["held_by_params"] == 0, r  # between forwards no parameter has memory of its own
