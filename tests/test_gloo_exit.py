"""Finding 10 of issue 15: a gloo Communicator installs the exit hook of [Note: gloo teardown abort] once."""

from __future__ import annotations

import torch.distributed as dist

from hfzero import gloo_exit
from hfzero.comm.collectives import Communicator


def test_gloo_communicator_installs_the_exit_hook_once(monkeypatch) -> None:
    hooks = []
    monkeypatch.setattr(gloo_exit, "_installed", False)
    monkeypatch.setattr(gloo_exit.atexit, "register", hooks.append)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        Communicator()
        Communicator()
    finally:
        dist.destroy_process_group()
    assert hooks == [gloo_exit._release_gil_briefly]
