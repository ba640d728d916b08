"""Helpers shared by the Trainer integration tests (launch a script, read its per-step losses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
CLM = str(ROOT / "examples" / "train_clm.py")
STEPS = 4
LAUNCH_TIMEOUT_S = 900
"""Per launch. One takes ~20 s on an idle 2-core host; generous, for a loaded machine."""


def clm_args(out: Path, per_device_batch: int = 2) -> list[str]:
    """train_clm.py arguments: tiny dropout-free GPT-2, accumulation 2, clipping, eval and saves every 2 steps.

    ``--greater_is_better true`` on eval_loss makes checkpoint-2 (the higher loss) the best one, so
    ``load_best_model_at_end`` has to load weights that differ from the final ones.
    """
    return [CLM, "--do_train", "--config_name", "tiny", "--config_overrides", "resid_pdrop=0,embd_pdrop=0,attn_pdrop=0",
            "--output_dir", str(out), "--max_steps", str(STEPS), "--per_device_train_batch_size",
            str(per_device_batch), "--gradient_accumulation_steps", "2", "--learning_rate", "1e-3",
            "--max_grad_norm", "0.5", "--logging_steps", "1", "--save_steps", "2", "--eval_strategy", "steps",
            "--eval_steps", "2", "--per_device_eval_batch_size", "8", "--load_best_model_at_end", "true",
            "--metric_for_best_model", "eval_loss", "--greater_is_better", "true",
            "--report_to", "none", "--disable_tqdm", "true", "--seed", "0"]


REFERENCE_ENV = Path(__file__).resolve().parent / "reference_env"
"""Holds the sitecustomize.py the plain-torchrun reference runs start with (the gloo teardown exit hook)."""


def launch(cmd: list[str], env: dict[str, str] | None = None) -> str:
    """Run a launcher command, return its output; plain torchrun on a CPU host gets ACCELERATE_USE_CPU (as
    `hfzero run` sets)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=env or launch_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout + proc.stderr


def launch_env() -> dict[str, str]:
    """The environment for launched workers: one thread each, and a CPU run with any GPU hidden, so these
    multi-rank CPU launches pass on a host with fewer GPUs than ranks too (`hfzero run` refuses more ranks
    than visible GPUs for a GPU run; see hfzero/integrations/gpus.py)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "ACCELERATE_USE_CPU": "true"}


def _torchrun_options(nproc: int) -> list[str]:
    # --standalone: rendezvous on a free port, so runs started by other tests or users at the same time
    # never collide on torchrun's default port 29500
    return ["--standalone", "--nproc_per_node", str(nproc)]


def torchrun(nproc: int, args: list[str]) -> str:
    env = launch_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REFERENCE_ENV), env.get("PYTHONPATH")]))
    return launch([sys.executable, "-m", "torch.distributed.run", *_torchrun_options(nproc), *args], env=env)


def hfzero_run(nproc: int, args: list[str]) -> str:
    return launch([sys.executable, "-m", "hfzero", "run", *_torchrun_options(nproc), *args])


class Runs(Mapping[str, Path]):
    """Output directory by run name ("ddp" and each variant); a run is launched the first time it is looked up,
    so a selection of the tests (``-k``, the floor subset in tests/floor/) launches only the runs it reads. A
    launch that failed fails every later lookup of it with the same error, without launching again."""

    def __init__(self, root: Path, variants: dict[str, list[str]], nproc: int, extra: Sequence[str]) -> None:
        self.root, self.variants, self.nproc, self.extra = root, variants, nproc, list(extra)
        self._done: dict[str, Path | Exception] = {}

    def __getitem__(self, name: str) -> Path:
        if name != "ddp" and name not in self.variants:
            raise KeyError(name)
        if name not in self._done:
            out = self.root / name
            try:
                if name == "ddp":
                    torchrun(2, clm_args(out))
                else:
                    log = hfzero_run(self.nproc, [*clm_args(out), *self.variants[name], *self.extra])
                    (self.root / f"{name}.log").write_text(log)
                self._done[name] = out
            except Exception as error:  # remembered: re-raised below and at every later lookup
                self._done[name] = error
        done = self._done[name]
        if isinstance(done, Exception):
            raise done
        return done

    def __iter__(self) -> Iterator[str]:
        return iter(["ddp", *self.variants])

    def __len__(self) -> int:
        return 1 + len(self.variants)


def run_variants(root: Path, variants: dict[str, list[str]], nproc: int = 2, extra: Sequence[str] = ()) -> Runs:
    """train_clm.py under plain torchrun DDP on 2 ranks ("ddp") and each variant's options (plus ``extra``)
    under `hfzero run` on ``nproc`` ranks, each launched when first read (``Runs``); output directories by
    name, each `hfzero run` launch's log in ``root/<name>.log``."""
    return Runs(root, variants, nproc, extra)


def log_history(out: Path) -> list[dict]:
    return json.loads((out / "trainer_state.json").read_text())["log_history"]


def losses(out: Path, key: str = "loss") -> dict[int, float]:
    """Per-step training losses the Trainer logged (averaged over ranks), or ``key="eval_loss"``."""
    return {h["step"]: h[key] for h in log_history(out) if key in h}


def assert_losses_match(got: dict[int, float], want: dict[int, float], rel: float = 1e-5) -> None:
    assert sorted(got) == sorted(want), (got, want)
    for step in want:
        assert abs(got[step] - want[step]) <= rel * abs(want[step]), (step, got, want)
