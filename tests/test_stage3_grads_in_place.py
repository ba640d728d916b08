"""Stage 3 accumulates gradients in place in the staging buffers (issue 34; [Note: gradients in place] in
hfzero/runtime/reducer.py), 2 gloo ranks, fp32, every parameter partitioned:

- a unit whose module also runs inside an earlier unit's forward (its gradient arrives after its bucket's
  reduction left: the late path) trains exactly like DDP, step by step;
- the in-place path is the one taken (the reducer's collect finds each parameter's gradient in its slot, but for
  the gradients that arrived before the reducer's pass started) and no parameter's ``.grad`` is left pointing
  into a staging buffer after a backward;
- ``backward(create_graph=True)`` (autograd replaces ``.grad`` out of place: the copy path) and a
  ``torch.autograd.grad`` call through the model before the backward (no gradient accumulated: no reducer pass,
  nothing left behind) train exactly like the plain backward; so does ``create_graph`` at stages 0 and 2 (the
  hook copies a detached gradient: before, the stores joined the graph and the step raised).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import hfzero
from hfzero.runtime import reducer as reducer_module
from hfzero.testing.spawn import run_distributed

STEPS = 3
UNITS = ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]


class _Reused(nn.Module):
    """An embedding, four linear blocks (the stage-3 units) and a head; block 3 also runs right after block 1."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for index, block in enumerate(self.blocks):
            h = torch.tanh(block(h))
            if index == 1:
                h = h + 0.5 * self.blocks[3](h)
        return self.head(h)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 16, (4, 6), generator=g), torch.randint(0, 16, (4, 6), generator=g)


def _loss(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(ids).reshape(-1, 16), labels.reshape(-1))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, mode: str = "plain") -> dict:
    losses, left_set = [], 0
    for step in range(STEPS):
        ids, labels = _batch(rank, step)
        if mode == "grad_first":  # a gradient computed through the model, accumulated nowhere
            extra = _loss(model, ids, labels)
            torch.autograd.grad(extra, [p for p in model.head.parameters()])
            left_set += sum(p.grad is not None for p in model.parameters())
        loss = _loss(model, ids, labels)
        loss.backward(create_graph=mode == "create_graph")
        left_set += sum(p.grad is not None for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "left_set": left_set}


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    full = hfzero.full_state_dict(model, rank0_only=False)
    return {k: v.detach().clone() for k, v in full.items()}


def _worker(rank: int, world: int) -> dict:
    paths = {"slot": 0, "copy": 0}
    collect = reducer_module.GradientReducer.collect

    def counting(self):
        for param in self._arrived:  # every gradient of a stage-3 backward is taken here
            preset = self._preset.get(id(param))
            paths["slot" if preset is not None and preset is param.grad else "copy"] += 1
        return collect(self)

    reducer_module.GradientReducer.collect = counting
    out = {}
    for mode in ("plain", "create_graph", "grad_first"):
        model = _Reused()
        config = hfzero.ZeroConfig(stage=3, dtype="fp32", param_persistence_threshold=0,
                                   reduce_bucket_size=64)
        model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config, units=UNITS)
        engine = hfzero.get_engine(model)
        result = _train(model, optimizer, rank, mode)
        result["params"] = _params(model)
        result["preset_left"] = len(engine.reducer._preset)
        out[mode] = result
        if mode == "plain":
            out["paths"] = dict(paths)
            out["params_per_step"] = len(engine.layout.slots)
    reducer_module.GradientReducer.collect = collect
    for stage in (0, 2):  # the copy path at the other stages: create_graph must not pull the stores into a graph
        model = _Reused()
        config = hfzero.ZeroConfig(stage=stage, dtype="fp32", reduce_bucket_size=64)
        model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)
        result = _train(model, optimizer, rank, "create_graph")
        result["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        result["preset_left"] = 0
        out[f"stage{stage}_create_graph"] = result

    reference = _Reused()
    ddp = nn.parallel.DistributedDataParallel(reference)
    want = _train(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2), rank)
    want["params"] = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    out["ddp"] = want
    dist.barrier()
    return out


def test_in_place_gradients_train_like_ddp_on_every_path():
    results = run_distributed(_worker, 2)
    for rank, out in enumerate(results):
        want = out["ddp"]
        for mode in ("plain", "create_graph", "grad_first", "stage0_create_graph", "stage2_create_graph"):
            got = out[mode]
            assert got["left_set"] == 0 and got["preset_left"] == 0, (rank, mode)
            for a, b in zip(got["losses"], want["losses"]):
                assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (rank, mode, got["losses"], want["losses"])
            for name, value in want["params"].items():
                torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, n=name, mo=mode: f"rank {rank} {mo} {n}: {m}")
        # every parameter takes the in-place path but the gradients that arrived before the reducer's pass started
        # (the head's: the pass starts when the backward pass reaches its first block, at the collect there) and
        # block 3's late weight and bias (their bucket left before their second use's gradient)
        paths = out["paths"]
        assert paths["slot"] + paths["copy"] == STEPS * out["params_per_step"], paths
        assert paths["copy"] <= STEPS * 4, paths
        assert paths["slot"] >= STEPS * (out["params_per_step"] - 4), paths
