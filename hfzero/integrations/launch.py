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

[Note: restarts]
``--max_restarts N`` restarts every worker of a node when one fails (torchelastic). By default torch
shares the c10d rendezvous' TCP store with the workers; after a restart on one launcher
(``--standalone``) the re-formed gloo group then fails with "Gloo connectFullMesh failed ... Connection
refused" (pytorch #135712; measured here, and passing with the variable below). ``hfzero run``
therefore sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (the workers get a store of their own each
round) unless the environment already sets it. The static rendezvous (``--master_addr``/``--node_rank``
over several nodes) gives restarted workers no fresh store at all and they fail the same way, so
``plan`` warns. A restarted worker sees ``TORCHELASTIC_RESTART_COUNT`` > 0 (per node: see
hfzero/integrations/resume.py), and ZeroTrainer resumes from the newest complete checkpoint.
Every worker writes its exception into torchelastic's error file (``TORCHELASTIC_ERROR_FILE``), so
a failure is reported with its rank, node and first error line (``failure_message``).

[Note: ZeRO not applied]
The ``--zero_*`` options are never ignored silently: a worker whose script ends without any model
prepared by hfzero (a plain torch loop, a custom trainer that builds its own DDP) logs an error
saying so and exits with ``NOT_APPLIED_EXIT`` (3) even when the script itself succeeded; the
launcher then repeats the message and returns 3. A script that fails before any model is prepared gets a
message saying that it failed first (it may have failed while loading, before reaching its Trainer), then fails as
it would have.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import runpy
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from hfzero.config import ConfigError, ZeroConfig
from hfzero.integrations.env import (PROFILE_DIR_ENV, config_strings_from_env, config_to_env, env_name,
                                    pipeline_strings_from_env, split_pipeline_options)
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
_EP_WITH_PP = ("--zero_ep_size and --zero_pp_size cannot be combined yet (pipeline x expert parallelism is not "
               "built); use one of them")
"""Exit status of a worker (and of ``hfzero run``) whose script prepared no model with hfzero."""
RESTART_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""Set by ``hfzero run`` unless already in the environment; see [Note: restarts]."""

_SP_WITH_PP = ("--zero_sp_size and --zero_pp_size cannot be combined yet (pipeline x sequence parallelism is not "
               "built); use one of them")


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
    argv = options_after_script(list(argv), parser)
    args = parser.parse_args(argv)
    _check_nproc(str(args.nproc_per_node))
    _check_nodes(args)
    _warn_static_restarts(args)
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
    _check_mixed_precision(options, script_args)
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


def options_after_script(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``hfzero run --zero_stage 2 [torchrun options] SCRIPT ...``: move ``--zero_*`` options given before the
    script to just after it, where ``split_zero_options`` takes them (torchrun's parser would stop at them
    with a bare "unrecognized arguments"). The script is the first token that is neither a torchrun option
    (with its value) nor a ``--zero_*`` option (with its value: a boolean option takes one only when it
    reads as true/false, so ``--zero_overlap_comm train.py`` is the flag and then the script)."""
    takes_value = {s: a.nargs != 0 for a in parser._actions for s in a.option_strings}
    bools = {f.name for f in dataclasses.fields(ZeroConfig) if isinstance(f.default, bool)}
    moved: list[int] = []  # indices of the --zero_* tokens before the script
    i = 0
    while i < len(argv):
        token = argv[i]
        name, eq, _ = token.partition("=")
        if token.startswith(_PREFIX):
            field = name[len(_PREFIX):].replace("-", "_")
            value_next = not eq and i + 1 < len(argv) and (
                field not in bools or argv[i + 1].lower() in ("true", "false", "1", "0", "yes", "no"))
            moved += range(i, i + 1 + value_next)
            i += 1 + value_next
        elif name in takes_value:
            i += 1 + (takes_value[name] and not eq)
        else:
            break  # the script (or "--" / an unknown option torchrun's parser reports itself)
    if not moved:
        return argv
    options = [argv[j] for j in moved]
    if i >= len(argv):
        raise ConfigError(f"{' '.join(options)} but no script: hfzero run [torchrun options] SCRIPT "
                          "[script args] [--zero_* options]")
    logger.info("hfzero run: %s given before the script: taken as hfzero options", " ".join(options))
    return [t for j, t in enumerate(argv[:i]) if j not in moved] + argv[i:i + 1] + options + argv[i + 1:]


