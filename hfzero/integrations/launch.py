"""``hfzero run``: torchrun for scripts that use ``transformers.Trainer``, with ``--zero_*`` options.

Two halves:
- ``plan(argv)`` (in the launching process): splits ``[torchrun options] SCRIPT [script args]``,
  removes the ``--zero_*`` options from the script's arguments, validates them with ZeroConfig (and
  ``--zero_pp_*`` with PipelineConfig: pipeline parallelism, see docs/integrations.md) and
  refuses ``--deepspeed``/``--fsdp`` next to them, all before any process starts. The result runs
  ``torch.distributed.run`` with this module as the entry point and the options as ``HFZERO_*``.
- ``main()`` (``python -m hfzero.integrations.launch SCRIPT ...`` in every worker): when ``HFZERO_*``
  is set, makes ``transformers.Trainer``/``TrainingArguments`` mean ZeroTrainer/ZeroTrainingArguments
  and ``accelerate.Accelerator`` mean ZeroAccelerator, then runs SCRIPT as ``__main__`` (``runpy``), so
  an unmodified Trainer or accelerate script trains with ZeRO.
Without ``--zero_*`` options nothing is patched: it behaves like torchrun.

[Note: ZeRO not applied]
The ``--zero_*`` options are never ignored silently: a worker whose script ends without any model
prepared by hfzero (a plain torch loop, a custom trainer that builds its own DDP) logs an error
saying so and exits with ``NOT_APPLIED_EXIT`` (3) even when the script itself succeeded; the
launcher then repeats the message and returns 3. A script that fails gets the message too, then
fails as it would have.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import runpy
import sys
from collections.abc import Mapping, Sequence

from hfzero.config import ConfigError, ZeroConfig
from hfzero.integrations.env import (PROFILE_DIR_ENV, config_strings_from_env, config_to_env, env_name,
                                    pipeline_strings_from_env)
from hfzero.logging import get_logger
from hfzero.parallel.pipeline.config import PipelineConfig

logger = get_logger(__name__)

_PREFIX = "--zero_"
_MODULE_FLAG = "--hfzero-module"
_CONFLICTS = ("--deepspeed", "--fsdp")
_NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")
NOT_APPLIED_EXIT = 3
_TP_WITH_PP = ("--zero_tp_size and --zero_pp_size cannot be combined yet (pipeline x tensor parallelism is not "
               "built); use one of them")
"""Exit status of a worker (and of ``hfzero run``) whose script prepared no model with hfzero."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    """A validated ``hfzero run`` command line.

    Attributes:
        torchrun_args: the parsed ``torch.distributed.run`` namespace, entry point already rewritten.
        env: ``HFZERO_*`` variables to export to the workers (empty without ``--zero_*`` options).
        zero_options: the ``--zero_*`` options as ``{field: text}``.
    """

    torchrun_args: argparse.Namespace
    env: dict[str, str]
    zero_options: dict[str, str]


def split_zero_options(script_args: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """Remove ``--zero_<field> VALUE`` / ``--zero_<field>=VALUE`` from ``script_args``.

    Returns the remaining arguments and ``{field: text}``. A bare boolean option (``--zero_overlap_comm``
    followed by another option or nothing) means "true". Unknown fields raise ConfigError.
    """
    fields = set(ZeroConfig.field_names()) | {"profile_dir"} | set(PipelineConfig.options())
    bools = {f.name for f in dataclasses.fields(ZeroConfig) if isinstance(f.default, bool)}
    rest: list[str] = []
    options: dict[str, str] = {}
    i = 0
    while i < len(script_args):
        arg = script_args[i]
        if not arg.startswith(_PREFIX):
            rest.append(arg)
            i += 1
            continue
        name, eq, value = arg[len(_PREFIX):].partition("=")
        name = name.replace("-", "_")
        if name not in fields:
            valid = ", ".join(f"{_PREFIX}{f}" for f in sorted(fields))
            raise ConfigError(f"unknown option {_PREFIX}{name}; hfzero's options are {valid}")
        if not eq:
            nxt = script_args[i + 1] if i + 1 < len(script_args) else None
            if nxt is None or (nxt.startswith("--") and name in bools):
                if name not in bools:
                    raise ConfigError(f"{_PREFIX}{name} needs a value")
                value = "true"
            else:
                value = nxt
                i += 1
        if name in options:
            raise ConfigError(f"{_PREFIX}{name} given twice")
        options[name] = value
        i += 1
    return rest, options


def _check_conflicts(script_args: Sequence[str]) -> None:
    for arg in script_args:
        flag = arg.split("=", 1)[0]
        if flag in _CONFLICTS:
            raise ConfigError(f"{flag} cannot be combined with hfzero's --zero_* options: ZeRO replaces "
                              f"DeepSpeed and FSDP. Drop {flag} or the --zero_* options")


def _check_nproc(value: str) -> None:
    """torchrun asserts on ``--nproc_per_node 0``; say what it takes instead."""
    if value in _NPROC_WORDS:
        return
    try:
        ok = int(value) > 0
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(f"--nproc_per_node {value!r} is invalid: give a positive number of processes per node, "
                          f"or one of {', '.join(_NPROC_WORDS)}")


def options_from_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``HFZERO_*`` settings already in the environment, as ``{field: text}`` (``profile_dir`` included).

    Each is validated on its own, so an error names the variable.
    """
    environ = os.environ if environ is None else environ
    options = config_strings_from_env(environ)
    for field, raw in options.items():
        try:
            ZeroConfig.from_strings({field: raw})
        except ConfigError as error:
            raise ConfigError(f"environment variable {env_name(field)}={raw!r}: {error} Fix or unset it") from None
    if environ.get(PROFILE_DIR_ENV):
        options["profile_dir"] = environ[PROFILE_DIR_ENV]
    return options


