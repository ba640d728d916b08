"""`hfzero run` bad input: rejected with a clear message and a non-zero exit before any process starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hfzero.config import ConfigError
from hfzero.integrations.launch import plan, split_zero_options

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCRIPT = str(EXAMPLES / "train_clm.py")


def test_split_removes_zero_options_and_keeps_the_rest() -> None:
    rest, options = split_zero_options(["--output_dir", "o", "--zero_stage", "1", "--zero_dtype=bf16",
                                        "--zero_overlap_comm", "--max_steps", "3"])
    assert rest == ["--output_dir", "o", "--max_steps", "3"]
    assert options == {"stage": "1", "dtype": "bf16", "overlap_comm": "true"}


def test_plan_rewrites_entry_point_and_exports_env() -> None:
    p = plan(["--nproc_per_node", "2", SCRIPT, "--output_dir", "o", "--zero_stage", "1"])
    assert p.env == {"HFZERO_STAGE": "1"}
    assert p.torchrun_args.module and p.torchrun_args.training_script == "hfzero.integrations.launch"
    assert p.torchrun_args.training_script_args == [SCRIPT, "--output_dir", "o"]
    plain = plan(["--nproc_per_node", "2", SCRIPT, "--output_dir", "o"])
    assert plain.env == {} and plain.torchrun_args.training_script == SCRIPT  # plain torchrun


@pytest.mark.parametrize("args, message", [
    (["--zero_stagee", "2"], "unknown option --zero_stagee"),
    (["--zero_stage", "5"], "ZeroConfig.stage=5 is invalid"),
    (["--zero_dtype", "fp8"], "ZeroConfig.dtype='fp8' is invalid"),
    (["--zero_reduce_bucket_size", "many"], "cannot read 'many' as int"),
    (["--zero_stage", "2", "--deepspeed", "ds.json"], "--deepspeed cannot be combined"),
    (["--zero_stage", "2", "--fsdp=full_shard"], "--fsdp cannot be combined"),
])
def test_plan_rejects_bad_input(args: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        plan(["--nproc_per_node", "2", SCRIPT, "--output_dir", "o", *args])


def test_cli_fails_before_starting_processes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "hfzero", "run", "--nproc_per_node", "2", SCRIPT, "--config_name",
                           "tiny", "--output_dir", str(out), "--zero_stage", "2", "--deepspeed", "ds.json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--deepspeed cannot be combined with hfzero's --zero_* options" in proc.stderr
    assert not out.exists()  # nothing started


def test_trainer_arguments_for_cpu_bf16_and_stage3_best_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process: `hfzero run`'s ACCELERATE_USE_CPU makes --bf16 acceptable on a CPU host (use_cpu), and
    stage 3 refuses load_best_model_at_end with save_only_model before training (no shards to load from)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from hfzero.integrations.trainer import ZeroTrainer, ZeroTrainingArguments

    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    common = dict(output_dir=str(tmp_path), report_to="none", eval_strategy="steps", save_strategy="steps",
                  eval_steps=2, save_steps=2, load_best_model_at_end=True)
    if not torch.accelerator.is_available():
        assert ZeroTrainingArguments(bf16=True, **common).use_cpu
    args = ZeroTrainingArguments(zero_stage=3, save_only_model=True, **common)
    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=32, n_positions=8))
    with pytest.raises(ConfigError, match="drop --save_only_model"):
        ZeroTrainer(model=model, args=args)


def test_worker_that_fails_before_prepare_is_reported_as_failing_first(monkeypatch, caplog) -> None:
    """[Note: ZeRO not applied]: a finished script that prepared nothing is told hfzero could not apply; one that
    failed before any prepare (while loading, say) is told it failed first."""
    import logging

    from hfzero.integrations import launch

    monkeypatch.setenv("HFZERO_STAGE", "3")
    monkeypatch.setattr("hfzero.runtime.prepare.prepared_count", lambda: 0)
    with caplog.at_level(logging.ERROR, logger=launch.logger.name):
        assert launch._report_if_not_applied(True, failed=True)
    assert "the script failed before any model was prepared with hfzero" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger=launch.logger.name):
        assert launch._report_if_not_applied(True)
    assert "ZeRO was NOT applied: --zero_stage 3 had no effect" in caplog.text
    assert "failed before" not in caplog.text
    monkeypatch.setattr("hfzero.runtime.prepare.prepared_count", lambda: 1)
    assert not launch._report_if_not_applied(True, failed=True)
