"""An unmodified Trainer script (examples/train_clm.py) under `hfzero run --zero_stage S`, S in 0-3, against
plain torchrun (DDP): equal per-step training and evaluation losses, saved models (final, best, every
checkpoint) that from_pretrained loads and that equal DDP's, checkpoints holding every rank's optimizer shard,
exact resumes (at another world size and stage; at stage 3 into another parameter layout), and `--bf16` as
ZeRO's bf16 (16-bit parameters, fp32 master shards) with losses close to fp32.

The tiny model's tensors are all below the default param_persistence_threshold (100 000 elements), so stage 3
runs with `--zero_param_persistence_threshold 0` to partition them; the default (everything persistent) is
covered by the stage-3 resume test.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from test_integration_common import (STEPS, assert_losses_match, clm_args, hfzero_run, log_history, losses,
                                     run_variants)

pytestmark = pytest.mark.slow

PARTITIONED = ["--zero_param_persistence_threshold", "0"]
VARIANTS = {
    "zero0": ["--zero_stage", "0"],
    "zero1": ["--zero_stage", "1"],
    "zero2": ["--zero_stage", "2"],
    "zero3": ["--zero_stage", "3", *PARTITIONED],
    "zero3_bf16": ["--zero_stage", "3", *PARTITIONED, "--bf16", "true"],
}
FP32 = ["zero0", "zero1", "zero2", "zero3"]
STAGE = {"zero0": 0, "zero1": 1, "zero2": 2, "zero3": 3, "zero3_bf16": 3}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return run_variants(tmp_path_factory.mktemp("trainer"), VARIANTS)


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory).state_dict()


def _assert_weights_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], **tolerance: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].numel() > 0, name
        torch.testing.assert_close(got[name], want[name], msg=name, **tolerance)


def _logged(log: str, pattern: str) -> int:
    """A count from the engine's rank-0 log line (e.g. "stage 3: 3 unit(s), 0 persistent parameter(s)")."""
    found = re.findall(pattern, log)
    assert found, (pattern, log[-3000:])
    return int(found[0])


def _persistent_params(log: str) -> int:
    return _logged(log, r"stage 3: \d+ unit\(s\), (\d+) persistent parameter")


@pytest.mark.parametrize("variant", FP32)
def test_losses_match_ddp(runs: dict[str, Path], variant: str) -> None:
    ddp = losses(runs["ddp"])
    assert sorted(ddp) == list(range(1, STEPS + 1)) and ddp[STEPS] != ddp[1]
    # 1e-5 relative is ample: measured equal bit for bit (zero0-3); the weight elements whose rounding Adam
    # amplifies have gradients near 0, so they barely move a loss
    assert_losses_match(losses(runs[variant]), ddp)
    assert_losses_match(losses(runs[variant], "eval_loss"), losses(runs["ddp"], "eval_loss"))


def test_stage3_partitions_the_tiny_model(runs: dict[str, Path]) -> None:
    assert _persistent_params((runs["zero3"].parent / "zero3.log").read_text()) == 0


@pytest.mark.parametrize("variant", FP32)
def test_saved_models_load_and_match_ddp(runs: dict[str, Path], variant: str) -> None:
    """Final model (the best checkpoint, loaded at the end) and each checkpoint's weights equal DDP's."""
    from transformers import AutoTokenizer

    # Not derived yet (issue 19 item 0): measured worst 0.30 of this (7.3e-7 on a c_fc weight at zero2/zero3,
    # whose sharded accumulation sums micro-batch gradients in another association than DDP: noise Adam
    # amplifies), 0.25 at zero0/1; a float64 run of the Trainer's (shuffled) batches would bound it per element.
    for sub in ("", "checkpoint-2", f"checkpoint-{STEPS}"):
        _assert_weights_close(_weights(runs[variant] / sub), _weights(runs["ddp"] / sub), rtol=1e-4, atol=1e-6)
    final, best, last = (_weights(runs[variant] / sub) for sub in ("", "checkpoint-2", f"checkpoint-{STEPS}"))
    assert json.loads((runs[variant] / "trainer_state.json").read_text())["best_global_step"] == 2
    _assert_weights_close(final, best, rtol=0, atol=0)  # load_best_model_at_end loaded checkpoint-2
    assert any(not torch.equal(final[k], last[k]) for k in final)
    assert AutoTokenizer.from_pretrained(runs[variant])("The river")["input_ids"]


