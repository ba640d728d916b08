"""ZeroTrainer and ZeroTrainingArguments: transformers' Trainer with hfzero's ZeRO in place of DDP.

The Trainer keeps its loop (accumulation, clipping, schedulers, evaluation, logging, checkpoints);
ZeRO enters through these hook points:
- ``create_accelerator_and_postprocess``: the Trainer builds a ``ZeroAccelerator`` (prepare shards the
  optimizer, backward/no_sync/clip_grad_norm_ go through the engine);
- ``_save``: at stage 3 every rank takes part in gathering the full weights (a collective), then
  rank 0 writes them as the Trainer always does, so ``save_model`` and every ``checkpoint-N/`` hold
  a normal Hugging Face directory at every stage;
- ``_save_optimizer_and_scheduler``: every rank writes its optimizer shard into the checkpoint
  (``checkpoint-N/zero_optimizer/``), rank 0 the scheduler;
- ``_load_optimizer_and_scheduler``: every rank loads its shard back (any world size or stage:
  ``hfzero.checkpoint`` reshards); this also restores the weights from the fp32 master shards;
- ``_load_best_model`` (``load_best_model_at_end``): loads the best checkpoint's ``zero_optimizer/``
  the same way (weights and fp32 masters agree afterwards, at every stage);
- ``_load_from_checkpoint``: skipped for an already partitioned (stage-3) model, whose weights come
  from the shards;
- a ``ZeroProfilerCallback`` when ``zero_profile_dir`` (or ``HFZERO_PROFILE_DIR``) is set.
``--bf16``/``--fp16`` become ZeRO's dtype (16-bit parameters and gradients + fp32 master shards),
not autocast over fp32 parameters. Evaluation and prediction run the model's own forward (stage 3
gathers unit by unit); every rank must run the same number of evaluation batches, which the
Trainer's distributed samplers ensure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import transformers.trainer as _trainer_module
from transformers import Trainer, TrainerCallback, TrainingArguments

from hfzero.autostage import default_seq_len
from hfzero.config import ConfigError, ZeroConfig
from hfzero.integrations.accelerate import ZeroAccelerator, apply_mixed_precision
from hfzero.integrations.env import config_strings_from_env, profile_dir_from_env
from hfzero.integrations.state import (is_partitioned, load_optimizer_shards, model_param_count,
                                      save_optimizer_shards, unwrap_optimizer)
from hfzero.logging import get_logger
from hfzero.runtime.stage3 import full_state_dict

logger = get_logger(__name__)

SHARD_DIR = "zero_optimizer"
SCHEDULER_NAME = "scheduler.pt"
_PROFILE_HELP = ("Directory for hfzero's profiler (ZeroProfiler): per-rank memory by role, communication and "
                 "phase times of every step. Unset: no profiling.")


def _argument_type(hint: Any) -> Any:
    """HfArgumentParser reads Optional[X] only: a union field (``stage``: int or "auto") is text."""
    return str if typing.get_origin(hint) in (typing.Union, types.UnionType) else hint


def _zero_fields() -> list[tuple[str, Any, Any]]:
    hints = typing.get_type_hints(ZeroConfig)
    fields = [(f"zero_{f.name}", Optional[_argument_type(hints[f.name])],
               dataclasses.field(default=None, metadata={"help": ZeroConfig.field_doc(f.name)}))
              for f in dataclasses.fields(ZeroConfig)]
    fields.append(("zero_profile_dir", Optional[str], dataclasses.field(default=None, metadata={"help": _PROFILE_HELP})))
    return fields


def _zero_config_strings(self: Any) -> dict[str, str]:
    """The ``zero_*`` options set on these arguments, as ``{field: text}`` (unset ones are omitted)."""
    out = {}
    for name in ZeroConfig.field_names():
        value = getattr(self, f"zero_{name}")
        if value is not None:
            out[name] = str(value).lower() if isinstance(value, bool) else str(value)
    return out


def _post_init(self: Any) -> None:
    """``ACCELERATE_USE_CPU=true`` (set by ``hfzero run`` on hosts without an accelerator) means use_cpu.

    TrainingArguments honours that variable for its process group but not in its ``--bf16`` check
    ("doesn't support bf16/gpu"), which would refuse ZeRO's bf16 (16-bit parameters, not autocast)
    on a CPU host although the run is a CPU run.
    """
    if not self.use_cpu and not torch.accelerator.is_available() and _env_true("ACCELERATE_USE_CPU"):
        self.use_cpu = True
    TrainingArguments.__post_init__(self)


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "y", "on")


ZeroTrainingArguments = dataclasses.make_dataclass(
    "ZeroTrainingArguments", _zero_fields(), bases=(TrainingArguments,),
    namespace={"zero_config_strings": _zero_config_strings, "__post_init__": _post_init, "__module__": __name__})
ZeroTrainingArguments.__doc__ = (
    "``transformers.TrainingArguments`` plus every ZeroConfig field as ``zero_<field>`` (default None: taken "
    "from ``HFZERO_<FIELD>`` in the environment, else ZeroConfig's default) and ``zero_profile_dir``. "
    "``HfArgumentParser`` exposes them as ``--zero_stage 2``, ``--zero_dtype bf16``, ...")


def resolve_zero_config(args: TrainingArguments, override: ZeroConfig | None = None) -> ZeroConfig:
    """The ZeroConfig a ZeroTrainer runs with.

    Precedence: ``override`` (a ZeroConfig given to ZeroTrainer), else ``HFZERO_*`` environment values
    overlaid by ``zero_*`` arguments. ``--bf16``/``--fp16`` then set the dtype. DeepSpeed and FSDP
    arguments are refused: ZeRO replaces them.
    """
    if getattr(args, "deepspeed", None):
        raise ConfigError("ZeroTrainer: --deepspeed cannot be combined with hfzero's ZeRO; drop one of them")
    if getattr(args, "fsdp", None):
        raise ConfigError("ZeroTrainer: --fsdp cannot be combined with hfzero's ZeRO; drop one of them")
    if override is not None:
        config = override
    else:
        values = config_strings_from_env()
        if hasattr(args, "zero_config_strings"):
            values.update(args.zero_config_strings())
        config = ZeroConfig.from_strings(values)
    mixed = "fp16" if args.fp16 else "bf16" if args.bf16 else None
    return apply_mixed_precision(config, mixed)


@contextlib.contextmanager
def _in_trainer_module(name: str, value: Any) -> Iterator[None]:
    """Make ``transformers.trainer.<name>`` mean ``value`` for the duration of the block.

    Trainer code names some helpers inline (``Accelerator(**args)`` in create_accelerator_and_postprocess,
    ``get_model_param_count`` in the training loop's start-up log); swapping the name it uses is the
    one seam that keeps the rest of that code.
    """
    original = getattr(_trainer_module, name)
    setattr(_trainer_module, name, value)
    try:
        yield
    finally:
        setattr(_trainer_module, name, original)


class ZeroProfilerCallback(TrainerCallback):
    """Runs ``hfzero.profiler.ZeroProfiler`` over training, writing into ``run_dir``."""

    def __init__(self, run_dir: str | os.PathLike[str]):
        self.run_dir = Path(run_dir)
        self.profiler: Any = None

    def on_train_begin(self, args: TrainingArguments, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        try:
            from hfzero.profiler import ZeroProfiler
        except ImportError:
            logger.warning("zero_profile_dir=%s is set but hfzero.profiler.ZeroProfiler is not available in this "
                           "version; training runs without profiling", self.run_dir)
            return
        zero = unwrap_optimizer(optimizer)
        if zero is None:
            raise ConfigError("ZeroProfilerCallback: the Trainer's optimizer was not prepared by hfzero")
        self.profiler = ZeroProfiler(model, zero, self.run_dir).start()

    def on_train_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None


def _first_example_length(dataset: Any) -> int | None:
    """Tokens in the first training example (the activation estimate's sequence length), if readable."""
    try:
        return len(dataset[0]["input_ids"])
    except (TypeError, KeyError, IndexError, AttributeError):
        return None


class ZeroTrainer(Trainer):
    """``transformers.Trainer`` training with hfzero's ZeRO (stages 0-3).

    At stage 3 ``save_model`` and checkpoint saves are collectives (the weights are gathered unit by
    unit): call ``save_model`` on every rank, as the Trainer itself does, not under
    ``if trainer.is_world_process_zero()``.

    Args:
        zero_config: ZeRO options; default: from ``ZeroTrainingArguments`` ``zero_*`` fields over the
            ``HFZERO_*`` environment (set by ``hfzero run``), else ZeroConfig's defaults.
        *args, **kwargs: as for ``transformers.Trainer``.
    """

    def __init__(self, *args: Any, zero_config: ZeroConfig | None = None, **kwargs: Any):
        self._zero_override = zero_config
        super().__init__(*args, **kwargs)
        if dist.is_initialized() and dist.get_world_size() > 1 and self.args.world_size == 1:
            raise ConfigError(
                f"ZeroTrainer: torch.distributed has {dist.get_world_size()} ranks but TrainingArguments sees a "
                "single process, so every rank would read all the data. On a host without an accelerator pass "
                "--use_cpu true (or set ACCELERATE_USE_CPU=true); `hfzero run` does this for you")
        profile_dir = getattr(self.args, "zero_profile_dir", None) or profile_dir_from_env()
        if profile_dir:
            self.add_callback(ZeroProfilerCallback(profile_dir))

    def create_accelerator_and_postprocess(self) -> None:
        self.zero_config = resolve_zero_config(self.args, self._zero_override)
        if self.zero_config.stage == 3 and self.args.load_best_model_at_end and self.args.save_only_model:
            raise ConfigError("ZeroTrainer: load_best_model_at_end at ZeRO stage 3 needs the optimizer shards in "
                              "each checkpoint (the weights are partitioned); drop --save_only_model")
        factory = functools.partial(ZeroAccelerator, zero_config=self.zero_config)
        with _in_trainer_module("Accelerator", factory):
            super().create_accelerator_and_postprocess()
        logger.info("ZeroTrainer: ZeRO stage %s, dtype %s", self.zero_config.stage, self.zero_config.dtype)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's training; its "Number of trainable parameters" counts partitioned parameters whole."""
        if isinstance(self.accelerator, ZeroAccelerator) and self.accelerator.zero_auto_batch is None:
            seq = _first_example_length(self.train_dataset) or default_seq_len(self.model)
            if seq:  # stage="auto": the activation estimate's batch
                self.accelerator.zero_auto_batch = (self.args.per_device_train_batch_size, seq)
        with _in_trainer_module("get_model_param_count", model_param_count):
            return super().train(*args, **kwargs)

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """The Trainer's 6 * tokens * non-embedding parameters, with stage-3 parameters counted whole."""
        main = getattr(self.model, "main_input_name", "input_ids")
        if not is_partitioned(self.model) or main not in inputs:
            return super().floating_point_ops(inputs)
        return 6 * inputs[main].numel() * model_param_count(self.model, exclude_embeddings=True)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """At stage 3 gather the full weights first (every rank: a collective); then the Trainer's save."""
        if state_dict is None and is_partitioned(self.model):
            # the writers: rank 0, or each node's local rank 0 with save_on_each_node
            state_dict = full_state_dict(self.model, rank0_only=not self.args.save_on_each_node)
        super()._save(output_dir, state_dict=state_dict)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """A stage-3 model's weights are restored by its shards (``_load_optimizer_and_scheduler``)."""
        if is_partitioned(model if model is not None else self.model):
            logger.info("ZeroTrainer: stage-3 weights are restored from %s/%s with the optimizer shards",
                        resume_from_checkpoint, SHARD_DIR)
            return
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        """Load the best checkpoint's ZeRO shards: the weights are republished from its fp32 masters.

        The best checkpoint's optimizer state, loss scale and RNG states come with them (training is
        over when the Trainer calls this). Without shards (``save_only_model``) stages 0-2 load the
        saved weights as the Trainer does; stage 3 cannot (its parameters are partitioned).
        """
        if unwrap_optimizer(self.optimizer) is None:
            return super()._load_best_model()
        best = Path(self.state.best_model_checkpoint)
        if (best / SHARD_DIR).is_dir():
            logger.info("ZeroTrainer: loading the best model from %s (score %s)", best / SHARD_DIR,
                        self.state.best_metric)
            load_optimizer_shards(best / SHARD_DIR, self.model, self.optimizer)
            return
        if is_partitioned(self.model):
            raise ConfigError(f"load_best_model_at_end at ZeRO stage 3 needs the checkpoint's optimizer shards, "
                              f"but {best / SHARD_DIR} is missing (save_only_model?). Save full checkpoints, or "
                              "load the best weights after training with from_pretrained")
        super()._load_best_model()

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Every rank writes its optimizer shard; rank 0 writes the scheduler, as the Trainer does."""
        if unwrap_optimizer(self.optimizer) is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        save_optimizer_shards(Path(output_dir) / SHARD_DIR, self.model, self.optimizer)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Load this rank's optimizer shard and the scheduler from a ZeroTrainer checkpoint."""
        if checkpoint is None:
            return
        if unwrap_optimizer(self.optimizer) is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        shards = Path(checkpoint) / SHARD_DIR
        if not shards.is_dir():
            raise ConfigError(f"{checkpoint} holds no hfzero optimizer shards ({SHARD_DIR}/ is missing): it was not "
                              "saved by a ZeroTrainer. Resume it without ZeRO, or start from its weights with "
                              "--model_name_or_path and a fresh optimizer")
        load_optimizer_shards(shards, self.model, self.optimizer)
        scheduler = Path(checkpoint) / SCHEDULER_NAME
        if scheduler.is_file() and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(torch.load(scheduler, map_location="cpu", weights_only=True))
