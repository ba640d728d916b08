"""Finding 10 of issue 15: a gloo Communicator installs the exit hook of [Note: gloo teardown abort] once."""

from __future__ import annotations

import torch.distributed as dist

from hfzero.comm import gloo_exit
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


def test_a_gloo_communicator_keeps_its_group_until_exit(monkeypatch) -> None:
    """An engine collected after ``destroy_process_group`` must not destroy the gloo group on the main thread
    (the deadlock of [Note: gloo teardown abort]): the Communicator hands its group to ``gloo_exit.keep``."""
    monkeypatch.setattr(gloo_exit, "_kept", [])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        world = dist.group.WORLD
        Communicator()
        Communicator()
    finally:
        dist.destroy_process_group()
    assert len(gloo_exit._kept) == 1 and gloo_exit._kept[0] is world
