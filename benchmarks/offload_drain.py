"""How long the end-of-backward drain blocks against the folding work done (ZeRO-Offload, issue 19 item 4).

The offload path forced on CPU (world 1, synchronous copies, the fold thread as on a GPU), GPT-2 with
3.7M parameters, stage 2, 13 buckets, 6 steps: prints the folds' total time on the fold thread and the
time the training thread spent blocked in ``drain``. Run: ``PYTHONPATH=. python benchmarks/offload_drain.py``.
"""

from __future__ import annotations

import os
import time

import torch

os.environ["HFZERO_FORCE_HOST_OFFLOAD"] = "1"

import hfzero  # noqa: E402
from hfzero.testing.models import tiny_causal_lm, token_batches  # noqa: E402


def main() -> None:
    model = tiny_causal_lm("gpt2", hidden=256, layers=4, vocab=2048)
    model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      hfzero.ZeroConfig(stage=2, reduce_bucket_size=2**18, offload_optimizer=True))
    offload = hfzero.get_engine(model).offload
    drains, folds = [], []
    drain, fold = offload.drain, offload._fold

    def timed_drain() -> None:
        start = time.perf_counter()
        drain()
        drains.append(time.perf_counter() - start)

    def timed_fold(bucket, done) -> None:
        start = time.perf_counter()
        fold(bucket, done)
        folds.append(time.perf_counter() - start)

    offload.drain, offload._fold = timed_drain, timed_fold
    for batch in token_batches(6, 8, 64):
        batch = batch % 2048
        optimizer.backward(model(input_ids=batch, labels=batch).loss)
        optimizer.step()
        optimizer.zero_grad()
    print(f"fold work {sum(folds) * 1e3:.1f} ms over {len(folds)} folds; the training thread blocked "
          f"{sum(drains) * 1e3:.1f} ms in {len(drains)} drains")


if __name__ == "__main__":
    main()
