"""An unmodified Trainer script (tests/scripts/llama_trainer.py, tiny Llama from config) under
`hfzero run --nproc_per_node 4 ... --zero_stage 3 --zero_sp_size 2 --zero_loss_tiles 2 --gradient_checkpointing`
(dp=2 x sp=2, tiled logits + loss: ZeroTrainer's data loader shards over the dp replicas and splits each
sequence with SequenceCollator, the token count and loss scale follow [Note: sequence-parallel gradients])
against the same script under plain torchrun DDP on 2 ranks: equal per-step training losses, gradient norms,
evaluation losses and saved models; its checkpoint-2 resumes on 2 ranks without SP (ZeRO-2) and on the same 4
ranks as sp=4 x dp=1 (another sp size) with the same next losses. Four launches.
Sharded loading under SP: tests/scripts/pretrained_trainer.py calls ``from_pretrained`` on a checkpoint saved
here; under `hfzero run --nproc_per_node 4 --zero_stage 3 --zero_sp_size 2` (the loading hook on: no rank holds
parameter bytes after ``from_pretrained``, each reads its shard of the dp x sp world at prepare) its losses and
gradient norms equal the same script's under torchrun DDP on 2 ranks (loaded whole). Two more launches.
accelerate's ParallelismConfig (TrainingArguments.parallelism_config, Accelerator(parallelism_config=...)) is
read into ZeroConfig, in this process: sp_size / tp_size mapped, the rest refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_integration_common import hfzero_run, torchrun

from hfzero.config import ConfigError, ZeroConfig
from hfzero.integrations.parallelism import zero_config_from_parallelism

SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "llama_trainer.py")
PRETRAINED_SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "pretrained_trainer.py")
STEPS = 4


def _args(out: Path) -> list[str]:
    return [SCRIPT, "--output_dir", str(out), "--max_steps", str(STEPS), "--per_device_train_batch_size", "2",
            "--gradient_accumulation_steps", "2", "--learning_rate", "1e-3", "--logging_steps", "1",
            "--eval_strategy", "steps", "--eval_steps", "2", "--per_device_eval_batch_size", "4",
            "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true", "--seed", "0",
            "--seq_len", "15"]  # not a multiple of sp: padded by SequenceCollator, the loss unchanged


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("sp_trainer")
    torchrun(2, _args(root / "ddp"))
    hfzero_run(4, [*_args(root / "sp"), "--zero_stage", "3", "--zero_sp_size", "2",
                   "--zero_param_persistence_threshold", "0", "--zero_loss_tiles", "2",
                   "--gradient_checkpointing", "true",
                   "--gradient_checkpointing_kwargs", '{"use_reentrant": false}',
                   "--save_strategy", "steps", "--save_steps", "2"])
    return root / "ddp", root / "sp"


def _history(out: Path, key: str) -> list[tuple[int, float, float]]:
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [(h["step"], h[key], h.get("epoch")) for h in history if key in h]


@pytest.mark.slow
@pytest.mark.parametrize("key", ["loss", "grad_norm", "eval_loss"])
def test_sp2_trainer_matches_ddp_on_two_ranks(runs: tuple[Path, Path], key: str) -> None:
    ddp, sp = runs
    want, got = _history(ddp, key), _history(sp, key)
    assert len(want) == (STEPS if key != "eval_loss" else STEPS // 2) and len(got) == len(want)
    for (step, value, epoch), (step_sp, value_sp, epoch_sp) in zip(want, got):
        assert (step_sp, epoch_sp) == (step, epoch)  # dp = world / sp replicas: the same samples per step
        assert value_sp == pytest.approx(value, abs=1e-5), (key, step)


def test_parallelism_config_is_mapped_or_refused() -> None:
    from accelerate import ParallelismConfig

    assert zero_config_from_parallelism(ParallelismConfig(sp_size=2, sp_backend="deepspeed"), ZeroConfig()).sp_size == 2
    assert zero_config_from_parallelism(ParallelismConfig(tp_size=2), ZeroConfig()).tp_size == 2
    assert zero_config_from_parallelism(None, ZeroConfig(stage=2)) == ZeroConfig(stage=2)
    with pytest.raises(ConfigError, match="ParallelismConfig.cp_size=2 is not supported"):
        zero_config_from_parallelism(ParallelismConfig(cp_size=2), ZeroConfig())
    with pytest.raises(ConfigError, match="sp_size=2: HSDP x sequence parallelism is not built"):
        zero_config_from_parallelism(ParallelismConfig(dp_replicate_size=2, sp_size=2, dp_shard_size=2), ZeroConfig())
    with pytest.raises(ConfigError, match="contradicts ZeroConfig.sp_size=4"):
        zero_config_from_parallelism(ParallelismConfig(sp_size=2), ZeroConfig(sp_size=4))
    with pytest.raises(ConfigError, match="tensor x sequence"):
        zero_config_from_parallelism(ParallelismConfig(sp_size=2, tp_size=2), ZeroConfig())


def test_trainer_reads_training_arguments_parallelism_config(tmp_path) -> None:
    from accelerate import ParallelismConfig

    import hfzero
    from hfzero.testing.models import tiny_causal_lm

    args = hfzero.ZeroTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, zero_stage=2,
                                        parallelism_config=ParallelismConfig(sp_size=2, sp_backend="deepspeed"))
    trainer = hfzero.ZeroTrainer(model=tiny_causal_lm("llama"), args=args)
    assert trainer.zero_config.sp_size == 2 and trainer.accelerator.zero_config.sp_size == 2
    assert trainer.accelerator.parallelism_config is None  # accelerate built no mesh (nor DeepSpeed's SP) of its own
    assert trainer.get_tp_size() == 2 and trainer.get_sp_size() == 1
    with pytest.raises(ConfigError, match="dp_shard_size"):
        hfzero.ZeroAccelerator(parallelism_config=ParallelismConfig(dp_shard_size=2), cpu=True)


def test_launch_refuses_bad_sp_sizes() -> None:
    from hfzero.integrations.launch import plan

    assert plan(["--nproc_per_node", "4", SCRIPT, "--zero_sp_size", "2"], environ={}).env["HFZERO_SP_SIZE"] == "2"
    with pytest.raises(ConfigError, match="sp_size=3 does not divide the world size 4"):
        plan(["--nproc_per_node", "4", SCRIPT, "--zero_sp_size", "3"], environ={})
    with pytest.raises(ConfigError, match="--zero_sp_size and --zero_pp_size cannot be combined yet"):
        plan(["--nproc_per_node", "4", SCRIPT, "--zero_sp_size", "2", "--zero_pp_size", "2"], environ={})
    with pytest.raises(ConfigError, match="tensor x sequence"):
        plan(["--nproc_per_node", "4", SCRIPT, "--zero_sp_size", "2", "--zero_tp_size", "2"], environ={})


@pytest.mark.slow
def test_sp2_trainer_saves_ddps_model(runs: tuple[Path, Path]) -> None:
    """save_model under dp x sp ZeRO-3 writes a whole Hugging Face model equal to DDP's."""
    import torch
    from transformers import AutoModelForCausalLM

    ddp, sp = (AutoModelForCausalLM.from_pretrained(out).state_dict() for out in runs)
    assert ddp.keys() == sp.keys()
    for name in ddp:
        torch.testing.assert_close(sp[name], ddp[name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.slow
def test_sp2_checkpoint_resumes_without_sp(runs: tuple[Path, Path], tmp_path: Path) -> None:
    """checkpoint-2 of the dp x sp ZeRO-3 run (ZeRO shards over 4 ranks) resumes on 2 ranks without SP at
    ZeRO-2 (resharded to another world size and stage): steps 3-4 equal the SP run's."""
    _, sp = runs
    manifest = json.loads((sp / "checkpoint-2" / "zero_optimizer" / "manifest.json").read_text())
    assert manifest["world_size"] == 4
    out = tmp_path / "resumed"
    hfzero_run(2, [*_args(out), "--zero_stage", "2", "--resume_from_checkpoint", str(sp / "checkpoint-2")])
    resumed = {step: value for step, value, _ in _history(out, "loss")}
    original = {step: value for step, value, _ in _history(sp, "loss")}
    for step in (3, 4):
        assert resumed[step] == pytest.approx(original[step], abs=1e-5), (step, resumed, original)


@pytest.mark.slow
def test_sp2_checkpoint_resumes_into_sp4(runs: tuple[Path, Path], tmp_path: Path) -> None:
    """checkpoint-2 of the sp=2 x dp=2 run resumes on the same 4 ranks as sp=4 x dp=1 (another sp size; each
    micro-batch of 4 sequences is the two replicas' 2 + 2, so the global batch is the same): steps 3-4 equal
    the SP run's. ZeRO's shards are over the whole world either way (see docs/sequence.md)."""
    _, sp = runs
    out = tmp_path / "resumed_sp4"
    args = _args(out)
    args[args.index("--per_device_train_batch_size") + 1] = "4"
    hfzero_run(4, [*args, "--zero_stage", "3", "--zero_sp_size", "4", "--zero_param_persistence_threshold", "0",
                   "--resume_from_checkpoint", str(sp / "checkpoint-2")])
    resumed = {step: value for step, value, _ in _history(out, "loss")}
    original = {step: value for step, value, _ in _history(sp, "loss")}
    for step in (3, 4):
        assert resumed[step] == pytest.approx(original[step], abs=1e-5), (step, resumed, original)


@pytest.fixture(scope="module")
def pretrained_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from hfzero.testing.models import tiny_causal_lm

    root = tmp_path_factory.mktemp("sp_loading")
    tiny_causal_lm("llama", seed=3).save_pretrained(root / "model", max_shard_size="20KB")  # an indexed save

    def args(out: Path) -> list[str]:
        return [PRETRAINED_SCRIPT, "--model_name_or_path", str(root / "model"), "--output_dir", str(out),
                "--max_steps", str(STEPS), "--per_device_train_batch_size", "2", "--learning_rate", "1e-3",
                "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true",
                "--seed", "0", "--seq_len", "15"]

    torchrun(2, args(root / "ddp"))
    hfzero_run(4, [*args(root / "sp"), "--zero_stage", "3", "--zero_sp_size", "2",
                   "--zero_param_persistence_threshold", "0"])
    return root / "ddp", root / "sp"


@pytest.mark.slow
def test_sharded_loading_under_sp_matches_ddp(pretrained_runs: tuple[Path, Path]) -> None:
    """from_pretrained under `hfzero run ... --zero_stage 3 --zero_sp_size 2`: no rank holds the model after it
    (sharded loading), and training from the loaded weights equals DDP's from the whole load (1e-5)."""
    ddp, sp = pretrained_runs
    for rank in range(4):
        held = json.loads((sp / f"param_bytes-rank{rank}.json").read_text())
        assert held["held"] == 0 and held["whole"] > 0, (rank, held)
    whole = json.loads((ddp / "param_bytes-rank0.json").read_text())
    assert whole["held"] == whole["whole"] == held["whole"], whole
    for key in ("loss", "grad_norm"):
        want, got = _history(ddp, key), _history(sp, key)
        assert len(want) == STEPS and len(got) == STEPS, (key, want, got)
        for (step, value, epoch), (step_sp, value_sp, epoch_sp) in zip(want, got):
            assert (step_sp, epoch_sp) == (step, epoch)
            assert value_sp == pytest.approx(value, abs=1e-5), (key, step, want, got)