def _check_nodes(args: argparse.Namespace) -> None:
    """``--nnodes``, ``--node_rank`` and ``--max_restarts`` before anything starts (torchrun would wait for a
    node that never comes, or fail inside its agent)."""
    parts = str(args.nnodes).split(":")
    try:
        low, high = int(parts[0]), int(parts[-1])
        ok = len(parts) <= 2 and 1 <= low <= high
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(f"--nnodes {args.nnodes!r} is invalid: give a number of nodes N, or MIN:MAX with "
                          "1 <= MIN <= MAX for an elastic run")
    if args.rdzv_backend == "static" and not args.standalone and low != high:
        raise ConfigError(f"--nnodes {args.nnodes} (elastic) needs a dynamic rendezvous: add --rdzv_backend c10d "
                          "--rdzv_endpoint HOST:PORT --rdzv_id ID (the static one takes a fixed number of nodes)")
    if args.rdzv_backend == "static" and not args.standalone and not 0 <= int(args.node_rank) < high:
        raise ConfigError(f"--node_rank {args.node_rank} is outside --nnodes {high}: node ranks are 0 to {high - 1}")
    if int(args.max_restarts) < 0:
        raise ConfigError(f"--max_restarts {args.max_restarts} is invalid: give 0 (no restart) or more")


def _warn_static_restarts(args: argparse.Namespace) -> None:
    """``--max_restarts`` over several nodes with the static rendezvous (``--master_addr``/``--node_rank``): the
    restarted workers get no fresh store and fail to connect (see [Note: restarts])."""
    if int(args.max_restarts) > 0 and args.rdzv_backend == "static" and str(args.nnodes) not in ("1", "1:1"):
        logger.warning("hfzero run: --max_restarts %s with a static rendezvous over --nnodes %s: restarted workers "
                       "failed to re-form their group in our tests (Gloo connectFullMesh); use --rdzv_backend c10d "
                       "--rdzv_endpoint HOST:PORT --rdzv_id ID for restarts across nodes", args.max_restarts, args.nnodes)


def _check_mixed_precision(options: Mapping[str, str], script_args: list[str]) -> None:
    """The script's ``--bf16``/``--fp16`` against ``--zero_dtype``, before any process starts (the Trainer
    would refuse the pair in every worker, after start-up)."""
    from hfzero.integrations.accelerate import apply_mixed_precision

    mixed = "fp16" if _flag_true(script_args, "--fp16") else "bf16" if _flag_true(script_args, "--bf16") else None
    if mixed is None or "dtype" not in options:
        return
    zero, _ = split_pipeline_options({k: v for k, v in options.items() if k != "profile_dir"})
    try:
        apply_mixed_precision(ZeroConfig.from_strings(zero), mixed)
    except ConfigError as error:
        raise ConfigError(f"the script's --{mixed} and --zero_dtype {options['dtype']} conflict: {error}") from None


def _check_tp_size(options: Mapping[str, str], args: argparse.Namespace) -> None:
    """``--zero_tp_size``, ``--zero_ep_size`` and ``--zero_sp_size`` must divide the world (nproc_per_node x
    nnodes), checked before any process starts when they are plain numbers (``auto`` or an elastic ``1:4`` is
    checked by the workers instead); none combines with ``--zero_pp_size`` yet."""
    from hfzero.parallel.expert import check_ep_size
    from hfzero.parallel.sequence.mesh import check_sp_size
    from hfzero.parallel.tensor import check_tp_size

    tp, ep = int(options.get("tp_size", "1")), int(options.get("ep_size", "1"))
    sp = int(options.get("sp_size", "1"))
    pp = int(options.get("pp_size", "1"))
    if tp > 1 and pp > 1:
        raise ConfigError(_TP_WITH_PP)
    if ep > 1 and pp > 1:
        raise ConfigError(_EP_WITH_PP)
    if sp > 1 and pp > 1:
        raise ConfigError(_SP_WITH_PP)
    nproc, nnodes = str(args.nproc_per_node), str(args.nnodes).split(":")  # nnodes: "2" or "MIN:MAX"
    if nproc.isdigit() and len(set(nnodes)) == 1 and nnodes[0].isdigit():
        if tp > 1:
            check_tp_size(int(nproc) * int(nnodes[0]), tp)
        if ep > 1:
            check_ep_size(int(nproc) * int(nnodes[0]), ep)
        if sp > 1:
            check_sp_size(int(nproc) * int(nnodes[0]), sp)


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
    for name, value in RESTART_ENV.items():  # see [Note: restarts]; a user's own setting wins
        os.environ.setdefault(name, value)
    if accelerator_count() == 0 or _cpu_run(launch_plan.torchrun_args):
        # transformers/accelerate treat a torchrun worker on a host without an accelerator as a
        # single process unless told it is a CPU run: each rank would train alone on all the data.
        # With ACCELERATE_USE_CPU they form a gloo data-parallel group. A CPU run on a host with GPUs
        # (the script's --use_cpu) needs it too: the accelerator the Trainer builds reads no --use_cpu,
        # and would refuse more ranks than GPUs (integrations/gpus.py).
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    if launch_plan.zero_options:
        logger.info("hfzero run: %s", " ".join(f"--zero_{k} {v}" for k, v in launch_plan.zero_options.items()))
    try:
        run(launch_plan.torchrun_args)
    except ChildFailedError as error:
        if any(f.exitcode == NOT_APPLIED_EXIT for f in error.failures.values()):
            logger.error("%s", _not_applied_message(launch_plan.zero_options))
            return NOT_APPLIED_EXIT
        logger.error("%s", failure_message(error, launch_plan.torchrun_args))
        return 1
    return 0


