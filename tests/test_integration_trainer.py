"""An unmodified Trainer script (examples/train_clm.py) under `hfzero run --zero_stage 2` against plain
torchrun (DDP): equal per-step losses, a saved model that from_pretrained loads and equals DDP's,
checkpoints holding every rank's optimizer shard, an exact resume at another world size and stage.
Stages 0 and 1: test_integration_trainer_stages.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_integration_common import STEPS, assert_losses_match, clm_args, hfzero_run, losses, torchrun

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("trainer")
    outs = {"ddp": root / "ddp", "zero2": root / "zero2"}
    torchrun(2, clm_args(outs["ddp"]))
    hfzero_run(2, [*clm_args(outs["zero2"]), "--zero_stage", "2"])
    return outs


def test_losses_match_ddp(runs: dict[str, Path]) -> None:
    ddp = losses(runs["ddp"])
    assert sorted(ddp) == list(range(1, STEPS + 1)) and ddp[STEPS] != ddp[1]
    assert_losses_match(losses(runs["zero2"]), ddp)


def test_saved_model_loads_and_matches_ddp(runs: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ddp = AutoModelForCausalLM.from_pretrained(runs["ddp"]).state_dict()
    zero = AutoModelForCausalLM.from_pretrained(runs["zero2"]).state_dict()
    assert ddp.keys() == zero.keys()
    for name in ddp:
        torch.testing.assert_close(zero[name], ddp[name], rtol=1e-4, atol=1e-6, msg=name)
    assert AutoTokenizer.from_pretrained(runs["zero2"])("The river")["input_ids"]


def test_checkpoint_holds_every_rank_shard(runs: dict[str, Path]) -> None:
    shards = runs["zero2"] / "checkpoint-2" / "zero_optimizer"
    assert json.loads((shards / "manifest.json").read_text())["world_size"] == 2
    names = {p.name for p in shards.iterdir()}
    assert {"rank00000-of-00002.safetensors", "rank00001-of-00002.safetensors"} <= names
    assert (runs["zero2"] / "checkpoint-2" / "scheduler.pt").is_file()


def test_resume_at_another_world_size_and_stage(runs: dict[str, Path], tmp_path: Path) -> None:
    """The stage-2 checkpoint of 2 ranks, resumed by 1 rank at stage 1 with the same global batch."""
    out = tmp_path / "resumed"
    hfzero_run(1, [*clm_args(out, per_device_batch=4), "--zero_stage", "1", "--resume_from_checkpoint",
                   str(runs["zero2"] / "checkpoint-2")])
    original, resumed = losses(runs["zero2"]), losses(out)
    assert_losses_match({s: resumed[s] for s in resumed if s > 2}, {s: original[s] for s in (3, 4)})
