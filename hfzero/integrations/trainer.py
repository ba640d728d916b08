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
- ``get_tp_size``: ``--zero_tp_size`` (the accelerator builds the dp x tp mesh and shards the model over
  tp); the Trainer's batch arithmetic, token counts and loss scale then count dp = world / tp replicas,
  and saving gathers the TP shards (``full_state_dict``, on every rank) into whole tensors;
- ``train``: after a torchelastic restart, resumes from the newest complete checkpoint, and on a resume at
  another world size keeps the global batch (hfzero/integrations/resume.py);
- ``--save_on_each_node``: the ZeRO shards are saved and loaded node-locally (no shared file system;
  see [Note: node-local checkpoints]);
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
from transformers.trainer_utils import get_last_checkpoint

from hfzero.planning.autostage import default_seq_len
from hfzero.checkpoint.background import wait as wait_for_save
from hfzero.checkpoint.format import TRAINER_SHARD_DIR as SHARD_DIR
from hfzero.comm.collectives import Communicator
from hfzero.config import ConfigError, ZeroConfig
from hfzero.integrations.accelerate import ZeroAccelerator, apply_mixed_precision
from hfzero.integrations.env import config_strings_from_env, pipeline_strings_from_env, profile_dir_from_env
from hfzero.integrations.gpus import check_ranks_fit_devices, cpu_requested, local_world_size
from hfzero.integrations.resume import BATCH_KEY, TrainerBatch, keep_global_batch, resume_checkpoint, saved_batch
from hfzero.integrations.state import (has_shards, is_partitioned, load_optimizer_shards, model_param_count,
                                      needs_gathered_weights, save_optimizer_shards, saving_gathered,
                                      scheduler_state_for_stage, scheduler_state_for_user_groups, unwrap_optimizer)
from hfzero.loading.hook import enable_while, wanted
from hfzero.logging import get_logger
from hfzero.parallel.pipeline import PipelineConfig
from hfzero.parallel.pipeline.microbatches import check_explicit, default_microbatches
from hfzero.parallel.pipeline.schedule import resolve_schedule
from hfzero.runtime.stage3 import full_state_dict

logger = get_logger(__name__)

SCHEDULER_NAME = "scheduler.pt"
_PROFILE_HELP = ("Directory for hfzero's profiler (ZeroProfiler): per-rank memory by role, communication and "
                 "phase times of every step. Unset: no profiling.")


_PIPELINE_TYPES = {"pp_size": int, "n_microbatches": int}


def _argument_type(hint: Any) -> Any:
    """HfArgumentParser reads Optional[X] only: a union field (``stage``: int or "auto") is text."""
    return str if typing.get_origin(hint) in (typing.Union, types.UnionType) else hint


def _zero_fields() -> list[tuple[str, Any, Any]]:
    hints = typing.get_type_hints(ZeroConfig)
    fields = [(f"zero_{f.name}", Optional[_argument_type(hints[f.name])],
               dataclasses.field(default=None, metadata={"help": ZeroConfig.field_doc(f.name)}))
              for f in dataclasses.fields(ZeroConfig)]
    for option, field in PipelineConfig.options().items():  # --zero_pp_size, --zero_pp_schedule, ...
        fields.append((f"zero_{option}", Optional[_PIPELINE_TYPES.get(field, str)], dataclasses.field(
            default=None, metadata={"help": f"Pipeline parallelism (PipelineConfig.{field}): {_PIPELINE_HELP[field]}"})))
    fields.append(("zero_profile_dir", Optional[str], dataclasses.field(default=None, metadata={"help": _PROFILE_HELP})))
    return fields