def failure_message(error: Any, args: argparse.Namespace) -> str:
    """Which worker failed first, where, and its first error line (from the error file every hfzero worker
    writes: see ``main``), then how many others failed. ``error`` is torchelastic's ChildFailedError."""
    rank, first = error.get_first_failure()
    node = f"node {args.node_rank} ({socket.gethostname()})"
    if first.exitcode < 0:
        what = f"was killed by signal {-first.exitcode} ({first.signal_name()})"
    else:
        what = f"exited with code {first.exitcode}"
    message = first.message.get("message", "") if isinstance(first.message, dict) else first.message
    text = str(message).strip().splitlines()[0] if str(message or "").strip() else ""
    if not text or text.startswith(("To enable traceback", "Signal ")):  # torchelastic's texts: no report
        detail = "; it left no error report (see its output above)" if first.exitcode >= 0 else ""
    else:
        detail = f": {text}"
    others = sorted(r for r in error.failures if r != rank)
    also = f" (rank(s) {', '.join(map(str, others))} on this node failed too)" if others else ""
    return (f"worker rank {rank} (local rank {first.local_rank}) on {node} {what}{detail}{also}. The run stopped"
            f"{'' if int(args.max_restarts) == 0 else ' after ' + str(args.max_restarts) + ' restart(s)'}")


def _check_devices(args: argparse.Namespace) -> None:
    """Refuse more ranks per host than visible GPUs unless the run is a CPU run (see integrations/gpus.py)."""
    from hfzero.integrations.gpus import check_ranks_fit_devices, cpu_requested

    nproc = str(args.nproc_per_node)
    if nproc.isdigit():
        check_ranks_fit_devices(int(nproc), what="hfzero run", cpu=cpu_requested() or _cpu_run(args))


def _cpu_run(args: argparse.Namespace) -> bool:
    """The script is told to train on the CPU (``--use_cpu``, ``--use_cpu true``, ``--use_cpu=true``)."""
    return _flag_true(list(args.training_script_args), "--use_cpu")


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
            _report_if_not_applied(zero, failed=True)
            _record_failure(exit_)
            raise  # the script's own failure: exit as Python would, with its message and code
    except BaseException as error:
        _report_if_not_applied(zero, failed=True)
        _record_failure(error)
        raise
    _exit_cleanly(NOT_APPLIED_EXIT if _report_if_not_applied(zero) else 0)


def _record_failure(error: BaseException) -> None:
    """Write the worker's exception into torchelastic's error file (``TORCHELASTIC_ERROR_FILE``, set by the
    launcher), which the launcher reads to name the failure (``failure_message``); what torchelastic's
    ``@record`` does, for SystemExit too. Nothing happens outside torchelastic."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    if isinstance(error, SystemExit):
        error = RuntimeError(f"the script exited with {error.code!r}" if not isinstance(error.code, str)
                             else error.code)
    try:
        get_error_handler().record_exception(error)
    except OSError:
        logger.warning("could not write the error file %s", os.environ["TORCHELASTIC_ERROR_FILE"])


def _load_through_hfzero() -> None:
    """``--zero_stage 0-3``: the script's from_pretrained calls load through hfzero's hook (docs/loading.md)."""
    from hfzero.loading.hook import enable, wanted

    options = config_strings_from_env()
    try:
        config = ZeroConfig.from_strings(options)
    except ConfigError:
        return  # validated by plan(); the Trainer or accelerator reports it
    if wanted(config.stage, config.tp_size, bool(pipeline_strings_from_env()), config.ep_size):
        enable()


def _report_if_not_applied(zero: bool, failed: bool = False) -> bool:
    """Log an error when ZeRO options were given but no model was prepared; see [Note: ZeRO not applied]. When
    the script ``failed``, it may simply have failed before reaching the Trainer's or accelerator's prepare (while
    loading, say): the message then says both, without claiming the script could not use hfzero."""
    from hfzero.runtime.prepare import prepared_count

    if not zero or prepared_count() > 0:
        return False
    if failed:
        logger.error("rank %s: the script failed before any model was prepared with hfzero, so ZeRO was not applied "
                     "yet (it may have failed while loading, before its Trainer or Accelerator; its error follows). "
                     "If the script has no Trainer, Accelerator or hfzero.prepare at all: %s",
                     os.environ.get("RANK", "0"), _not_applied_message(config_strings_from_env()))
        return True
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
