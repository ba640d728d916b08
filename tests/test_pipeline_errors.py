"""Pipeline bad input: each a clear error before any training step runs."""

from __future__ import annotations

import pytest
import torch

import hfzero
from hfzero.config import ConfigError
from hfzero.parallel.mesh import check_sizes
from hfzero.parallel.pipeline import PipelineConfig, pipeline
from hfzero.parallel.pipeline.split import plan_stages, split_model
from hfzero.testing import run_distributed
from hfzero.testing.models import tiny_causal_lm


def test_pp_size_must_divide_world():
    with pytest.raises(ConfigError, match="pp_size=3 does not divide the world size 4"):
        check_sizes(4, 3)
    assert check_sizes(4, 2) == 2


def test_more_stages_than_blocks():
    with pytest.raises(ConfigError, match="4 stages but the model has only 2 decoder blocks"):
        plan_stages(tiny_causal_lm("llama", layers=2), 4)


def test_explicit_layers_must_cover_the_model():
    with pytest.raises(ConfigError, match="layers_per_stage"):
        plan_stages(tiny_causal_lm("gpt2", layers=4), 2, [1, 2])
    assert plan_stages(tiny_causal_lm("gpt2", layers=4), 2, [1, 3]) == [[0], [1, 2, 3]]


def test_model_that_cannot_be_split_lists_supported_classes():
    from transformers import BertConfig, BertForMaskedLM

    model = BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                       intermediate_size=32))
    with pytest.raises(ConfigError, match="cannot split BertForMaskedLM.*GPT2LMHeadModel, LlamaForCausalLM"):
        split_model(model, [0], 2)


def test_unknown_schedule_lists_valid_ones():
    with pytest.raises(ConfigError, match="unknown schedule 'Zigzag'.*GPipe, 1F1B, Interleaved1F1B"):
        PipelineConfig(schedule="Zigzag")


def test_balanced_split_by_parameter_count():
    model = tiny_causal_lm("llama", layers=6)
    plan = plan_stages(model, 3)
    assert [len(p) for p in plan] == [2, 2, 2] and plan[0] == [0, 1]


def _micro_not_dividing(rank: int, world: int) -> str:
    model = tiny_causal_lm("gpt2", layers=2)
    pipe = pipeline(model, torch.optim.AdamW(model.parameters()), hfzero.ZeroConfig(stage=1),
                    pp_size=1, n_microbatches=4)
    try:
        pipe.forward_backward(torch.zeros(6, 8, dtype=torch.long))
    except ConfigError as error:
        return str(error)
    return "no error"


def test_micro_batches_must_divide_the_batch():
    message = run_distributed(_micro_not_dividing, 1)[0]
    assert "n_microbatches=4 does not divide this replica's batch of 6 rows" in message


def test_cross_prefetch_option_reads_booleans_only():
    assert PipelineConfig.from_strings({"pp_stage3_cross_prefetch": "false"}).stage3_cross_prefetch is False
    assert PipelineConfig.from_strings({"pp_stage3_cross_prefetch": "True"}).stage3_cross_prefetch is True
    with pytest.raises(ConfigError, match="--zero_pp_stage3_cross_prefetch: cannot read 'maybe' as true or false"):
        PipelineConfig.from_strings({"pp_stage3_cross_prefetch": "maybe"})
    with pytest.raises(ConfigError, match="stage3_cross_prefetch=1 must be True or False"):
        PipelineConfig(stage3_cross_prefetch=1)


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV"])
def test_v_shaped_schedule_at_stage3_with_tied_embeddings_is_refused(schedule):
    model = tiny_causal_lm("llama", layers=4)
    with pytest.raises(ConfigError, match=f"schedule {schedule} at ZeRO stage 3 with tied input/output embeddings"):
        pipeline(model, torch.optim.AdamW(model.parameters()), hfzero.ZeroConfig(stage=3), pp_size=2,
                 schedule=schedule)
