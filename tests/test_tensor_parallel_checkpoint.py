"""TP checkpoints (one 4-rank spawn): a dp=2 x tp=2 ZeRO-2 Llama saved after 3 AdamW steps, loaded at
dp=4 x tp=1 (ZeRO-1) and at dp=2 x tp=2 (ZeRO-3); the dp=4 x tp=1 state saved again and loaded back at
dp=2 x tp=2 (ZeRO-3). Right after each load the whole parameters equal the saved ones exactly, and the next
2 losses equal the uninterrupted dp=2 x tp=2 run's within 1e-5 (fp32; the dp size changes the summation
order). The checkpoint is one checkpoint of the whole model: ``hfzero consolidate`` writes whole tensors
that from_pretrained loads, equal to the trained parameters. See [Note: tensor-parallel checkpoints].
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_tensor_parallel import BATCH, _batches, _llama

from hfzero.testing.spawn import run_distributed

pytestmark = pytest.mark.slow

SAVE_AT, MORE, LR = 3, 2, 1e-3


def _optimizer(params):
    return torch.optim.AdamW(params, lr=LR)


def _build(stage: int, tp: int):
    """(model, optimizer, dp size, dp rank) of a fresh model prepared at ``stage`` over dp x tp."""
    import torch.distributed as dist

    import hfzero
    from hfzero.parallel.tensor import prepare_tensor_parallel

    config = hfzero.ZeroConfig(stage=stage, tp_size=tp, reduce_bucket_size=2000, param_persistence_threshold=0)
    if tp == 1:
        model = _llama()
        model, optimizer = hfzero.prepare(model, _optimizer(model.parameters()), config)
        return model, optimizer, dist.get_world_size(), dist.get_rank()
    model, optimizer, mesh = prepare_tensor_parallel(_llama(), _optimizer, config)
    return model, optimizer, mesh.dp_size, mesh.dp_rank


def _steps(model, optimizer, dp: int, dp_rank: int, batches: list[torch.Tensor]) -> list[float]:
    import torch.distributed as dist

    losses = []
    for ids in batches:
        mine = ids.chunk(dp)[dp_rank]  # (B / dp, T)
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # every rank's mean; the TP ranks of a replica hold the same loss
        losses.append(total.item() / dist.get_world_size())
    return losses


def _whole(model) -> dict[str, torch.Tensor]:
    import hfzero

    return hfzero.full_state_dict(model, rank0_only=False)


def _worker(rank: int, world: int, root: str) -> dict:
    from hfzero.checkpoint import consolidate, load_checkpoint, save_checkpoint

    root_dir = Path(root)
    batches = _batches()
    model, optimizer, dp, dp_rank = _build(2, 2)
    _steps(model, optimizer, dp, dp_rank, batches[:SAVE_AT])
    save_checkpoint(root_dir / "tp2", model, optimizer)
    saved = _whole(model)
    out = {"saved": saved, "continued": _steps(model, optimizer, dp, dp_rank, batches[SAVE_AT:SAVE_AT + MORE])}
    if rank == 0:
        consolidate(root_dir / "tp2", root_dir / "export")
    for name, (stage, tp), source in (("tp1_s1", (1, 1), "tp2"), ("tp2_s3", (3, 2), "tp2"),
                                      ("back_tp2_s3", (3, 2), "tp1")):
        model, optimizer, dp, dp_rank = _build(stage, tp)
        load_checkpoint(root_dir / source, model, optimizer)
        out[name] = {"loaded": _whole(model),
                     "losses": _steps(model, optimizer, dp, dp_rank, batches[SAVE_AT:SAVE_AT + MORE])}
        if name == "tp1_s1":  # dp=4 x tp=1, loaded from tp=2: saved again, loaded back at tp=2 below
            model, optimizer, dp, dp_rank = _build(1, 1)
            load_checkpoint(root_dir / "tp2", model, optimizer)
            save_checkpoint(root_dir / "tp1", model, optimizer)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    root = tmp_path_factory.mktemp("tp_ckpt")
    return run_distributed(_worker, 4, str(root), timeout=600), root


@pytest.mark.parametrize("case", ["tp1_s1", "tp2_s3", "back_tp2_s3"])
def test_tp_checkpoint_reshards(results: tuple[list[dict], Path], case: str) -> None:
    ranks, _ = results
    for rank in ranks:
        saved = rank["saved"]
        assert rank[case]["loaded"].keys() == saved.keys()
        for name, value in saved.items():
            assert torch.equal(rank[case]["loaded"][name], value), name
        assert rank[case]["losses"] == pytest.approx(rank["continued"], abs=1e-5)


def test_tp_checkpoint_manifest_and_export(results: tuple[list[dict], Path]) -> None:
    from transformers import AutoModelForCausalLM

    ranks, root = results
    manifest = json.loads((root / "tp2" / "manifest.json").read_text())
    assert manifest["world_size"] == 4 and manifest["tensor_parallel"] == {"tp_size": 2, "dp_size": 2}
    assert manifest["params"]["model.layers.0.self_attn.o_proj.weight"]["shape"] == [32, 32]  # whole, not a shard
    # a rowwise (dim-1) shard is one run per row: pieces with an offset into the rank file's tensor
    assert any(p.get("at") for p in manifest["params"]["model.layers.0.mlp.down_proj.weight"]["pieces"])
    exported = AutoModelForCausalLM.from_pretrained(root / "export").state_dict()
    for name, value in ranks[0]["saved"].items():
        assert torch.equal(exported[name], value), name
    assert BATCH % 4 == 0  # dp=4 gets whole rows
