"""Per-rank host memory (RSS) the Trainer saves under pipeline parallelism by freeing, in the HF model it
built, the parameters and buffers of the stages other ranks run (``Pipeline.release_other_stages``).

pp=2 x dp=1 on 2 gloo ranks (one spawn): each rank builds the whole Llama (fp32), splits it with
``hfzero.pipeline`` (ZeRO-2 over its dp group of 1), then measures its resident set size before and after the
release, and runs one training step after it (it still trains). Usage:

    python benchmarks/pipeline_release.py [--hidden 512] [--layers 8]
"""

from __future__ import annotations

import argparse
import gc
import os

import torch

import hfzero
from hfzero.parallel.pipeline import PipelineConfig, pipeline
from hfzero.testing import run_distributed
from hfzero.testing.models import tiny_causal_lm, token_batches


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _measure(rank: int, world: int, hidden: int, layers: int) -> dict:
    model = tiny_causal_lm("llama", hidden=hidden, layers=layers)
    whole = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    pipe = pipeline(model, torch.optim.AdamW(model.parameters(), lr=1e-4), hfzero.ZeroConfig(stage=2),
                    PipelineConfig(pp_size=2, n_microbatches=2))
    gc.collect()
    before = _rss_bytes()
    freed = pipe.release_other_stages(model)
    gc.collect()
    after = _rss_bytes()
    batch = next(iter(token_batches(1, 4, 16)))
    loss = pipe.train_step(batch)
    return {"pp_rank": pipe.mesh.pp_rank, "model_bytes": whole, "freed_bytes": freed, "rss_before": before,
            "rss_after": after, "loss": loss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    rows = run_distributed(_measure, 2, args.hidden, args.layers, timeout=1200)
    mib = 1 << 20
    print(f"pp=2 x dp=1, Llama hidden {args.hidden}, {args.layers} blocks, fp32, ZeRO-2; whole model "
          f"{rows[0]['model_bytes'] / mib:.1f} MiB on every rank before the release")
    print("| pp rank | tensors freed (MiB) | RSS before (MiB) | RSS after (MiB) | RSS saved (MiB) | after / before |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['pp_rank']} | {r['freed_bytes'] / mib:.1f} | {r['rss_before'] / mib:.1f} | "
              f"{r['rss_after'] / mib:.1f} | {(r['rss_before'] - r['rss_after']) / mib:.1f} | "
              f"{r['rss_after'] / r['rss_before']:.3f} |")


if __name__ == "__main__":
    main()
