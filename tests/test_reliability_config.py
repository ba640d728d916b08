"""Issue 15: options and the launcher under bad input (finding 9) and HFZERO_* under `hfzero run` (finding 2).

In process: nothing here starts a worker (torchrun's ``run`` is replaced where a launch gets that far).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hfzero.config import ConfigError, ZeroConfig
from hfzero.integrations.env import config_strings_from_env
from hfzero.integrations.launch import plan

SCRIPT = str(Path(__file__).resolve().parents[1] / "examples" / "train_clm.py")


def _plan(*args: str, environ: dict[str, str] | None = None):
    return plan(["--nproc_per_node", "2", SCRIPT, "--output_dir", "o", *args], environ=environ or {})


# ---- finding 9 -------------------------------------------------------------------------------------
@pytest.mark.parametrize("values, message", [
    ({"reduce_bucket_size": "1e400"}, "cannot read '1e400' as int"),
    ({"stage": "2.9e0"}, "cannot read '2.9e0' as int"),
    ({"initial_loss_scale": "inf"}, "initial_loss_scale must be a finite number"),
    ({"loss_scale": "nan"}, "loss_scale must be a finite number"),
])
def test_numbers_that_are_not_what_they_claim_are_refused(values, message):
    with pytest.raises(ConfigError, match=message):
        ZeroConfig.from_strings(values)


def test_integral_exponent_form_and_python_values():
    assert ZeroConfig.from_strings({"reduce_bucket_size": "25e6", "stage": "3e0"}).reduce_bucket_size == 25_000_000
    with pytest.raises(ConfigError, match="stage"):
        ZeroConfig(stage=2.0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="initial_loss_scale"):
        ZeroConfig(dtype="fp16", initial_loss_scale=float("inf"))


@pytest.mark.parametrize("args, message", [
    (["--zero_reduce_bucket_size", "1e400"], "cannot read '1e400' as int"),
    (["--zero_stage", "2.9e0"], "cannot read '2.9e0' as int"),
])
def test_cli_run_reports_bad_numbers_in_one_line(args, message, capsys):
    from hfzero.cli import main

    assert main(["run", "--nproc_per_node", "2", SCRIPT, "--output_dir", "o", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("nproc", ["0", "-1", "two"])
def test_nproc_per_node_must_be_positive(nproc):
    with pytest.raises(ConfigError, match="--nproc_per_node"):
        plan(["--nproc_per_node", nproc, SCRIPT], environ={})


def test_dashboard_and_test_hook_variables_are_not_taken_for_options():
    environ = {"HFZERO_DASHBOARD_RUNS": "/runs", "HFZERO_CHECKPOINT_PAUSE_AT": "x", "HFZERO_STAGE": "1"}
    assert config_strings_from_env(environ) == {"stage": "1"}
    with pytest.raises(ConfigError, match="HFZERO_STAEG names no ZeroConfig option"):
        config_strings_from_env({"HFZERO_STAEG": "1"})


def test_every_variable_the_library_reads_is_known():
    """Each ``HFZERO_*`` name the library or dashboard spells out is an option's or on the list of the others, so
    setting it never makes `hfzero run` refuse it as a typo."""
    import re
    from pathlib import Path

    import hfzero
    from hfzero.integrations.env import NOT_CONFIG

    root = Path(hfzero.__file__).parent
    spelled = {name for path in [*root.rglob("*.py"), *(root.parent / "dashboard").rglob("*.py")]
               for name in re.findall(r"[\"'](HFZERO_[A-Z0-9_]+)[\"']", path.read_text())}
    assert {"HFZERO_WORKER_START", "HFZERO_FORCE_HOST_OFFLOAD"} <= spelled
    assert config_strings_from_env({name: "1" for name in spelled & NOT_CONFIG}) == {}
    assert spelled - NOT_CONFIG == set(), "add these to NOT_CONFIG in hfzero/integrations/env.py"


# ---- finding 2: `hfzero run` honours HFZERO_* from the environment; flags win ------------------------
def test_environment_options_are_honoured_and_flags_win():
    from_env = _plan(environ={"HFZERO_STAGE": "3", "HFZERO_DTYPE": "bf16"})
    assert from_env.env == {"HFZERO_STAGE": "3", "HFZERO_DTYPE": "bf16"}
    assert from_env.torchrun_args.training_script == "hfzero.integrations.launch"  # ZeRO, not plain DDP
    both = _plan("--zero_stage", "1", environ={"HFZERO_STAGE": "3"})
    assert both.env == {"HFZERO_STAGE": "1"}
    profile = _plan(environ={"HFZERO_PROFILE_DIR": "/p"})
    assert profile.env == {"HFZERO_PROFILE_DIR": "/p"}
    assert _plan(environ={"HFZERO_DASHBOARD_RUNS": "/r"}).env == {}  # plain torchrun


def test_bad_environment_value_names_the_variable():
    with pytest.raises(ConfigError, match="environment variable HFZERO_STAGE='7'"):
        _plan(environ={"HFZERO_STAGE": "7"})


def test_launch_hands_the_environment_options_to_the_workers(monkeypatch):
    import torch.distributed.run

    from hfzero.integrations import launch

    seen = {}
    monkeypatch.setattr(os, "environ", dict(os.environ))  # launch exports into it: keep that to this test
    monkeypatch.setattr(torch.distributed.run, "run", lambda args: seen.update(
        {k: v for k, v in os.environ.items() if k.startswith("HFZERO_")}, script=args.training_script))
    os.environ.update(HFZERO_STAGE="3", HFZERO_DASHBOARD_RUNS="/r")
    assert launch.launch(["--nproc_per_node", "2", SCRIPT, "--output_dir", "o", "--zero_dtype", "bf16"]) == 0
    assert seen == {"HFZERO_STAGE": "3", "HFZERO_DTYPE": "bf16", "HFZERO_DASHBOARD_RUNS": "/r",
                    "script": "hfzero.integrations.launch"}
