"""Node-local checkpoint storage: two ranks, each a "node" with its own directory and no shared one.

One 2-rank spawn: save at stage 2 into ``node<r>/ckpt`` (each rank sees only its own node directory),
check what each node holds, resume at stage 2 (frozen tensors fetched from node 0 for node 1) with losses
equal to uninterrupted training, load at stage 0 (every rank file fetched across nodes), and name the
file that is missing on every node.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from hfzero import ZeroConfig, prepare
from hfzero.checkpoint import CheckpointError, load_checkpoint_node_local, save_checkpoint_node_local
from hfzero.testing import run_distributed

K, STEPS = 2, 4


class MLP(nn.Module):
    """Trainable layers, a frozen layer and a persistent buffer (frozen tensors are written on node 0 only)."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 4)
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.frozen(self.fc2(torch.relu(self.fc1(x)))) * (1 + 0.01 * self.calls)


def _build(stage: int, seed: int = 0):
    model = MLP(seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return prepare(model, opt, ZeroConfig(stage=stage, reduce_bucket_size=100))


def _train(model, opt, rank: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(100 * step + rank)
        loss = nn.functional.mse_loss(model(torch.randn(16, 8, generator=g)), torch.randn(16, 4, generator=g))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _worker(rank: int, world: int, root: str) -> dict:
    ckpt = Path(root) / f"node{rank}" / "ckpt"  # each rank sees only its own node's directory
    model, opt = _build(2)
    _train(model, opt, rank, range(K))
    save_checkpoint_node_local(ckpt, model, opt, extra={"step": K})
    held = sorted(p.name for p in ckpt.iterdir())
    manifest = (ckpt / "manifest.json").read_bytes()
    reference = _train(model, opt, rank, range(K, STEPS))

    model, opt = _build(2, seed=7)
    extra = load_checkpoint_node_local(ckpt, model, opt)
    after_load = sorted(p.name for p in ckpt.iterdir())
    resumed = _train(model, opt, rank, range(K, STEPS))

    model0, opt0 = _build(0, seed=9)  # stage 0 holds every bucket whole: reads every rank file
    load_checkpoint_node_local(ckpt, model0, opt0)
    model2, opt2 = _build(2, seed=11)
    load_checkpoint_node_local(ckpt, model2, opt2)
    same = all(torch.equal(a, b) for a, b in zip(model0.state_dict().values(), model2.state_dict().values()))

    if rank == 1:
        (ckpt / "rank00001-of-00002.safetensors").unlink()  # now on no node
    try:
        load_checkpoint_node_local(ckpt, *_build(2, seed=13))
        missing = ""
    except CheckpointError as error:
        missing = str(error)
    return {"held": held, "manifest": manifest.decode(), "reference": reference, "resumed": resumed, "extra": extra,
            "after_load": after_load, "same": same, "missing": missing,
            "leftovers": sorted(p.name for p in ckpt.parent.iterdir())}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_distributed(_worker, 2, str(tmp_path_factory.mktemp("node_local")))


def test_each_node_holds_its_own_rank_files(results: list[dict]) -> None:
    node0, node1 = results
    assert node0["held"] == ["frozen.safetensors", "manifest.json", "rank00000-of-00002.safetensors"]
    assert node1["held"] == ["manifest.json", "rank00001-of-00002.safetensors"]  # not node 0's files
    assert node0["manifest"] == node1["manifest"]
    assert json.loads(node0["manifest"])["world_size"] == 2
    assert node0["leftovers"] == node1["leftovers"] == ["ckpt"]  # no .partial, .previous or probe left


def test_resume_without_a_shared_directory_is_exact(results: list[dict]) -> None:
    for r in results:
        assert r["extra"] == {"step": K}
        assert r["resumed"] == r["reference"]  # bit for bit
        assert r["after_load"] == r["held"]  # files fetched for the load are deleted again


def test_a_load_reading_every_file_fetches_them(results: list[dict]) -> None:
    assert all(r["same"] for r in results)  # stage 0 (every rank file) == stage 2 (own files)


def test_a_file_on_no_node_is_named(results: list[dict]) -> None:
    for r in results:
        assert "rank00001-of-00002.safetensors missing on every node" in r["missing"]
        assert "node of ranks [0] holds" in r["missing"] and "node of ranks [1] holds" in r["missing"]