@pytest.mark.parametrize("variant", [*FP32, "zero3_bf16"])
def test_checkpoint_holds_every_rank_shard(runs: dict[str, Path], variant: str) -> None:
    for step in (2, STEPS):
        shards = runs[variant] / f"checkpoint-{step}" / "zero_optimizer"
        manifest = json.loads((shards / "manifest.json").read_text())
        assert (manifest["world_size"], manifest["stage"]) == (2, STAGE[variant])
        names = {p.name for p in shards.iterdir()}
        assert {"rank00000-of-00002.safetensors", "rank00001-of-00002.safetensors"} <= names
        assert (runs[variant] / f"checkpoint-{step}" / "scheduler.pt").is_file()


def test_bf16_is_zero_bf16_and_close_to_fp32(runs: dict[str, Path]) -> None:
    """--bf16 sets ZeRO's dtype: bf16 parameters (saved as bf16) and fp32 master shards, not autocast."""
    from safetensors import safe_open

    out = runs["zero3_bf16"]
    manifest = json.loads((out / "checkpoint-2" / "zero_optimizer" / "manifest.json").read_text())
    assert manifest["config"]["dtype"] == "bf16"
    assert (manifest["param_dtype"], manifest["master_dtype"]) == ("bfloat16", "float32")
    with safe_open(str(out / "checkpoint-2" / "zero_optimizer" / "rank00001-of-00002.safetensors"), "pt") as f:
        masters = [f.get_tensor(k) for k in f.keys() if k.startswith("master")]
    assert masters and all(t.dtype == torch.float32 for t in masters)
    assert {t.dtype for t in _weights(out).values()} == {torch.bfloat16}
    ddp, got = losses(runs["ddp"]), losses(out)
    assert got != ddp  # really trained in bf16 (fp32 stage 3 equals DDP bit for bit here)
    # loose: bf16 parameters; the loss falls by ~4% over the 4 steps, far more than this tolerance
    assert_losses_match(got, ddp, rel=2e-3)
    assert_losses_match(losses(out, "eval_loss"), losses(runs["ddp"], "eval_loss"), rel=2e-3)
    _assert_weights_close({k: v.float() for k, v in _weights(out).items()}, _weights(runs["ddp"]),
                          rtol=0, atol=2e-2)


def test_resume_at_another_world_size_and_stage(runs: dict[str, Path], tmp_path: Path) -> None:
    """The stage-2 checkpoint of 2 ranks, resumed by 1 rank at stage 1 with the same global batch."""
    out = tmp_path / "resumed"
    hfzero_run(1, [*clm_args(out, per_device_batch=4), "--zero_stage", "1", "--resume_from_checkpoint",
                   str(runs["zero2"] / "checkpoint-2")])
    original, resumed = losses(runs["zero2"]), losses(out)
    assert_losses_match({s: resumed[s] for s in resumed if s > 2}, {s: original[s] for s in (3, 4)})


def test_stage3_resumes_exactly_into_the_default_persistence(runs: dict[str, Path], tmp_path: Path) -> None:
    """The partitioned stage-3 checkpoint resumed at stage 3 with the default threshold (every tensor kept
    whole: another layout, resharded on load): the next losses, the evaluation and the weights are equal."""
    out = tmp_path / "resumed3"
    log = hfzero_run(2, [*clm_args(out), "--zero_stage", "3", "--resume_from_checkpoint",
                         str(runs["zero3"] / "checkpoint-2")])
    assert _persistent_params(log) == _logged(log, r"(\d+) trainable parameters") > 0
    original = losses(runs["zero3"])
    resumed = {s: v for s, v in losses(out).items() if s > 2}
    assert_losses_match(resumed, {s: original[s] for s in (3, 4)})
    assert [h["step"] for h in log_history(out) if "eval_loss" in h][-1] == STEPS
    assert_losses_match({STEPS: losses(out, "eval_loss")[STEPS]}, {STEPS: losses(runs["zero3"], "eval_loss")[STEPS]})
    # not bit for bit: whole tensors are reduced in other groupings than shards; measured 0.29 of this (2.9e-8)
    _assert_weights_close(_weights(out / f"checkpoint-{STEPS}"), _weights(runs["zero3"] / f"checkpoint-{STEPS}"),
                          rtol=1e-5, atol=1e-7)
    _assert_weights_close(_weights(out), _weights(runs["zero3"] / "checkpoint-2"), rtol=0, atol=0)  # best model
