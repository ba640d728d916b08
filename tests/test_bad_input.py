"""Bad input gets a clear error naming the problem and what to do."""

from __future__ import annotations

import pytest
import torch

import hfzero
from hfzero.testing import run_distributed
from hfzero.testing.models import tiny_causal_lm


@pytest.mark.parametrize("field,value", [
    ("stage", 5), ("dtype", "fp8"), ("reduce_bucket_size", -1), ("allgather_bucket_size", -1), ("reduce_bucket_size", 1.5),
    ("overlap_comm", "yes"), ("loss_scale", -1.0), ("reduce_scatter_impl", "magic"),
    ("param_persistence_threshold", -1), ("max_inflight_buckets", 0),
])
def test_invalid_config_value_names_field(field, value):
    with pytest.raises(hfzero.ConfigError, match=field):
        hfzero.ZeroConfig(**{field: value})


def test_unknown_option_lists_valid_ones():
    with pytest.raises(hfzero.ConfigError, match="valid options are.*stage"):
        hfzero.ZeroConfig.from_dict({"stag": 2})
    with pytest.raises(hfzero.ConfigError, match="cannot read 'two' as int"):
        hfzero.ZeroConfig.from_strings({"stage": "two"})


def test_optimizer_over_other_parameters():
    model = tiny_causal_lm("gpt2")
    other = torch.nn.Linear(3, 3)
    optimizer = torch.optim.AdamW(list(model.parameters()) + list(other.parameters()))
    with pytest.raises(hfzero.ConfigError, match="not a parameter of the model"):
        hfzero.prepare(model, optimizer, hfzero.ZeroConfig(stage=1))


def test_world_size_without_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = tiny_causal_lm("gpt2")
    with pytest.raises(RuntimeError, match="init_process_group"):
        hfzero.prepare(model, torch.optim.AdamW(model.parameters()), hfzero.ZeroConfig())


def test_non_elementwise_optimizer_is_refused():
    model = tiny_causal_lm("gpt2")
    with pytest.raises(hfzero.ConfigError, match="element-wise"):
        hfzero.prepare(model, torch.optim.LBFGS(model.parameters()), hfzero.ZeroConfig())


def test_stepped_optimizer_is_refused():
    model = tiny_causal_lm("gpt2")
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.zeros(1, 4, dtype=torch.long)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    with pytest.raises(hfzero.ConfigError, match="already has state"):
        hfzero.prepare(model, optimizer, hfzero.ZeroConfig())


def test_prepare_twice_is_refused():
    model = tiny_causal_lm("gpt2")
    model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters()), hfzero.ZeroConfig())
    with pytest.raises(hfzero.ConfigError, match="already prepared"):
        hfzero.prepare(model, torch.optim.AdamW(model.parameters()), hfzero.ZeroConfig())


def test_fp16_needs_scaled_backward():
    model = tiny_causal_lm("gpt2")
    model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters()),
                                      hfzero.ZeroConfig(stage=2, dtype="fp16"))
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(RuntimeError, match=r"optimizer.backward\(loss\)"):
        model(input_ids=ids, labels=ids).loss.backward()


def _mismatched(rank: int, world: int) -> str:
    model = tiny_causal_lm("gpt2")
    config = hfzero.ZeroConfig(stage=2 if rank == 0 else 1)
    try:
        hfzero.prepare(model, torch.optim.AdamW(model.parameters()), config)
    except hfzero.ConfigError as err:
        return str(err)
    return "no error"


def test_mismatched_configs_across_ranks():
    messages = run_distributed(_mismatched, 2, timeout=120)
    for message in messages:
        assert "ranks disagree" in message and "stage=1 (rank 0: 2)" in message, message


def test_tensor_parallel_bad_input_is_a_clear_error():
    """tp not dividing the launch's world (refused before any process starts) or the (key/value) attention
    heads; a model without a TP plan through the same path the Trainer takes (the message says how to give
    one). P_a without TP: tests/test_activations.py."""
    from pathlib import Path
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM

    from hfzero.integrations.launch import plan
    from hfzero.parallel.tensor import check_heads, shard_model_and_optimizer

    script = str(Path(__file__).resolve().parent / "scripts" / "llama_trainer.py")
    with pytest.raises(hfzero.ConfigError, match="tp_size=3 does not divide the world size 4; use a divisor"):
        plan(["--nproc_per_node", "4", script, "--zero_tp_size", "3"], environ={})
    assert plan(["--nproc_per_node", "4", script, "--zero_tp_size", "2"], environ={}).env["HFZERO_TP_SIZE"] == "2"
    with pytest.raises(hfzero.ConfigError, match="--zero_tp_size and --zero_pp_size cannot be combined yet"):
        plan(["--nproc_per_node", "4", script, "--zero_tp_size", "2", "--zero_pp_size", "2"], environ={})
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=24, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=6, num_key_value_heads=2))
    with pytest.raises(hfzero.ConfigError, match="tp_size=4 does not divide num_attention_heads=6 of LlamaForCausalLM"):
        check_heads(llama, 4)
    with pytest.raises(hfzero.ConfigError, match="tp_size=3 does not divide num_key_value_heads=2"):
        check_heads(llama, 3)
    gpt2 = tiny_causal_lm("gpt2")
    with pytest.raises(hfzero.ConfigError, match="GPT2LMHeadModel has no tensor-parallel plan.*Give one: "
                                                 "config.base_model_tp_plan = .*parallelize_module"):
        shard_model_and_optimizer(gpt2, torch.optim.SGD(gpt2.parameters(), lr=0.1), SimpleNamespace(tp_size=2))


def test_combinations_not_built_are_refused_before_anything_starts():
    """Expert x sequence parallelism (in ZeroConfig, so also on `hfzero run`), and pipeline() with a tensor-,
    expert- or sequence-parallel config: refused by name before any mesh or collective."""
    from pathlib import Path

    from hfzero.integrations.launch import plan

    with pytest.raises(hfzero.ConfigError, match="sp_size cannot be combined with ep_size > 1 yet"):
        hfzero.ZeroConfig(ep_size=2, sp_size=2)
    script = str(Path(__file__).resolve().parent / "scripts" / "llama_trainer.py")
    with pytest.raises(hfzero.ConfigError, match="sp_size cannot be combined with ep_size > 1 yet"):
        plan(["--nproc_per_node", "4", script, "--zero_ep_size", "2", "--zero_sp_size", "2"], environ={})
    model = tiny_causal_lm("gpt2")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for name, what in (("tp_size", "tensor"), ("ep_size", "expert"), ("sp_size", "sequence")):
        with pytest.raises(hfzero.ConfigError, match=rf"pipeline x {what} parallelism \({name} > 1\) is not built"):
            hfzero.pipeline(model, optimizer, hfzero.ZeroConfig(**{name: 2}), pp_size=2)


def _one_rank_shard_groups(rank: int, world: int) -> str:
    import torch.distributed as dist

    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    model = tiny_causal_lm("gpt2")
    try:
        hfzero.prepare(model, torch.optim.AdamW(model.parameters()), hfzero.ZeroConfig(stage=2),
                       process_group=singles[rank], replicate_group=dist.group.WORLD)
    except hfzero.ConfigError as err:
        return str(err)
    return "no error"


def test_hsdp_shard_group_of_one_rank_is_refused():
    """Like ZeroConfig(shard_size=1): a caller's own shard groups of one rank are refused on every rank."""
    for message in run_distributed(_one_rank_shard_groups, 2, timeout=120):
        assert "the shard group passed as process_group has one rank" in message, message
