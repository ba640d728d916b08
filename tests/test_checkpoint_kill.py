"""A save killed with SIGKILL at each point of [Note: atomic checkpoint] leaves the previous checkpoint
loadable, and training resumed from it matches uninterrupted training exactly.

Each child process trains a small MLP (with a frozen layer and a buffer that changes every step, so
both must be restored), saves at step K, trains one more step and saves again into the same
directory with ``HFZERO_CHECKPOINT_PAUSE_AT=<phase>``: the save stops at that phase and signals;
the test then SIGKILLs the child. Each phase is tried with a synchronous save and with an asynchronous
one (``async_save``: the phases happen on the background thread while the child trains another step and
then waits for the save; see [Note: asynchronous saves]). One more child's asynchronous save fails in the
background and the child ends without waiting for it: its exit status must say so. The children run
concurrently.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from hfzero import ZeroConfig, prepare
from hfzero.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, wait_for_save

K, STEPS = 3, 6
PHASES = ("rank_file_written", "manifest_written", "between_renames")
RUNS = [(phase, False) for phase in PHASES] + [(phase, True) for phase in PHASES]  # (phase, async_save)


class MLP(nn.Module):
    """Trainable layers, a frozen layer and a persistent buffer counting forward calls."""

    def __init__(self, seed: int = 0, hidden: int = 32, name: str = "fc1"):
        super().__init__()
        torch.manual_seed(seed)
        setattr(self, name, nn.Linear(8, hidden))
        self._first = name
        self.fc2 = nn.Linear(hidden, 4)
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.frozen(self.fc2(torch.relu(getattr(self, self._first)(x)))) * (1 + 0.01 * self.calls)


def build(stage: int = 1, seed: int = 0, **kwargs):
    """Prepared MLP and optimizer; at stage 3 every trainable parameter is partitioned (threshold 0)."""
    model = MLP(seed, **kwargs)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return prepare(model, opt, ZeroConfig(stage=stage, reduce_bucket_size=100, param_persistence_threshold=0))


def data(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)) for _ in range(steps)]


def train(model, opt, batches) -> list[float]:
    losses = []
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def child_main(ckpt: str, phase: str, signal_path: str, async_save: bool = False) -> None:
    """Save at step K, then save again at K + 1 and get killed in the middle (run in a subprocess)."""
    model, opt = build()
    batches = data()
    train(model, opt, batches[:K])
    save_checkpoint(ckpt, model, opt, extra={"step": K})
    train(model, opt, batches[K:K + 1])
    os.environ.update(HFZERO_CHECKPOINT_PAUSE_AT=phase, HFZERO_CHECKPOINT_PAUSE_SIGNAL=signal_path)
    save_checkpoint(ckpt, model, opt, extra={"step": K + 1}, async_save=async_save)
    if async_save:  # the save pauses on the background thread: training goes on, then waits for it
        train(model, opt, batches[K + 1:K + 2])
        wait_for_save()
    sys.exit(3)  # not reached when the pause hook works


def failing_child_main(ckpt: str) -> None:
    """An asynchronous save whose background write fails; the script ends without waiting for it."""
    import hfzero.checkpoint.save as save_module

    def fail(*args, **kwargs):
        raise OSError("No space left on device (injected)")

    model, opt = build()
    train(model, opt, data()[:K])
    save_module.write_safetensors = fail
    save_checkpoint(ckpt, model, opt, async_save=True)
    train(model, opt, data()[K:K + 1])  # the script ends here: the exit waits for the save and reports it


def _spawn(code: str) -> subprocess.Popen:
    tests = str(Path(__file__).parent)
    return subprocess.Popen([sys.executable, "-c", f"import sys; sys.path.insert(0, {tests!r}); "
                             f"import test_checkpoint_kill as t; {code}"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _run_children(tmp_path: Path) -> tuple[dict[tuple[str, bool], Path], subprocess.Popen]:
    children = {}
    for phase, async_save in RUNS:
        where = tmp_path / f"{phase}{'-async' if async_save else ''}"
        ckpt, sig = where / "ckpt", where.with_suffix(".signal")
        proc = _spawn(f"t.child_main({str(ckpt)!r}, {phase!r}, {str(sig)!r}, {async_save})")
        children[(phase, async_save)] = (proc, Path(f"{sig}.rank0"), ckpt)
    failing = _spawn(f"t.failing_child_main({str(tmp_path / 'failing' / 'ckpt')!r})")
    deadline = time.monotonic() + 150
    for phase, (proc, sig, _) in children.items():
        while not sig.exists():
            if proc.poll() is not None:
                pytest.fail(f"child for {phase} exited ({proc.returncode}) before pausing:\n"
                            f"{proc.stdout.read().decode()[-3000:]}")
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"child for {phase} never reached the pause")
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        assert proc.returncode == -signal.SIGKILL
    return {run: ckpt for run, (_, _, ckpt) in children.items()}, failing


def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path):
    killed, failing = _run_children(tmp_path)
    model, opt = build()
    reference = train(model, opt, data())

    for async_save in (False, True):
        partial = killed[("rank_file_written", async_save)].parent / ".ckpt.partial"
        assert partial.is_dir() and not (partial / "manifest.json").exists()
        with pytest.raises(CheckpointError, match="incomplete"):
            load_checkpoint(partial, *build())
        assert not killed[("between_renames", async_save)].exists(), "the kill came between the two renames"

    for phase, ckpt in killed.items():
        model, opt = build(seed=11)
        extra = load_checkpoint(ckpt, model, opt)
        assert extra == {"step": K}, phase
        assert train(model, opt, data()[K:]) == reference[K:], f"{phase}: resumed losses differ"
        # the next save into the same directory cleans up after the killed one
        save_checkpoint(ckpt, model, opt, extra={"step": STEPS})
        leftovers = sorted(p.name for p in ckpt.parent.iterdir())
        assert leftovers == ["ckpt"], f"{phase}: {leftovers}"
        assert json.loads((ckpt / "manifest.json").read_text())["extra"] == {"step": STEPS}

    # the background failure of the child that did not wait: reported at exit, with a failing status
    output = failing.communicate(timeout=120)[0].decode()
    assert failing.returncode == 1, f"exit status {failing.returncode}:\n{output[-3000:]}"
    assert "asynchronous save" in output and "No space left on device (injected)" in output, output[-3000:]
    assert not (tmp_path / "failing" / "ckpt").exists()


@pytest.mark.parametrize("stage", [1, 3])
def test_async_save_with_frozen_tensors_equals_sync(tmp_path, stage):
    """Frozen parameters (written live; at stage 3 from the save's own gathered copies) and a buffer that
    changes every step (staged): the asynchronous files equal the synchronous ones byte for byte although
    training runs a step before the background write is waited for."""
    model, opt = build(stage=stage)
    train(model, opt, data()[:2])
    save_checkpoint(tmp_path / "sync", model, opt)
    save_checkpoint(tmp_path / "async", model, opt, async_save=True)
    train(model, opt, data()[2:3])
    wait_for_save()
    names = sorted(p.name for p in (tmp_path / "sync").iterdir())
    assert "frozen.safetensors" in names
    assert names == sorted(p.name for p in (tmp_path / "async").iterdir())
    for name in names:
        assert (tmp_path / "sync" / name).read_bytes() == (tmp_path / "async" / name).read_bytes(), name
