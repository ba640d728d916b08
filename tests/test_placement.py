"""Placement on fresh machines: which device a group's collectives serve (asked of the group's backend
table, not its name), prepare's check that the model sits where the group and the rank expect it, and
`hfzero run`'s refusal to start more ranks than visible GPUs. In process: a world-1 gloo group, with the
CUDA host faked by patching what torch reports (no GPU needed)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hfzero
from hfzero.comm import Communicator, _default_device
from hfzero.config import ConfigError
from hfzero.devices import parse_backend_config
from hfzero.runtime.placement import Placement, placement_error
from hfzero.testing.models import tiny_causal_lm


@pytest.fixture
def world1():
    """``init_process_group()`` with no backend (torch calls it "undefined"), one rank, in process."""
    dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _fake_cuda_host(monkeypatch: pytest.MonkeyPatch, config: str) -> None:
    """The group reports ``config`` as its backend table and the current accelerator device is 0."""
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)


def test_backend_config_is_parsed() -> None:
    assert parse_backend_config("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert parse_backend_config("cuda:nccl") == {"cuda": "nccl"}
    assert parse_backend_config("gloo") == {"cpu": "gloo"}


def test_undefined_backend_serves_cuda_with_nccl(world1, monkeypatch: pytest.MonkeyPatch) -> None:
    assert str(dist.get_backend()) == "undefined"
    assert Communicator().device == torch.device("cpu")  # this host: "cpu:gloo" only
    # init_process_group() on a CUDA host: "cpu:gloo,cuda:nccl"; the CUDA model's scratch belongs on the GPU
    _fake_cuda_host(monkeypatch, "cpu:gloo,cuda:nccl")
    assert Communicator().device == torch.device("cuda", 0)
    assert _default_device() == torch.device("cuda", 0)
    _fake_cuda_host(monkeypatch, "cpu:gloo,cuda:gloo")  # gloo stages CUDA tensors through the host: CPU scratch
    assert Communicator().device == torch.device("cpu")


def _where(backends: str = "cuda:nccl", current: int | None = 0, local_rank: int | None = 0,
           local_world: int | None = 1, count: int = 1) -> Placement:
    return Placement(parse_backend_config(backends), current, local_rank, local_world, count)


def test_placement_errors_name_the_fix() -> None:
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert placement_error(cuda0, _where()) is None
    assert placement_error(torch.device("cpu"), _where("cpu:gloo", current=None)) is None
    assert placement_error(torch.device("cpu"), Placement({}, None, None, None, 0)) is None  # no process group
    assert "gloo for cpu" in placement_error(torch.device("cpu"), _where("cuda:nccl"))
    assert "nccl for cuda" in placement_error(cuda0, _where("cpu:gloo"))
    error = placement_error(cuda1, _where(local_rank=1, local_world=2, count=2))
    assert "current device is cuda:0" in error and "set_device_index" in error
    # every rank left on cuda:0 of a 2-GPU host: NCCL's "Duplicate GPU detected" at the first collective
    assert "each rank needs its own device" in placement_error(cuda0, _where(local_rank=1, local_world=2, count=2))
    # one GPU per rank through CUDA_VISIBLE_DEVICES: LOCAL_RANK 1 sees its GPU as cuda:0
    assert placement_error(cuda0, _where(local_rank=1, local_world=2, count=1)) is None
    # gloo ranks sharing one GPU (the CUDA tests' layout) are allowed
    assert placement_error(cuda0, _where("cpu:gloo,cuda:gloo", local_rank=1, local_world=2, count=2)) is None


def test_prepare_checks_placement(world1, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_causal_lm("gpt2")
    hfzero.prepare(model, torch.optim.AdamW(model.parameters()), hfzero.ZeroConfig(stage=1))  # gloo, CPU: fine
    model = tiny_causal_lm("gpt2")
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cuda:nccl")
    with pytest.raises(ConfigError, match=r"model is on cpu but the process group serves cuda:nccl.*gloo for cpu"):
        hfzero.prepare(model, torch.optim.AdamW(model.parameters()), hfzero.ZeroConfig(stage=1))
