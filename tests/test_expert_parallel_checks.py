"""Expert parallelism across EP ranks (one spawn of 2 ranks, ep_size=2, so each edp group is one rank):
configs that differ between EP ranks are refused, and with find_unused_parameters a dense parameter used on
one EP rank only is still updated on every rank (its gradient is reduced over the world, its unused flag too),
so its replicas stay equal."""

from __future__ import annotations

import pytest
import torch

from hfzero.testing.models import tiny_moe_lm
from hfzero.testing.spawn import run_distributed


def _worker(rank: int, world: int) -> dict:
    import hfzero
    from hfzero.parallel.expert import prepare_expert_parallel

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-2)

    mismatched = hfzero.ZeroConfig(stage=2, ep_size=2, reduce_bucket_size=3000 if rank else 5000)
    try:
        prepare_expert_parallel(tiny_moe_lm(), adamw, mismatched)
        refusal = "no error"
    except hfzero.ConfigError as err:
        refusal = str(err)
    config = hfzero.ZeroConfig(stage=2, ep_size=2, find_unused_parameters=True)
    model, optimizer, _ = prepare_expert_parallel(tiny_moe_lm(), adamw, config)
    norm = model.model.layers[0].post_attention_layernorm
    if rank == 0:
        norm.forward = lambda hidden: hidden  # its weight goes unused on EP rank 0 only
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        ids = torch.randint(0, 128, (2, 8), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"refusal": refusal, "norm": norm.weight.detach().clone()}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_worker, 2, timeout=300)


def test_configs_differing_between_ep_ranks_are_refused(results) -> None:
    for result in results:
        assert "ranks disagree" in result["refusal"] and "reduce_bucket_size=3000" in result["refusal"], result


def test_dense_parameter_unused_on_one_ep_rank_stays_replicated(results) -> None:
    first, second = (r["norm"] for r in results)
    assert not torch.equal(first, torch.ones_like(first))  # it trained (RMSNorm weights start at 1)
    torch.testing.assert_close(first, second, rtol=0, atol=0)