_PIPELINE_HELP = {
    "pp_size": "pipeline stages; > 1 trains with hfzero.pipeline (the data-parallel size is world / pp_size, and "
               "--per_device_train_batch_size is per data-parallel replica).",
    "schedule": "GPipe, 1F1B (default), Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV.",
    "n_microbatches": "micro-batches per step; default --gradient_accumulation_steps (the accumulated batches), "
                      "each batch split further when they are fewer than the schedule's stages.",
    "layers_per_stage": "decoder blocks per stage, e.g. 3,5 (default: balanced by parameter count).",
    "stage3_gather": "ZeRO-3: step (gather once per step, default) or micro (per micro-batch).",
    "stage3_cross_prefetch": "ZeRO-3 with micro gathering: true (default) prefetches the next pass's first unit "
                             "across micro-batches; false turns it off.",
}


def _pipeline_strings(self: Any) -> dict[str, str]:
    """The ``zero_pp_*`` options set on these arguments, as ``{option: text}``."""
    return {o: str(getattr(self, f"zero_{o}")) for o in PipelineConfig.options()
            if getattr(self, f"zero_{o}") is not None}


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
    check_ranks_fit_devices(local_world_size(), what="ZeroTrainingArguments", option="LOCAL_WORLD_SIZE",
                            cpu=self.use_cpu or cpu_requested())  # before the Trainer places each rank
    TrainingArguments.__post_init__(self)
    _load_through_hfzero(self)


def _load_through_hfzero(args: Any) -> None:
    """from_pretrained calls made while these arguments live (until the first prepare) load through hfzero's
    hook (see docs/loading.md), as DeepSpeed's zero.Init is switched on by TrainingArguments(deepspeed=...)."""
    try:
        config = resolve_zero_config(args)
        pipelined = resolve_pipeline_config(args) is not None
    except ConfigError:
        return  # the Trainer reports it
    if wanted(config.stage, config.tp_size, pipelined, config.ep_size):
        enable_while(args)


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "y", "on")


ZeroTrainingArguments = dataclasses.make_dataclass(
    "ZeroTrainingArguments", _zero_fields(), bases=(TrainingArguments,),
    namespace={"zero_config_strings": _zero_config_strings, "zero_pipeline_strings": _pipeline_strings,
               "__post_init__": _post_init, "__module__": __name__})
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


def resolve_pipeline_config(args: TrainingArguments) -> PipelineConfig | None:
    """The PipelineConfig a ZeroTrainer runs with, or None (no ``--zero_pp_size`` above 1).

    ``HFZERO_PP_*`` environment values overlaid by ``zero_pp_*`` arguments; the micro-batches default to
    the Trainer's ``gradient_accumulation_steps``.
    """
    values = pipeline_strings_from_env()
    if hasattr(args, "zero_pipeline_strings"):
        values.update(args.zero_pipeline_strings())
    config = PipelineConfig.from_strings(values, pp_size=1, n_microbatches=int(args.gradient_accumulation_steps))
    if config.pp_size == 1:
        if len(values) > ("pp_size" in values):
            logger.warning("ZeroTrainer: --zero_pp_* options without --zero_pp_size > 1 are ignored")
        return None
    return config


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


