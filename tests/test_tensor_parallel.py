"""TP x ZeRO and P_a: dp=2 x tp=2 on 4 gloo ranks against a single-process reference (one spawn).

A Llama from config is sharded over tp with its transformers tp_plan (DTensor parameters) and ZeRO runs
over dp; losses and parameters after 10 fp32 steps (with gradient-norm clipping, which spans tp x dp)
equal plain SGD with momentum on one process within 1e-5 (with AdamW at lr 1e-3 one embedding element of
26784 differs by 1.3e-5 in every case, TP or not partitioned alike: Adam amplifies the reduction-order
noise of a near-cancelling gradient), with and without activation checkpointing, with P_a
(partitioned checkpoints) and P_a+cpu. P_a's measured checkpoint bytes are 1/tp of the unpartitioned ones.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from hfzero.testing.spawn import run_distributed

STEPS, BATCH, SEQ, TP, CLIP = 10, 4, 8, 2, 0.5
CASES = {  # name: (stage, checkpointing, partition_activations, cpu_checkpointing)
    "s1": (1, False, False, False),
    "s2_ckpt": (2, True, False, False),
    "s2_pa": (2, True, True, False),
    "s1_pa_cpu": (1, True, True, True),
}


def _llama(**overrides) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, **overrides)
    model = LlamaForCausalLM(config)
    model.config.use_cache = False
    return model.float()


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 128, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def _reference() -> tuple[list[float], torch.Tensor]:
    model = _llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for ids in _batches():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import hfzero
    from hfzero.parallel.tensor import prepare_tensor_parallel

    out = {}
    for name, (stage, checkpointing, partition, cpu) in CASES.items():
        config = hfzero.ZeroConfig(stage=stage, tp_size=TP, partition_activations=partition, cpu_checkpointing=cpu,
                                   reduce_bucket_size=2000)
        model, optimizer, mesh = prepare_tensor_parallel(
            _llama(), lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9), config)
        model.train()
        if checkpointing:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        checkpoint = model.hfzero_checkpoint
        losses, peaks = [], []
        for ids in _batches():
            mine = ids.chunk(mesh.dp_size)[mesh.dp_rank]  # (B / dp, T), the same on the TP ranks of a replica
            checkpoint.stored.reset_peak()
            loss = model(input_ids=mine, labels=mine).loss
            peaks.append(checkpoint.stored.peak)
            loss.backward()
            optimizer.clip_grad_norm_(CLIP)
            optimizer.step()
            optimizer.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total, group=mesh.dp_group)
            losses.append(total.item() / mesh.dp_size)
        full = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]
        out[name] = {"losses": losses, "params": torch.cat([p.reshape(-1) for p in full]), "peak": max(peaks)}
    return out


@pytest.fixture(scope="module")
def results() -> tuple[list[dict], tuple[list[float], torch.Tensor]]:
    return run_distributed(_worker, 4, timeout=600), _reference()


@pytest.mark.parametrize("case", list(CASES))
def test_tp_zero_matches_single_process(results, case: str) -> None:
    ranks, (ref_losses, ref_params) = results
    for rank in ranks:
        assert rank[case]["losses"] == pytest.approx(ref_losses, abs=1e-5)
        torch.testing.assert_close(rank[case]["params"], ref_params, rtol=0, atol=1e-5)


def test_partitioned_checkpoints_are_one_tp_th(results) -> None:
    ranks, _ = results
    for rank in ranks:
        full, partitioned = rank["s2_ckpt"]["peak"], rank["s2_pa"]["peak"]
        assert full > 0
        # Each layer input is (B/dp) x T x h fp32, split in TP equal chunks (no padding here).
        assert partitioned == full // TP


def test_bad_tensor_parallel_input_is_a_clear_error() -> None:
    from hfzero.config import ConfigError
    from hfzero.parallel.tensor import check_heads, check_tp_size, tp_plan
    from hfzero.testing.models import tiny_causal_lm

    with pytest.raises(ConfigError, match="does not divide the world size 4"):
        check_tp_size(4, 3)
    with pytest.raises(ConfigError, match="num_key_value_heads=2"):
        check_heads(_llama(), 4)
    with pytest.raises(ConfigError, match="no tensor-parallel plan.*base_model_tp_plan = .*parallelize_module"):
        tp_plan(tiny_causal_lm("gpt2"))
    assert tp_plan(_llama())["model.layers.*.self_attn.o_proj"] == "rowwise"
