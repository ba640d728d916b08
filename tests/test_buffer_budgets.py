"""Transient buffers sized to the model (issue 14): the bucket and prefetch rules, explicit values
kept, and the stage-3 unit buffers' release guarantee. No spawn (world 1 / no group)."""

from __future__ import annotations

import pytest
import torch

import hfzero
from hfzero.runtime.stage3.buffers import GatherBuffers, mapped_supported
from hfzero.testing.models import tiny_causal_lm
from hfzero.testing.procmem import resident_in_range


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


@pytest.mark.skipif(not mapped_supported(torch.device("cpu")), reason="mapped unit buffers need Linux")
def test_mapped_unit_buffer_hands_pages_back_and_keeps_saved_views():
    """[Note: stage-3 gather buffers], "mapped": the storage never changes; release hands every page back
    (a view autograd would keep reads zeros, never freed or foreign memory) and the next gather refills the
    same storage, which the view sees."""
    buffers = GatherBuffers(torch.float32, torch.device("cpu"), kind="mapped")  # ZeroConfig.stage3_buffers
    buffer = buffers.make(1 << 20)  # 4 MiB
    buffer.release()
    full, address = buffer.tensor, buffer.tensor.data_ptr()
    assert resident_in_range(address, buffer.nbytes) == 0  # nothing resident before the first gather
    buffer.acquire()
    full.copy_(torch.arange(1 << 20, dtype=torch.float32))
    assert resident_in_range(address, buffer.nbytes) == buffer.nbytes
    saved = full[:8].view(2, 4).t()  # what autograd would keep of a weight
    buffer.release()
    assert resident_in_range(address, buffer.nbytes) == 0 and saved.abs().sum().item() == 0
    buffer.acquire()
    full.copy_(torch.arange(1 << 20, dtype=torch.float32) * 10)
    assert full.data_ptr() == address and saved[1].tolist() == [10.0, 50.0]


def test_resized_unit_buffer_is_the_default():
    """"resized" (the default, on CUDA and the host): release leaves the storage, and every view of it, at 0
    bytes; the next gather refills the same storage."""
    buffer = GatherBuffers(torch.float32, torch.device("cpu")).make(8)
    buffer.release()
    full = buffer.tensor
    assert buffer.kind == "resized" and full.untyped_storage().nbytes() == 0
    buffer.acquire()
    full.copy_(torch.arange(8.0))
    saved = full[2:4].t()
    buffer.release()
    assert full.untyped_storage().nbytes() == 0 and saved.untyped_storage().nbytes() == 0
    buffer.acquire()
    full.copy_(torch.arange(8.0) * 10)
    assert saved.tolist() == [20.0, 30.0]