def _pipeline_batch(batches: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) of the batches, concatenated (B, T); unpadded sequences only (the pipeline carries
    no attention mask between stages)."""
    for batch in batches:
        mask = batch.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise ConfigError("ZeroTrainer: pipeline parallelism trains on unpadded sequences only (the stages "
                              "carry no attention mask); this batch has padding. Pack the data into full blocks")
    ids = torch.cat([b["input_ids"] for b in batches])
    labels = torch.cat([b.get("labels", b["input_ids"]) for b in batches])
    return ids, labels


class ZeroProfilerCallback(TrainerCallback):
    """Runs ``hfzero.profiler.ZeroProfiler`` over training, writing into ``run_dir`` (under pipeline
    parallelism each rank records its stage: see docs/profile-format.md)."""

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
        # under pipeline parallelism the profiler finds the Pipeline from its optimizer and records this
        # rank's stage(s) (the Trainer's model object stays whole; the stage modules are what runs)
        self.profiler = ZeroProfiler(model, zero, self.run_dir,
                                     accumulation_steps=int(args.gradient_accumulation_steps)).start()

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
        self.pipeline_config = resolve_pipeline_config(self.args)
        self._pipeline_micro_explicit = bool(self.pipeline_config) and "pp_n_microbatches" in {
            **pipeline_strings_from_env(), **getattr(self.args, "zero_pipeline_strings", dict)()}
        if self.pipeline_config is not None:
            self.pipeline_config = self._check_microbatches(self.pipeline_config)
        self._pending: list[dict[str, Any]] = []
        factory = functools.partial(ZeroAccelerator, zero_config=self.zero_config,
                                    pipeline_config=self.pipeline_config)
        with _in_trainer_module("Accelerator", factory):
            super().create_accelerator_and_postprocess()
        sizes = {name: getattr(self.accelerator.zero_config, name) for name in ("sp_size", "tp_size")} \
            if isinstance(self.accelerator, ZeroAccelerator) else {}
        if any(getattr(self.zero_config, name) != size for name, size in sizes.items()):
            # TrainingArguments.parallelism_config's sizes, read by the accelerator (integrations/parallelism.py)
            self.zero_config = dataclasses.replace(self.zero_config, **sizes)
        logger.info("ZeroTrainer: ZeRO stage %s, dtype %s", self.zero_config.stage, self.zero_config.dtype)

    def _check_microbatches(self, config: PipelineConfig) -> PipelineConfig:
        """Before the model is prepared: the step's micro-batches can feed the schedule's stages (an explicit
        ``--zero_pp_n_microbatches``, else the accumulated batches split as ``default_microbatches`` does).
        Returns ``config`` with that count (evaluation splits its batches by it too)."""
        kind = resolve_schedule(config.schedule)
        if self._pipeline_micro_explicit:
            check_explicit(config.n_microbatches, kind, config.pp_size)
            return config
        accumulated = int(self.args.gradient_accumulation_steps)
        n_micro = default_microbatches(self.args.per_device_train_batch_size * accumulated, accumulated, kind,
                                       config.pp_size)
        if n_micro != accumulated:
            logger.info("ZeroTrainer: %d stage(s) need %d micro-batches per step; each step's batch of %d row(s) "
                        "is split into %d (the global batch is unchanged)", config.pp_size * kind.stages_per_rank,
                        n_micro, self.args.per_device_train_batch_size * accumulated, n_micro)
        return dataclasses.replace(config, n_microbatches=n_micro)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's training; its "Number of trainable parameters" counts partitioned parameters whole.

        After a torchelastic restart, with no ``resume_from_checkpoint``, resumes from the newest complete
        checkpoint in ``output_dir`` (see [Note: automatic resume]); on any resume, keeps the global batch
        when the world size changed (see [Note: global batch on a world change]). With ``zero_async_save`` it
        returns once the last checkpoint's background write is done (a failure of it is raised here, on every
        rank)."""
        if isinstance(self.accelerator, ZeroAccelerator) and self.accelerator.zero_auto_batch is None:
            seq = _first_example_length(self.train_dataset) or default_seq_len(self.model)
            if seq:  # stage="auto": the activation estimate's batch
                self.accelerator.zero_auto_batch = (self.args.per_device_train_batch_size, seq)
        resume_from_checkpoint = resume_checkpoint(self.args.output_dir, resume_from_checkpoint or None,
                                                   self.zero_config.auto_resume, Communicator())
        if resume_from_checkpoint:
            self._keep_global_batch(resume_from_checkpoint)
        with _in_trainer_module("get_model_param_count", model_param_count):
            result = super().train(resume_from_checkpoint, *args, **kwargs)
        wait_for_save()
        return result

    def _trainer_batch(self) -> TrainerBatch:
        """This run's global batch factors (data-parallel replicas: world / (tp x pp), where ``get_tp_size``
        counts the SP ranks of one replica under sequence parallelism)."""
        pp = self.pipeline_config.pp_size if getattr(self, "pipeline_config", None) is not None else 1
        return TrainerBatch(per_device=self._train_batch_size, accumulation=int(self.args.gradient_accumulation_steps),
                            replicas=max(1, self.args.world_size // (self.get_tp_size() * pp)))

    def _keep_global_batch(self, checkpoint: str | bool) -> None:
        if checkpoint is True:
            checkpoint = get_last_checkpoint(self.args.output_dir)
        saved = saved_batch(checkpoint) if checkpoint else None
        if saved is None:
            return
        decision = keep_global_batch(saved, self._trainer_batch())
        if decision.message:
            logger.warning("resuming from %s: %s", checkpoint, decision.message)
        if decision.accumulation != self.args.gradient_accumulation_steps:
            if getattr(self, "pipeline_config", None) is not None:
                logger.warning("ZeroTrainer: under pipeline parallelism the accumulation is not rescaled (the "
                               "schedule's micro-batches were fixed when the model was prepared); set "
                               "--gradient_accumulation_steps %d to keep the global batch", decision.accumulation)
                return
            self.args.gradient_accumulation_steps = decision.accumulation

    def get_total_train_batch_size(self, args: TrainingArguments) -> int:
        """The Trainer's global batch (per-device batch x accumulation x data-parallel replicas); under
        pipeline parallelism a replica is one whole pipeline, so the replicas are world / pp_size, not the
        world (the figure the Trainer logs and derives its sample counts from)."""
        config = getattr(self, "pipeline_config", None)
        if config is None:
            return super().get_total_train_batch_size(args)
        return self._train_batch_size * args.gradient_accumulation_steps * (args.world_size // config.pp_size)

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """The Trainer's 6 * tokens * non-embedding parameters, with stage-3 parameters counted whole."""
        main = getattr(self.model, "main_input_name", "input_ids")
        if not (is_partitioned(self.model) or self.pipeline is not None) or main not in inputs:
            return super().floating_point_ops(inputs)
        return 6 * inputs[main].numel() * model_param_count(self.model, exclude_embeddings=True)

    def get_tp_size(self) -> int:
        """``--zero_tp_size``: the Trainer divides its token count and loss scale by it and counts dp =
        world / tp replicas in its batch arithmetic (the TP ranks of one replica read the same batches)."""
        config = getattr(self, "zero_config", None)
        if config is not None and config.sp_size > 1:  # the SP ranks of one replica read the same samples too
            return config.sp_size
        return config.tp_size if config is not None and config.tp_size > 1 else super().get_tp_size()

    def get_sp_size(self) -> int:
        """1: the Trainer's sp_size arithmetic is DeepSpeed's (a loader adapter yielding sp_size times the batches,
        every rank counting whole sequences); hfzero's SP counts as TP does (``get_tp_size``)."""
        return 1

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> Any:
        """Under ``--zero_sp_size``: the targets of this step's batches, counted on the whole sequences (each
        batch's ``num_items_in_batch`` from SequenceCollator, the same on every rank of an SP group); with
        ``average_tokens_across_devices`` summed over the dp replicas (gathered over all ranks / sp). See
        [Note: sequence-parallel gradients]."""
        config = getattr(self, "zero_config", None)
        counted = super()._get_num_items_in_batch(batch_samples, device)
        if config is None or config.sp_size == 1 or counted is None:
            return counted
        if not all("num_items_in_batch" in batch for batch in batch_samples):
            raise ConfigError("ZeroTrainer: --zero_sp_size needs batches split by hfzero's SequenceCollator (the "
                              "Trainer's data loader gets it); a custom get_batch_samples lost it")
        count = sum(batch["num_items_in_batch"] for batch in batch_samples).to(device)
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            count = self.accelerator.gather(count.reshape(1)).sum() / config.sp_size
        return count

    @property
    def pipeline(self) -> Any:
        """This rank's ``hfzero.pipeline`` Pipeline under ``--zero_pp_size`` > 1, once training prepared it."""
        return getattr(getattr(self, "accelerator", None), "pipeline", None)

    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        """Under pipeline parallelism: keep the accumulation's batches; on the last one (the Trainer's
        sync step) run the pipeline over all of them (they are the micro-batches). Returns the step's
        global mean loss on its last call and 0 before, so the Trainer's logged sum is that mean."""
        pipe = self.pipeline
        if pipe is None:
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        self._pending.append(self._prepare_inputs(inputs))
        if not self.accelerator.sync_gradients:
            return torch.zeros((), device=self.args.device)
        ids, labels = _pipeline_batch(self._pending)
        n_micro = self.pipeline_config.n_microbatches if self._pipeline_micro_explicit else default_microbatches(
            ids.shape[0], len(self._pending), resolve_schedule(self.pipeline_config.schedule),
            self.pipeline_config.pp_size)  # the accumulated batches, split further when fewer than the stages
        self._pending = []
        divisor = self._token_divisor(num_items_in_batch) if num_items_in_batch is not None else None
        loss = pipe.forward_backward(ids, labels, n_microbatches=n_micro, token_divisor=divisor)
        return torch.tensor(loss, device=self.args.device)

    def prediction_step(self, model: Any, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[Any, Any, Any]:
        """Under pipeline parallelism: the pipeline's forward-only loss of this replica's batch (every rank of
        the pipeline returns it); loss only (no logits for compute_metrics)."""
        pipe = self.pipeline
        if pipe is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if not prediction_loss_only:
            raise ConfigError("ZeroTrainer: under pipeline parallelism evaluation computes the loss only; drop "
                              "compute_metrics / --prediction_loss_only false")
        inputs = self._prepare_inputs(inputs)
        ids, labels = _pipeline_batch([inputs])
        counted = self._get_num_items_in_batch([inputs], self.args.device)  # as the Trainer's prediction_step
        divisor = self._token_divisor(counted) if counted is not None else None
        loss = pipe.evaluate(ids, labels, over_dp=False, token_divisor=divisor)
        return torch.tensor(loss, device=self.args.device), None, None

    def _token_divisor(self, num_items_in_batch: Any) -> float:
        """The Trainer's token count as the pipeline's divisor: with ``average_tokens_across_devices`` the
        count over the global batch / dp (each replica's share; the dp mean is then sum / count, as DDP's),
        else this replica's count.

        The count is the Trainer's own ``num_items_in_batch`` (``_get_num_items_in_batch``, gathered with one
        copy per replica by ``ZeroAccelerator.gather``), never recounted here: the Trainer alone decides which
        labels the loss averages over (transformers 5 counts ``labels[..., 1:]`` for a model whose loss is
        ``ForCausalLMLoss``, e.g. Llama, and all labels for one whose ``loss_type`` it does not map, e.g.
        GPT-2), so the pipeline's shifted token-loss sum is divided by what DDP divides it by."""
        count = float(num_items_in_batch)
        return count / self.pipeline.mesh.dp_size if self.args.average_tokens_across_devices else count

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """At stage 3, or under pipeline parallelism, every rank gathers the full weights first (a
        collective), then the Trainer saves them: a whole Hugging Face model either way.

        The gather happens here, on every rank, because transformers 4.x calls ``_save`` on the saving
        rank only (5.x on every rank): gathering inside ``_save`` would hang there.
        """
        pipe = self.pipeline
        if not needs_gathered_weights(self.model) and pipe is None:
            return super().save_model(output_dir, _internal_call)
        # the writers: rank 0, or each node's local rank 0 with save_on_each_node
        rank0_only = not self.args.save_on_each_node
        self._gathered_state = (pipe.full_state_dict(rank0_only) if pipe is not None
                                else full_state_dict(self.model, rank0_only=rank0_only))
        try:
            super().save_model(output_dir, _internal_call)
        finally:
            self._gathered_state = None

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """At stage 3 write the weights ``save_model`` gathered on every rank; then the Trainer's save."""
        if state_dict is None and (needs_gathered_weights(self.model) or self.pipeline is not None):
            state_dict = getattr(self, "_gathered_state", None)
            if state_dict is None:
                raise RuntimeError("ZeroTrainer: at stage 3 save through save_model() (every rank must gather "
                                   "the partitioned weights), not _save()")
            with saving_gathered(self.model):  # peft's modules_to_save reads a submodule's keys
                return super()._save(output_dir, state_dict=state_dict)
        super()._save(output_dir, state_dict=state_dict)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """A stage-3 model's (or a pipeline's) weights are restored by its shards
        (``_load_optimizer_and_scheduler``)."""
        if needs_gathered_weights(model if model is not None else self.model) or self.pipeline is not None:
            logger.info("ZeroTrainer: stage-3 weights are restored from %s/%s with the optimizer shards",
                        resume_from_checkpoint, SHARD_DIR)
            return
        if self.args.save_on_each_node and has_shards(Path(resume_from_checkpoint) / SHARD_DIR):
            # transformers writes the weights on global rank 0 only (save_pretrained), so other nodes' copies
            # lack them; the shards restore the weights from their fp32 masters on every node
            logger.info("ZeroTrainer: --save_on_each_node: the weights are restored from %s/%s with the optimizer "
                        "shards", resume_from_checkpoint, SHARD_DIR)
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
        if has_shards(best / SHARD_DIR):
            logger.info("ZeroTrainer: loading the best model from %s (score %s)", best / SHARD_DIR,
                        self.state.best_metric)
            load_optimizer_shards(best / SHARD_DIR, self.model, self.optimizer, node_local=self.args.save_on_each_node)
            return
        if needs_gathered_weights(self.model) or self.pipeline is not None:
            raise ConfigError(f"load_best_model_at_end at ZeRO stage 3 (or with pipeline parallelism) needs the "
                              f"checkpoint's optimizer shards, "
                              f"but {best / SHARD_DIR} is missing (save_only_model?). Save full checkpoints, or "
                              "load the best weights after training with from_pretrained")
        super()._load_best_model()

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Every rank writes its optimizer shard; rank 0 writes the scheduler, as the Trainer does."""
        if unwrap_optimizer(self.optimizer) is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        save_optimizer_shards(Path(output_dir) / SHARD_DIR, self.model, self.optimizer,
                              extra={BATCH_KEY: self._trainer_batch().to_dict()},
                              node_local=self.args.save_on_each_node)
        if self.args.should_save and self.lr_scheduler is not None:
            state = scheduler_state_for_user_groups(self.lr_scheduler.state_dict(), self.optimizer)
            torch.save(state, os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Load this rank's optimizer shard and the scheduler from a ZeroTrainer checkpoint."""
        if checkpoint is None:
            return
        if unwrap_optimizer(self.optimizer) is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        shards = Path(checkpoint) / SHARD_DIR
        if not has_shards(shards):
            raise ConfigError(f"{checkpoint} holds no hfzero optimizer shards ({SHARD_DIR}/ is missing): it was not "
                              "saved by a ZeroTrainer. Resume it without ZeRO, or start from its weights with "
                              "--model_name_or_path and a fresh optimizer")
        load_optimizer_shards(shards, self.model, self.optimizer, node_local=self.args.save_on_each_node)
        scheduler = Path(checkpoint) / SCHEDULER_NAME
        if scheduler.is_file() and self.lr_scheduler is not None:
            state = torch.load(scheduler, map_location="cpu", weights_only=True)
            self.lr_scheduler.load_state_dict(scheduler_state_for_stage(state, self.optimizer))
