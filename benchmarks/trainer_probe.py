"""Runs a training script unchanged and records, per rank, its peak RSS and time up to the first optimizer step.

    torchrun ... benchmarks/trainer_probe.py SCRIPT [SCRIPT ARGS]       (or `python -m hfzero run ...` the same)

Used by benchmarks/load_trainer.py. ``TRAINER_PROBE_OUT`` names a directory; each rank writes
``rank<r>.json`` there, with (bytes, seconds since the process started):

- ``baseline_rss``: RSS after ``import torch, transformers`` (issue 20's post-import baseline);
- ``from_pretrained_peak``: the peak RSS while ``PreTrainedModel.from_pretrained`` runs (the last call);
- ``rss_at_train_begin`` / ``peak_at_train_begin``: RSS and the peak since the process started, when the
  first training step begins (a Trainer callback's ``on_step_begin``: the model is loaded and prepared);
- ``peak_to_first_step`` and ``seconds_to_first_step``: the peak since the process started and the time
  since it started, when the first optimizer step has ended (``on_step_end``);
- ``ran_out``: set (and the rank exits with status 3) if the host's available memory fell under
  ``TRAINER_PROBE_MIN_FREE_GIB`` (default 1.5) first: the phase it was in, so a run that does not fit is
  stopped before the kernel's OOM killer picks a process of someone else.

The script is not modified: the probe wraps ``from_pretrained`` and adds a callback to every ``Trainer``.
Linux only (/proc).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import threading
import time
from pathlib import Path


def _status(field: str, path: str = "/proc/self/status") -> int:
    with open(path, encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _since_start() -> float:
    """Seconds since this process started (its start time in /proc/self/stat)."""
    with open("/proc/self/stat", encoding="ascii") as f:
        started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    with open("/proc/uptime", encoding="ascii") as f:
        return float(f.read().split()[0]) - started


class _Peak:
    """The peak RSS since the process started, across resets of VmHWM (to measure one phase's peak)."""

    def __init__(self):
        self.before = 0

    def now(self) -> int:
        return max(self.before, _status("VmHWM"))

    def reset(self) -> None:
        self.before = self.now()
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")


RECORD: dict = {"phase": "import"}
PEAK = _Peak()
OUT = Path(os.environ["TRAINER_PROBE_OUT"])
RANK = int(os.environ.get("RANK", "0"))


def _write() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"rank{RANK}.json").write_text(json.dumps(RECORD, indent=1))


def _watch(min_free: int) -> None:
    while True:
        if _status("MemAvailable", "/proc/meminfo") < min_free:
            RECORD.update(ran_out=RECORD["phase"], peak_when_out=PEAK.now(), seconds_when_out=_since_start())
            _write()
            os._exit(3)
        time.sleep(0.1)


def main() -> None:
    min_free = int(float(os.environ.get("TRAINER_PROBE_MIN_FREE_GIB", "1.5")) * 2**30)
    threading.Thread(target=_watch, args=(min_free,), daemon=True).start()
    import torch  # noqa: F401
    import transformers
    from transformers import PreTrainedModel, TrainerCallback

    RECORD.update(baseline_rss=_status("VmRSS"), seconds_at_baseline=_since_start(), phase="script")
    load = PreTrainedModel.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        RECORD["phase"] = "from_pretrained"
        PEAK.reset()
        started = _since_start()
        try:
            return load(cls, *args, **kwargs)
        finally:
            RECORD.update(from_pretrained_peak=_status("VmHWM"), rss_after_from_pretrained=_status("VmRSS"),
                          from_pretrained_seconds=_since_start() - started, phase="setup (Trainer, prepare)")

    PreTrainedModel.from_pretrained = classmethod(from_pretrained)

    class Probe(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if "rss_at_train_begin" not in RECORD:
                RECORD.update(rss_at_train_begin=_status("VmRSS"), peak_at_train_begin=PEAK.now(),
                              seconds_at_train_begin=_since_start(), phase="first step")

        def on_step_end(self, args, state, control, **kwargs):
            if "seconds_to_first_step" not in RECORD:
                RECORD.update(peak_to_first_step=PEAK.now(), seconds_to_first_step=_since_start(), phase="after")
                _write()

    init = transformers.Trainer.__init__

    def trainer_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.add_callback(Probe())

    transformers.Trainer.__init__ = trainer_init
    script, *rest = sys.argv[1:]
    sys.argv = [script, *rest]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
