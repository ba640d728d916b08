"""Writes tests/data/checkpoint_v1/: checkpoints of the unaligned flat layout (before parameter slots
were aligned), for tests/test_alignment.py. Kept to show how the fixture was made; it was run once
with the code of commit 53d7cdb (``git archive 53d7cdb hfzero | tar -x -C OLD``, this repository's
hfzero/testing/states.py copied in, ``PYTHONPATH=OLD python tests/data/make_checkpoint_v1.py``):
running it on the aligned layout would not reproduce an unaligned fixture.

World 2, a tiny GPT-2 with odd sizes (so parameter offsets in the old layout are unaligned), trained
2 steps with AdamW and saved at stage 2 (fp32) and stage 3 (bf16); next to each checkpoint, and
alone for stage 0 (bf16, where each rank holds every bucket whole):
``expected.safetensors``, the master weights and optimizer states each parameter had when saved
(read from the engines' memory, not from the checkpoint), and ``optimizer-rank<r>.pt``, each rank's
``optimizer.state_dict()`` (state format 1; tensors and plain containers only, read with
``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from hfzero import ZeroConfig, prepare
from hfzero.checkpoint import save_checkpoint
from hfzero.testing import run_distributed
from hfzero.testing.models import micro_batches, tiny_causal_lm, token_batches
from hfzero.testing.states import held_states, merge_states

OUT = Path(__file__).parent / "checkpoint_v1"
MODEL = {"hidden": 4, "layers": 1, "vocab": 37, "positions": 9}
CASES = {"stage2": (2, "fp32", True), "stage3": (3, "bf16", True), "stage0": (0, "bf16", False)}
"""name: (stage, dtype, whether to save a hfzero checkpoint besides the optimizer state dicts)"""
BUCKET = 60
STEPS, BATCH, SEQ = 2, 4, 8


def build(stage: int, dtype: str, seed: int = 0, group=None):
    model = tiny_causal_lm("gpt2", seed=seed, **MODEL)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-2)
    return prepare(model, opt, ZeroConfig(stage=stage, dtype=dtype, reduce_bucket_size=BUCKET), process_group=group)


def _worker(rank: int, world: int) -> None:
    for name, (stage, dtype, checkpoint) in CASES.items():
        model, opt = build(stage, dtype)
        for batch in token_batches(STEPS, BATCH, SEQ, vocab=MODEL["vocab"]):
            mb = micro_batches(batch, rank, world, 1)[0]
            opt.backward(model(input_ids=mb, labels=mb).loss)
            opt.step()
        if checkpoint:
            save_checkpoint(OUT / name, model, opt)
        (OUT / name).mkdir(parents=True, exist_ok=True)
        torch.save(opt.state_dict(), OUT / name / f"optimizer-rank{rank}.pt")
        held = [None] * world
        dist.all_gather_object(held, held_states(opt.engine))
        if rank == 0:
            numels = {s.name: s.numel for s in opt.engine.layout.slots.values()}
            merged = merge_states(held, numels)
            save_file({f"{key}/{param}": t.contiguous() for param, values in merged.items() for key, t in values.items()},
                      str(OUT / name / "expected.safetensors"))
        dist.barrier()


if __name__ == "__main__":
    run_distributed(_worker, 2)
    sys.exit(0)