def plan(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> LaunchPlan:
    """Parse and validate an ``hfzero run`` command line; raises ConfigError (or SystemExit from argparse).

    ``HFZERO_*`` variables already in ``environ`` (default ``os.environ``) count as options; a
    ``--zero_*`` flag for the same field wins.
    """
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "hfzero run"
    args = parser.parse_args(list(argv))
    _check_nproc(str(args.nproc_per_node))
    script_args, flags = split_zero_options(args.training_script_args)
    from_env = options_from_env(environ)
    options = {**from_env, **flags}
    if not options:
        return LaunchPlan(torchrun_args=args, env={}, zero_options={})
    overridden = sorted(k for k in from_env if k in flags and from_env[k] != flags[k])
    if overridden:
        logger.info("hfzero run: --zero_* flags override the environment for %s", ", ".join(overridden))
    _check_conflicts(script_args)
    profile_dir = options.pop("profile_dir", None)
    env = config_to_env(options)  # validates: raises ConfigError naming the field and the rule
    _check_tp_size(options, args)
    _check_node_sizes(options, args)
    if profile_dir is not None:
        env[PROFILE_DIR_ENV] = profile_dir
    if not args.module and not os.path.isfile(args.training_script):
        raise ConfigError(f"script {args.training_script!r} not found")
    if args.no_python:
        raise ConfigError("--no-python cannot be combined with --zero_* options: hfzero starts the script "
                          "through its own Python entry point")
    entry = [_MODULE_FLAG, args.training_script] if args.module else [args.training_script]
    args.training_script_args = entry + script_args
    args.training_script = __name__
    args.module = True
    return LaunchPlan(torchrun_args=args, env=env, zero_options={**options, **(
        {"profile_dir": profile_dir} if profile_dir is not None else {})})


def _check_tp_size(options: Mapping[str, str], args: argparse.Namespace) -> None:
    """``--zero_tp_size`` must divide the world (nproc_per_node x nnodes), checked before any process starts
    when both are plain numbers (``auto`` or an elastic ``1:4`` is checked by the workers instead)."""
    from hfzero.parallel.tensor import check_tp_size

    tp = int(options.get("tp_size", "1"))
    if tp > 1 and int(options.get("pp_size", "1")) > 1:
        raise ConfigError(_TP_WITH_PP)
    nproc, nnodes = str(args.nproc_per_node), str(args.nnodes).split(":")  # nnodes: "2" or "MIN:MAX"
    if tp > 1 and nproc.isdigit() and len(set(nnodes)) == 1 and nnodes[0].isdigit():
        check_tp_size(int(nproc) * int(nnodes[0]), tp)


def _check_node_sizes(options: Mapping[str, str], args: argparse.Namespace) -> None:
    """``--zero_shard_size`` and ``--zero_ranks_per_node`` must divide the world (nproc_per_node x nnodes), checked
    before any process starts when both are plain numbers (the workers check the rest: docs/multinode.md)."""
    nproc, nnodes = str(args.nproc_per_node), str(args.nnodes).split(":")
    if not (nproc.isdigit() and len(set(nnodes)) == 1 and nnodes[0].isdigit()):
        return
    world = int(nproc) * int(nnodes[0])
    for field in ("shard_size", "ranks_per_node"):
        value = int(options.get(field, "0"))
        if value and world % value:
            raise ConfigError(f"--zero_{field} {value} does not divide the world of {world} rank(s) "
                              f"(--nproc_per_node {nproc} x --nnodes {nnodes[0]}); use a divisor of {world}")


def launch(argv: Sequence[str]) -> int:
    """Validate, export ``HFZERO_*`` and run ``torch.distributed.run``; return its exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    from hfzero.integrations.gpus import accelerator_count

    launch_plan = plan(argv)
    _check_devices(launch_plan.torchrun_args)  # before anything starts: one rank per GPU
    os.environ.update(launch_plan.env)  # the environment's HFZERO_* with the flags applied over them
    if accelerator_count() == 0:
        # transformers/accelerate treat a torchrun worker on a host without an accelerator as a
        # single process unless told it is a CPU run: each rank would train alone on all the data.
        # With ACCELERATE_USE_CPU they form a gloo data-parallel group.
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    if launch_plan.zero_options:
        logger.info("hfzero run: %s", " ".join(f"--zero_{k} {v}" for k, v in launch_plan.zero_options.items()))
    try:
        run(launch_plan.torchrun_args)
    except ChildFailedError as error:
        if any(f.exitcode == NOT_APPLIED_EXIT for f in error.failures.values()):
            logger.error("%s", _not_applied_message(launch_plan.zero_options))
            return NOT_APPLIED_EXIT
        logger.error("a worker failed: %s", error.get_first_failure()[1].message)
        return 1
    return 0


def _check_devices(args: argparse.Namespace) -> None:
    """Refuse more ranks per host than visible GPUs unless the run is a CPU run (see integrations/gpus.py)."""
    from hfzero.integrations.gpus import check_ranks_fit_devices, cpu_requested

    nproc = str(args.nproc_per_node)
    if nproc.isdigit():
        cpu = cpu_requested() or _flag_true(list(args.training_script_args), "--use_cpu")
        check_ranks_fit_devices(int(nproc), what="hfzero run", cpu=cpu)


def _flag_true(script_args: list[str], flag: str) -> bool:
    """The script's boolean ``flag`` is given and true (``--use_cpu``, ``--use_cpu true``, ``--use_cpu=true``)."""
    for index, token in enumerate(script_args):
        if token == flag:
            following = script_args[index + 1] if index + 1 < len(script_args) else ""
            return following.startswith("-") or following.lower() not in ("false", "0", "no", "n", "off")
        if token.startswith(flag + "="):
            return token.split("=", 1)[1].lower() not in ("false", "0", "no", "n", "off")
    return False


def _not_applied_message(options: dict[str, str]) -> str:
    given = " ".join(f"--zero_{k} {v}" for k, v in options.items()) or "the HFZERO_* settings"
    return (f"ZeRO was NOT applied: {given} had no effect, because the script prepared no model with hfzero. "
            "`hfzero run` swaps transformers.Trainer/TrainingArguments and accelerate.Accelerator; a script "
            "using neither (a plain torch loop, its own DDP) must call hfzero.prepare itself. "
            "See docs/integrations.md")


def _patch_frameworks() -> None:
    """Make ``transformers.Trainer``/``TrainingArguments`` and ``accelerate.Accelerator`` the ZeRO classes
    for scripts that import them (``Trainer`` subclasses imported later, such as ``Seq2SeqTrainer`` or
    TRL's ``SFTTrainer``, then derive from ZeroTrainer too)."""
    import accelerate
    import accelerate.accelerator
    import transformers
    import transformers.trainer
    import transformers.training_args

    from hfzero.integrations.accelerate import ZeroAccelerator
    from hfzero.integrations.trainer import ZeroTrainer, ZeroTrainingArguments

    transformers.Trainer = ZeroTrainer  # type: ignore[misc]
    transformers.trainer.Trainer = ZeroTrainer  # type: ignore[misc]
    transformers.TrainingArguments = ZeroTrainingArguments  # type: ignore[misc]
    transformers.training_args.TrainingArguments = ZeroTrainingArguments  # type: ignore[misc]
    # after transformers.trainer is imported: the Trainer builds its accelerator through ZeroTrainer
    accelerate.Accelerator = ZeroAccelerator  # type: ignore[misc]
    accelerate.accelerator.Accelerator = ZeroAccelerator  # type: ignore[misc]


def main(argv: Sequence[str] | None = None) -> None:
    """Worker entry point: patch transformers when ``HFZERO_*`` is set, then run the script as ``__main__``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    as_module = bool(argv) and argv[0] == _MODULE_FLAG
    if as_module:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -m hfzero.integrations.launch [--hfzero-module] SCRIPT [ARGS...]")
    zero = bool(config_strings_from_env() or pipeline_strings_from_env() or os.environ.get(PROFILE_DIR_ENV))
    if zero:
        _patch_frameworks()
        _load_through_hfzero()
    target, script_args = argv[0], argv[1:]
    sys.argv = [target, *script_args]
    try:
        if as_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as `python SCRIPT` does
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exit_:
        if exit_.code not in (None, 0):
            _report_if_not_applied(zero)
            raise  # the script's own failure: exit as Python would, with its message and code
    except BaseException:
        _report_if_not_applied(zero)
        raise
    _exit_cleanly(NOT_APPLIED_EXIT if _report_if_not_applied(zero) else 0)


def _load_through_hfzero() -> None:
    """``--zero_stage 0-3``: the script's from_pretrained calls load through hfzero's hook (docs/loading.md)."""
    from hfzero.loading.hook import enable, wanted

    options = config_strings_from_env()
    try:
        config = ZeroConfig.from_strings(options)
    except ConfigError:
        return  # validated by plan(); the Trainer or accelerator reports it
    if wanted(config.stage, config.tp_size, bool(pipeline_strings_from_env())):
        enable()


def _report_if_not_applied(zero: bool) -> bool:
    """Log an error when ZeRO options were given but no model was prepared; see [Note: ZeRO not applied]."""
    from hfzero.runtime.prepare import prepared_count

    if not zero or prepared_count() > 0:
        return False
    logger.error("rank %s: %s", os.environ.get("RANK", "0"), _not_applied_message(config_strings_from_env()))
    return True


def _exit_cleanly(code: int = 0) -> None:
    """Leave a worker whose script finished: tear down the process group, flush, and ``os._exit(code)``.

    gloo workers can abort in interpreter teardown after the script returned ("terminate called
    without an active exception"), which torchrun reports as a failed run. The script has finished
    and its output is flushed here, so skipping the interpreter's teardown loses nothing; a real
    failure never reaches this point (it raises above).
    """
    import logging

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
