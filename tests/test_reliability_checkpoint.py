"""Issue 15: checkpoints under bad input, in process (world 1).

- consolidate never deletes or overwrites its input (OUT equal to, inside or holding CKPT) (finding 1);
- consolidate reports unwritable/unreadable paths and corrupt files as CheckpointError, leaves no
  ``.partial``, replaces a file with ``--overwrite``, and catches a reshaped parameter (finding 8);
- edited manifests fail with CheckpointError before the model changes; foreign directories are
  named for what they are (finding 7);
- a Trainer checkpoint whose ``zero_optimizer/`` swap was interrupted resumes (finding 6).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import types
from pathlib import Path

import pytest
import torch

from hfzero.checkpoint import CheckpointError, consolidate, load_checkpoint, save_checkpoint
from test_checkpoint_errors import _copy, _expect_untouched_failure, good  # noqa: F401 - the fixture
from test_checkpoint_kill import build, data, train

RANK_FILE = "rank00000-of-00001.safetensors"


def _digest(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def _edit(path: Path, edit) -> Path:
    manifest = json.loads((path / "manifest.json").read_text())
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


# ---- finding 1: consolidate never deletes its input ------------------------------------------------
@pytest.mark.parametrize("where", ["same", "parent", "inside", "previous"])
def test_consolidate_refuses_output_overlapping_the_checkpoint(good, tmp_path, where):  # noqa: F811
    from hfzero.cli import main

    trainer_ckpt = tmp_path / "checkpoint-4"
    ckpt = Path(shutil.copytree(good, trainer_ckpt / "zero_optimizer"))
    given, out = ckpt, {"same": ckpt, "parent": trainer_ckpt, "inside": ckpt / "hf"}.get(where)
    if where == "previous":  # an interrupted swap: CKPT is missing, its complete copy waits at .CKPT.previous
        os.rename(ckpt, trainer_ckpt / ".zero_optimizer.previous")
        out = ckpt
    before = _digest(trainer_ckpt)
    assert main(["consolidate", str(given), str(out), "--overwrite"]) == 1
    with pytest.raises(CheckpointError, match="overlaps the checkpoint"):
        consolidate(given, out, overwrite=True)
    assert _digest(trainer_ckpt) == before


# ---- finding 8: consolidate's file-system and file errors ------------------------------------------
def test_consolidate_reports_unwritable_and_not_a_directory(good, tmp_path, capsys):  # noqa: F811
    from hfzero.cli import main

    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["consolidate", str(good), str(blocker / "out")]) == 1
    assert "cannot write" in capsys.readouterr().err
    if os.geteuid() != 0:  # root ignores permissions
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert main(["consolidate", str(good), str(locked / "out")]) == 1
        assert "cannot write" in capsys.readouterr().err
    assert not [p for p in tmp_path.rglob("*.partial")]


def test_consolidate_overwrites_a_file_and_exits_0(good, tmp_path):  # noqa: F811
    from hfzero.cli import main

    out = tmp_path / "out"
    out.write_text("old")
    assert main(["consolidate", str(good), str(out), "--overwrite"]) == 0
    assert (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_consolidate_no_verify_corrupt_header_is_an_error(good, tmp_path, capsys):  # noqa: F811
    from hfzero.cli import main

    path = _copy(good, tmp_path)
    raw = bytearray((path / RANK_FILE).read_bytes())
    raw[10:20] = b"#" * 10  # the JSON header: same size, unreadable
    (path / RANK_FILE).write_bytes(bytes(raw))
    assert main(["consolidate", str(path), str(tmp_path / "hf"), "--no-verify"]) == 1
    assert "not a readable safetensors file" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_consolidate_catches_a_reshaped_parameter(good, tmp_path):  # noqa: F811
    path = _edit(_copy(good, tmp_path), lambda m: m["params"]["fc1.weight"].update(shape=[8, 32]))
    with pytest.raises(CheckpointError, match=r"fc1.weight.*saved with shape \[32, 8\]"):
        consolidate(path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


# ---- finding 7: edited manifests and foreign directories --------------------------------------------
@pytest.mark.parametrize("edit, match", [
    (lambda m: m["params"]["fc1.weight"].pop("scalars"), "missing"),
    (lambda m: m.pop("params"), "missing"),
    (lambda m: m["ranks"][0].pop("rng"), "missing"),
    (lambda m: m.update(loss_scaler=[1, 2]), "loss_scaler"),
    (lambda m: m["loss_scaler"].pop("scale"), "loss_scaler"),
    (lambda m: m["loss_scaler"].update(good_steps=1.5), "loss_scaler"),
    (lambda m: m["ranks"][0]["rng"].update(python={"version": "x"}), "RNG state is malformed"),
    (lambda m: m["optimizer"]["param_groups"][0]["hyper"].update(lr="fast"), "lr='fast'"),
    (lambda m: m["optimizer"]["param_groups"][0]["hyper"].update(betas=[0.9]), "betas"),
    (lambda m: [p["scalars"].update(step="x") for p in m["params"].values()], "step='x'"),
    (lambda m: m["params"]["fc1.weight"]["pieces"][0].update(start="0"), "not an integer"),
])
def test_edited_manifest_fails_before_anything_changes(good, tmp_path, edit, match):  # noqa: F811
    path = _edit(_copy(good, tmp_path), edit)
    _expect_untouched_failure(path, match)


@pytest.mark.parametrize("files, match", [
    ({"config.json": "{}", "model.safetensors": ""}, "Hugging Face model directory.*from_pretrained"),
    ({"latest": "global_step4", "global_step4/x": ""}, "DeepSpeed checkpoint"),
    ({"trainer_state.json": "{}", "zero_optimizer/x": ""}, "Trainer or accelerate checkpoint.*zero_optimizer"),
    ({"notes.txt": ""}, "not a hfzero checkpoint"),
])
def test_foreign_directory_is_named_not_called_incomplete(tmp_path, files, match):
    for name, text in files.items():
        (tmp_path / "d" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "d" / name).write_text(text)
    message = _expect_untouched_failure(tmp_path / "d", match)
    assert "incomplete" not in message


# ---- finding 6: Trainer resume after an interrupted zero_optimizer/ swap ----------------------------
def test_trainer_resumes_from_the_previous_copy_of_an_interrupted_swap(tmp_path):
    from hfzero.integrations.trainer import ZeroTrainer

    model, opt = build()
    train(model, opt, data()[:2])
    checkpoint = tmp_path / "checkpoint-2"
    save_checkpoint(checkpoint / "zero_optimizer", model, opt)
    os.rename(checkpoint / "zero_optimizer", checkpoint / ".zero_optimizer.previous")
    expected = [p.detach().clone() for p in model.parameters()]
    model2, opt2 = build(seed=3)
    trainer = types.SimpleNamespace(model=model2, optimizer=opt2, lr_scheduler=None,
                                    args=types.SimpleNamespace(save_on_each_node=False))
    ZeroTrainer._load_optimizer_and_scheduler(trainer, str(checkpoint))  # type: ignore[arg-type]
    assert all(torch.equal(a, b) for a, b in zip(model2.parameters(), expected))
    load_checkpoint(checkpoint / "zero_optimizer", *build(seed=4))  # the library finds it too
