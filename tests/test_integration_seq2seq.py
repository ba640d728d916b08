"""Seq2SeqTrainer under `hfzero run --zero_stage 3` (tiny BART from a config, every tensor partitioned):
it derives from ZeroTrainer, trains with DDP's losses, and `predict` with `--predict_with_generate` (the
encoder called through get_encoder(), synced generate) gives DDP's loss and generated ids; the
Trainer's "Number of trainable parameters" is the real count, not the 0-element shards."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_integration_common import ROOT, assert_losses_match, hfzero_run, torchrun

pytestmark = pytest.mark.slow

SCRIPT = str(ROOT / "tests" / "scripts" / "seq2seq_trainer.py")
EOS, PAD = 2, 1


def _args(out: Path) -> list[str]:
    return [SCRIPT, "--output_dir", str(out), "--max_steps", "4", "--per_device_train_batch_size", "4",
            "--per_device_eval_batch_size", "4", "--learning_rate", "1e-3", "--logging_steps", "1",
            "--predict_with_generate", "true", "--generation_max_length", "8", "--save_strategy", "no",
            "--report_to", "none", "--disable_tqdm", "true", "--seed", "0", "--log_level", "info"]


def _until_eos(row: list[int]) -> list[int]:
    """Generated ids after the decoder start token (EOS for BART) up to the first EOS (DDP and synced
    generation pad finished rows differently: -100 or PAD)."""
    kept = [t for t in row[1:] if t not in (-100, PAD)]
    return kept[: kept.index(EOS) + 1] if EOS in kept else kept


def _trainable(output: str) -> int:
    return int(re.search(r"Number of trainable parameters = ([\d,]+)", output).group(1).replace(",", ""))


def test_seq2seq_trainer_predict_with_generate_at_stage3(tmp_path: Path) -> None:
    ddp_log = torchrun(2, _args(tmp_path / "ddp"))
    zero_log = hfzero_run(2, [*_args(tmp_path / "zero"), "--zero_stage", "3", "--zero_param_persistence_threshold", "0"])
    ddp = json.loads((tmp_path / "ddp" / "result.json").read_text())
    zero = json.loads((tmp_path / "zero" / "result.json").read_text())
    assert "ZeroTrainer" in zero["mro"] and zero["mro"][0] == "Seq2SeqTrainer"
    assert_losses_match({int(k): v for k, v in zero["losses"].items()}, {int(k): v for k, v in ddp["losses"].items()})
    assert abs(zero["test_loss"] - ddp["test_loss"]) <= 1e-5 * abs(ddp["test_loss"])
    assert [_until_eos(r) for r in zero["ids"]] == [_until_eos(r) for r in ddp["ids"]]
    assert len(zero["ids"]) == 16 and all(len(_until_eos(r)) > 2 for r in zero["ids"])
    assert _trainable(zero_log) == _trainable(ddp_log) > 0
