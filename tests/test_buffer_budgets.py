"""Transient buffers sized to the model (issue 14): the bucket and prefetch rules, explicit values
kept, and the stage-3 gather pool's reuse and release guarantee. No spawn (world 1 / no group)."""

from __future__ import annotations

import pytest
import torch

import hfzero
from hfzero.runtime.stage3.buffers import GatherBufferPool
from hfzero.testing.models import tiny_causal_lm


@pytest.mark.parametrize("num_params,world,bucket,prefetch", [
    (30_000, 2, 2**18, 2**18),                    # tiny: the floor, one bucket as before
    (5_289_472, 2, 330_592, 1_322_368),           # 5.3M GPT-2 at 2 ranks: Ψ/(8N), Ψ/(2N)
    (91_400_000, 4, 2_856_250, 11_425_000),       # 91.4M at 4 ranks
    (7_000_000_000, 8, 25_000_000, 25_000_000),   # large: constant-size buffers (ZeRO-R CB)
])
def test_model_sized_defaults(num_params, world, bucket, prefetch):
    config = hfzero.ZeroConfig()
    assert config.bucket_numel(num_params, world) == bucket
    assert config.prefetch_numel(num_params, world) == prefetch


def test_explicit_values_are_kept():
    config = hfzero.ZeroConfig(reduce_bucket_size=123, allgather_bucket_size=456)
    assert config.bucket_numel(10**9, 2) == 123 and config.prefetch_numel(10**9, 2) == 456
    assert hfzero.ZeroConfig.from_strings({"reduce_bucket_size": "0"}).reduce_bucket_size == 0


def test_engine_uses_the_rule():
    model = tiny_causal_lm("gpt2", hidden=256, layers=2, vocab=8192)  # 3.7M parameters, world 1
    model, opt = hfzero.prepare(model, torch.optim.AdamW(model.parameters()), hfzero.ZeroConfig(stage=2))
    engine = hfzero.get_engine(model)
    assert engine.bucket_numel == -(-engine.num_params // 8) > 2**18
    assert opt.state_dict()["hfzero"]["reduce_bucket_size"] == engine.bucket_numel  # the layout that ran


def test_gather_pool_reuses_and_bounds():
    pool = GatherBufferPool(torch.float32, torch.device("cpu"), limit_bytes=96)
    a = pool.borrow(64)
    pool.give_back(a)
    assert pool.borrow(64) is a and pool.allocations == 1  # reused, exact size
    b = pool.borrow(32)
    pool.give_back(a)
    assert pool.idle_bytes() == 64 and pool.lent_bytes() == 32
    c = pool.borrow(64)
    d = pool.borrow(64)  # a second 64-byte buffer: 160 bytes held
    pool.give_back(d)  # beyond the limit: freed
    pool.give_back(c)
    pool.give_back(b)
    assert pool.idle_bytes() == 96 and pool.allocations == 3


def test_swapped_storage_keeps_saved_views_valid():
    """[Note: stage-3 gather buffers]: a view taken while a pool buffer is swapped in loses its memory
    on release and sees the refilled buffer after the next swap, like a storage resized to 0 and back."""
    pool = GatherBufferPool(torch.float32, torch.device("cpu"), limit_bytes=1 << 10)
    full = torch.empty(8)
    full.untyped_storage().resize_(0)
    slot = pool.borrow(32)
    full.untyped_storage()._swap_data_ptr_(slot)
    full.copy_(torch.arange(8.0))
    saved = full[2:4].t()  # what autograd would keep
    full.untyped_storage()._swap_data_ptr_(slot)
    pool.give_back(slot)
    assert full.untyped_storage().nbytes() == 0 and saved.untyped_storage().nbytes() == 0
    slot = pool.borrow(32)
    full.untyped_storage()._swap_data_ptr_(slot)
    full.copy_(torch.arange(8.0) * 10)
    assert saved.tolist() == [20.0, 30.0]
