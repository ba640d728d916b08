"""Bad input: every problem is reported with the file and what is wrong, before anything is loaded.

Each case damages a copy of one good checkpoint, then checks the error message and that the model,
the optimizer state and the hyper-parameters are exactly as before the failed load.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hfzero.checkpoint import CheckpointError, consolidate, load_checkpoint, save_checkpoint
from test_checkpoint_kill import build, data, train

RANK_FILE = "rank00000-of-00001.safetensors"


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    model, opt = build()
    train(model, opt, data()[:2])
    path = tmp_path_factory.mktemp("good") / "ckpt"
    save_checkpoint(path, model, opt, extra={"step": 2})
    return path


def _snapshot(model, opt) -> list[torch.Tensor]:
    # parameters and buffers, plus the master views (at stage 3, where parameters are 0-element tensors
    # between uses, those are the parameter shards)
    tensors = [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]
    tensors += [v.detach().clone() for v in opt.engine.master_views]
    for state in opt.engine.optimizer.state.values():
        tensors += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors + [torch.tensor([g["lr"] for g in opt.param_groups])]


def _expect_untouched_failure(path: Path, match: str, **build_kwargs) -> str:
    model, opt = build(seed=3, **build_kwargs)
    train(model, opt, data()[:1])
    before = _snapshot(model, opt)
    with pytest.raises(CheckpointError, match=match) as info:
        load_checkpoint(path, model, opt)
    after = _snapshot(model, opt)
    assert len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after)), \
        "a failed load changed the model or optimizer"
    return str(info.value)


def _copy(good: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(good, tmp_path / "ckpt"))


def test_good_checkpoint_loads(good):
    model, opt = build(seed=3)
    assert load_checkpoint(good, model, opt) == {"step": 2}


def test_missing_file(good, tmp_path):
    path = _copy(good, tmp_path)
    (path / RANK_FILE).unlink()
    message = _expect_untouched_failure(path, "missing")
    assert RANK_FILE in message


def test_truncated_shard(good, tmp_path):
    path = _copy(good, tmp_path)
    data_ = (path / RANK_FILE).read_bytes()
    (path / RANK_FILE).write_bytes(data_[: len(data_) // 2])
    message = _expect_untouched_failure(path, "truncated")
    assert RANK_FILE in message


def test_corrupt_shard_checksum(good, tmp_path):
    path = _copy(good, tmp_path)
    raw = bytearray((path / RANK_FILE).read_bytes())
    raw[-5] ^= 0xFF  # same size, one flipped byte in the tensor data
    (path / RANK_FILE).write_bytes(bytes(raw))
    message = _expect_untouched_failure(path, "checksum mismatch")
    assert RANK_FILE in message
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        consolidate(path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_newer_format_version(good, tmp_path):
    path = _copy(good, tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format_version"] = 99
    (path / "manifest.json").write_text(json.dumps(manifest))
    message = _expect_untouched_failure(path, "newer hfzero")
    assert "manifest.json" in message and "99" in message
    with pytest.raises(CheckpointError, match="newer hfzero"):
        consolidate(path, tmp_path / "hf")


def test_corrupt_manifest(good, tmp_path):
    path = _copy(good, tmp_path)
    text = (path / "manifest.json").read_text()
    (path / "manifest.json").write_text(text[: len(text) // 2])
    _expect_untouched_failure(path, "manifest.json is not valid JSON")


def test_tampered_manifest_ranges(good, tmp_path):
    path = _copy(good, tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["params"]["fc1.weight"]["pieces"][0]["end"] -= 8
    (path / "manifest.json").write_text(json.dumps(manifest))
    _expect_untouched_failure(path, "malformed.*fc1.weight")


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_of_another_model_shape(good, stage):
    # stage 3: the model's shapes come from the layout (its parameters are 0-element shards between uses)
    message = _expect_untouched_failure(good, "another model: shape mismatch", stage=stage, hidden=48)
    assert "fc1.weight" in message and "(32, 8)" in message and "(48, 8)" in message
    assert "(0,)" not in message


def test_stage1_checkpoint_loads_at_stage3_and_back(good, tmp_path):
    """World 1: a stage-1 checkpoint resumes at stage 3 (all parameters partitioned), and a checkpoint that
    stage 3 saves resumes at stage 1; losses equal uninterrupted stage-1 training."""
    from hfzero.runtime.stage3 import full_state_dict
    from test_checkpoint_kill import train

    reference = train(*build(), data())
    model, opt = build(stage=3, seed=3)
    assert load_checkpoint(good, model, opt) == {"step": 2}
    losses = train(model, opt, data()[2:4])
    save_checkpoint(tmp_path / "s3", model, opt, extra={"step": 4})
    trained = full_state_dict(model)
    model1, opt1 = build(stage=1, seed=5)
    load_checkpoint(tmp_path / "s3", model1, opt1)
    assert all(torch.equal(v, trained[k]) for k, v in model1.state_dict().items())
    losses += train(model1, opt1, data()[4:])
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference[2:]), atol=1e-6, rtol=0)


def test_checkpoint_of_another_model_names(good):
    message = _expect_untouched_failure(good, "another model", name="encoder")
    assert "encoder.weight" in message and "fc1.weight" in message


def test_other_optimizer_class(good):
    from hfzero import ZeroConfig, prepare
    from test_checkpoint_kill import MLP

    model = MLP(3)
    model, opt = prepare(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1,
                                                momentum=0.9), ZeroConfig(stage=1))
    with pytest.raises(CheckpointError, match="saved for AdamW.*SGD"):
        load_checkpoint(good, model, opt)


def test_incomplete_checkpoint(good, tmp_path):
    path = _copy(good, tmp_path)
    (path / "manifest.json").unlink()
    message = _expect_untouched_failure(path, "incomplete checkpoint")
    assert str(path) in message


def test_missing_directory(tmp_path):
    _expect_untouched_failure(tmp_path / "nope", "does not exist")


def test_extra_must_be_json(tmp_path):
    model, opt = build()
    with pytest.raises(CheckpointError, match="JSON"):
        save_checkpoint(tmp_path / "ckpt", model, opt, extra={"when": object()})
    assert list(tmp_path.iterdir()) == []


def test_save_refuses_to_replace_other_directories(tmp_path):
    model, opt = build()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not a hfzero checkpoint"):
        save_checkpoint(tmp_path / "mine", model, opt)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_never_unpickles():
    source = "\n".join(p.read_text() for p in Path(__file__).parents[1].joinpath("hfzero", "checkpoint").glob("*.py"))
    assert "import pickle" not in source and "torch.load(" not in source and "pickle.load" not in source


def test_cli_reports_errors(tmp_path, capsys):
    from hfzero.cli import main

    assert main(["consolidate", str(tmp_path / "none"), str(tmp_path / "out")]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_fp16_loss_scaler_skipped_steps_and_hyperparameters_round_trip(tmp_path):
    from hfzero import ZeroConfig, prepare
    from test_checkpoint_kill import MLP

    def make(seed):
        model = MLP(seed)
        return prepare(model, torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2,
                                               betas=(0.8, 0.9)), ZeroConfig(stage=2, dtype="fp16"))

    model, opt = make(0)
    opt.engine.scaler.load_state_dict({"scale": 1024.0, "good_steps": 7, "overflows_left": 1})
    opt.skipped_steps = 2
    opt.param_groups[0]["lr"] = 0.123
    opt.param_groups[0]["betas"] = (0.7, 0.95)
    save_checkpoint(tmp_path / "ckpt", model, opt)
    model2, opt2 = make(1)
    load_checkpoint(tmp_path / "ckpt", model2, opt2)
    assert opt2.engine.scaler.state_dict() == {"scale": 1024.0, "good_steps": 7, "overflows_left": 1}
    assert opt2.skipped_steps == 2
    assert opt2.param_groups[0]["lr"] == 0.123 and opt2.param_groups[0]["betas"] == (0.7, 0.95)
    assert opt2.engine.optimizer.param_groups[0]["betas"] == (0.7, 0.95)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert a.dtype == torch.float16 and torch.equal(a, b)
