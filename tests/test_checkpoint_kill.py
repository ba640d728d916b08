"""A save killed with SIGKILL at each point of [Note: atomic checkpoint] leaves the previous checkpoint
loadable, and training resumed from it matches uninterrupted training exactly.

Each child process trains a small MLP (with a frozen layer and a buffer that changes every step, so
both must be restored), saves at step K, trains one more step and saves again into the same
directory with ``HFZERO_CHECKPOINT_PAUSE_AT=<phase>``: the save stops at that phase and signals;
the test then SIGKILLs the child. The three children run concurrently.
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
from hfzero.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

K, STEPS = 3, 6
PHASES = ("rank_file_written", "manifest_written", "between_renames")


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


def child_main(ckpt: str, phase: str, signal_path: str) -> None:
    """Save at step K, then save again at K + 1 and get killed in the middle (run in a subprocess)."""
    model, opt = build()
    batches = data()
    train(model, opt, batches[:K])
    save_checkpoint(ckpt, model, opt, extra={"step": K})
    train(model, opt, batches[K:K + 1])
    os.environ.update(HFZERO_CHECKPOINT_PAUSE_AT=phase, HFZERO_CHECKPOINT_PAUSE_SIGNAL=signal_path)
    save_checkpoint(ckpt, model, opt, extra={"step": K + 1})
    sys.exit(3)  # not reached when the pause hook works


def _run_children(tmp_path: Path) -> dict[str, Path]:
    tests = str(Path(__file__).parent)
    children = {}
    for phase in PHASES:
        ckpt, sig = tmp_path / phase / "ckpt", tmp_path / f"{phase}.signal"
        code = (f"import sys; sys.path.insert(0, {tests!r}); import test_checkpoint_kill as t; "
                f"t.child_main({str(ckpt)!r}, {phase!r}, {str(sig)!r})")
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        children[phase] = (proc, Path(f"{sig}.rank0"), ckpt)
    deadline = time.monotonic() + 120
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
    return {phase: ckpt for phase, (_, _, ckpt) in children.items()}


def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path):
    killed = _run_children(tmp_path)
    model, opt = build()
    reference = train(model, opt, data())

    partial = killed["rank_file_written"].parent / ".ckpt.partial"
    assert partial.is_dir() and not (partial / "manifest.json").exists()
    with pytest.raises(CheckpointError, match="incomplete"):
        load_checkpoint(partial, *build())
    assert not killed["between_renames"].exists(), "the kill came between the two renames"

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
