"""Expert parallelism with find_unused_parameters: a dense parameter used on one EP rank only is still
updated on every rank (its gradient is summed over the EP group), so its replicas stay equal."""

from __future__ import annotations

import torch

from hfzero.testing.models import tiny_moe_lm
from hfzero.testing.spawn import run_distributed


def _train(rank: int, world: int) -> torch.Tensor:
    import hfzero
    from hfzero.parallel.expert import prepare_expert_parallel

    config = hfzero.ZeroConfig(stage=2, ep_size=2, find_unused_parameters=True)
    model, optimizer, _ = prepare_expert_parallel(tiny_moe_lm(), lambda p: torch.optim.AdamW(p, lr=1e-2), config)
    norm = model.model.layers[0].post_attention_layernorm
    if rank == 0:
        norm.forward = lambda hidden: hidden  # its weight goes unused on EP rank 0 only
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        ids = torch.randint(0, 128, (2, 8), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return norm.weight.detach().clone()


def test_dense_parameter_unused_on_one_ep_rank_stays_replicated() -> None:
    first, second = run_distributed(_train, 2)
    assert not torch.equal(first, torch.ones_like(first))  # it trained (RMSNorm weights start at 1)
    torch.testing.assert_close(first, second, rtol=0, atol=0)
