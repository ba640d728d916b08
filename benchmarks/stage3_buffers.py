"""Stage 3's two unit-buffer backings side by side: step time and host peak (issue 33 item 1).

[Note: stage-3 gather buffers] (hfzero/runtime/stage3/buffers.py) gives each unit one storage for the engine's
lifetime, with memory only while gathered (``ZeroConfig.stage3_buffers``): "resized" (the default, on CUDA and the
host: the storage resized to 0 bytes and back, through the allocator) or "mapped" (opt-in on Linux CPU ranks: an
anonymous private mapping whose pages go back to the kernel with madvise at release, so no allocator call per
gather; each gather faults its pages in). This
runs the same stage-3 job with each, 2 gloo ranks, GPT-2 of 5.3M parameters (as tests/test_memory_flat.py),
every parameter partitioned (``param_persistence_threshold=0``), AdamW, ``--steps`` steps, each backing in a
fresh 2-rank spawn, in alternating order over ``--rounds`` rounds. Per rank 0 and run: the median step time after
the first ``--warm`` steps, the peak RSS (VmHWM) after step ``--warm`` and after the last (its growth is the heap
churn the mapped backing exists to stop) and the RSS between steps.

    python benchmarks/stage3_buffers.py [--steps 12] [--warm 3] [--rounds 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

import hfzero
from hfzero.runtime.stage3 import buffers
from hfzero.testing.models import tiny_causal_lm
from hfzero.testing.procmem import status
from hfzero.testing.spawn import run_distributed

KINDS = (buffers.MAPPED, buffers.RESIZED)
VOCAB = 8192


def _rank(rank: int, world: int, kind: str, steps: int, warm: int) -> dict[str, Any]:
    model = tiny_causal_lm("gpt2", hidden=256, layers=4, vocab=VOCAB, positions=128)  # 5.3M parameters
    config = hfzero.ZeroConfig(stage=3, param_persistence_threshold=0, stage3_buffers=kind)
    model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config)
    engine = hfzero.get_engine(model)
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # VmHWM := VmRSS now
    g = torch.Generator().manual_seed(rank)
    seconds, peaks, rss = [], [], []
    for _ in range(steps):
        batch = torch.randint(0, VOCAB, (2, 64), generator=g)  # (B, T) per rank
        start = time.perf_counter()
        optimizer.backward(model(input_ids=batch, labels=batch).loss)
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - start)
        peaks.append(status("VmHWM"))
        rss.append(status("VmRSS"))
    return {"kind": engine.gather_buffers.kind, "step_ms": 1e3 * statistics.median(seconds[warm:]),
            "peak_warm_mb": peaks[warm - 1] / 1e6, "peak_last_mb": peaks[-1] / 1e6, "rss_last_mb": rss[-1] / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warm", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", help="write every run's figures here")
    args = parser.parse_args()
    runs: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for kind in (KINDS if round_ % 2 == 0 else KINDS[::-1]):
            result = run_distributed(_rank, 2, kind, args.steps, args.warm, timeout=900)[0]
            assert result["kind"] == kind, (kind, result["kind"])
            runs.append(result)
    print(f"stage 3, GPT-2 5.3M, 2 gloo ranks, {args.steps} steps x {args.rounds} rounds (rank 0; medians over rounds)")
    print(f"{'backing':<9}{'step ms':>9}{'peak@warm MB':>14}{'peak@last MB':>14}{'growth':>8}{'RSS MB':>8}")
    for kind in KINDS:
        rows = [r for r in runs if r["kind"] == kind]

        def med(key: str) -> float:
            return statistics.median(r[key] for r in rows)

        growth = statistics.median(r["peak_last_mb"] / r["peak_warm_mb"] for r in rows)
        print(f"{kind:<9}{med('step_ms'):>9.1f}{med('peak_warm_mb'):>14.1f}{med('peak_last_mb'):>14.1f}"
              f"{growth:>8.3f}{med('rss_last_mb'):>8.1f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
