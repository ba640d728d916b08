"""Pipeline stage-only builds (issue 20 item 3), world 2 as pp=2 x dp=1 (one spawn): a model loaded with
``from_pretrained`` under ``hfzero.sharded_init`` is split while every parameter is still on meta; each rank's
``prepare`` reads only its stage's parameters (the tied embedding on both ends), and the other stage's stay on
meta, never read. Checked for tied and untied Llamas at ZeRO stages 1 and 3: after the pipeline is built the
parameters holding values on a rank are exactly its stage's (dp = 1 here, so a ZeRO-3 shard is the whole
stage; the source model holds no other stage's values), and the losses equal those of the same pipeline built
from an ordinary ``from_pretrained``, exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hfzero
from hfzero.parallel.pipeline import PipelineConfig, pipeline
from hfzero.testing.models import tiny_causal_lm, token_batches
from hfzero.testing.spawn import run_distributed

pytestmark = pytest.mark.slow

STEPS = 3
CASES = (("tied", 1), ("tied", 3), ("untied", 3))


def _load(path: Path, sharded: bool):
    from transformers import AutoModelForCausalLM

    if not sharded:
        return AutoModelForCausalLM.from_pretrained(path)
    with hfzero.sharded_init():
        return AutoModelForCausalLM.from_pretrained(path)


def _held(model) -> dict[str, int]:
    """Names (deduplicated) of the model's parameters holding values on this rank -> elements held."""
    return {n: p.numel() for n, p in model.named_parameters() if p.device.type != "meta" and p.numel()}


def _case(root: Path, kind: str, stage: int, sharded: bool) -> dict:
    model = _load(root / kind, sharded)
    on_meta = all(p.device.type == "meta" for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    zero = hfzero.ZeroConfig(stage=stage, param_persistence_threshold=0, reduce_bucket_size=2048)
    pipe = pipeline(model, optimizer, zero, PipelineConfig(pp_size=2, n_microbatches=2))
    pipe.release_other_stages(model)
    stage_names = {pipe.hf_name(n) for n, _ in pipe.module.named_parameters()}
    stage_numel = sum(pipe.engine.full_numel(p) if stage == 3 else p.numel() for p in pipe.module.parameters())
    held = _held(pipe.module)  # at stage 3 the parameters are 0-element between uses: count the shard
    held_numel = pipe.engine.param_shard.numel() if stage == 3 else sum(held.values())
    mine = {id(p) for p in pipe.module.parameters()}
    # other stages' parameters in the source model: none may hold values
    others = sorted(n for n, p in model.named_parameters() if p.device.type != "meta" and p.numel()
                    and id(p) not in mine)
    losses = [pipe.train_step(batch) for batch in token_batches(STEPS, 4, 8)]
    return {"on_meta": on_meta, "stage_names": sorted(stage_names), "held_numel": held_numel,
            "stage_numel": stage_numel, "others_held": others, "losses": losses}


def _run(rank: int, world: int, root: str) -> dict:
    return {(kind, stage, sharded): _case(Path(root), kind, stage, sharded)
            for kind, stage in CASES for sharded in (False, True)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("loading_pipeline")
    tiny_causal_lm("llama", layers=4, seed=2).save_pretrained(root / "tied", max_shard_size="20KB")
    untied = tiny_causal_lm("llama", layers=4, seed=3)
    untied.config.tie_word_embeddings = False
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    untied.save_pretrained(root / "untied")
    return run_distributed(_run, 2, str(root))


@pytest.mark.parametrize("kind, stage", CASES)
def test_each_rank_loads_only_its_stage_and_trains_as_the_ordinary_path(results, kind, stage):
    for rank, r in enumerate(results):
        sharded, ordinary = r[(kind, stage, True)], r[(kind, stage, False)]
        assert sharded["on_meta"] and not ordinary["on_meta"]
        assert sharded["stage_names"] == ordinary["stage_names"]
        assert sharded["losses"] == ordinary["losses"], (rank, sharded["losses"], ordinary["losses"])
        assert not sharded["others_held"], sharded["others_held"]  # the source model: only this stage's values
        # this rank's stage, whole (dp = 1: a ZeRO-3 shard is the whole stage), and nothing else
        assert sharded["held_numel"] == sharded["stage_numel"] == ordinary["held_numel"], sharded
    first, last = (set(r[(kind, stage, True)]["stage_names"]) for r in results)
    assert not (first & last) - {"model.embed_tokens.weight", "lm_head.weight"}
    if kind == "tied":
        assert "model.embed_tokens.weight" in first and "lm_head.weight" in last
