"""Stage 3: generate() on ranks that stop at different lengths does not hang (synced_gpus by default)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import hfzero
from hfzero.testing import run_distributed
from hfzero.testing.models import tiny_causal_lm


def _generate_uneven(rank: int, world: int) -> int:
    model = tiny_causal_lm("gpt2")
    model, _ = hfzero.prepare(model, torch.optim.AdamW(model.parameters()),
                              hfzero.ZeroConfig(stage=3, param_persistence_threshold=0))
    prompts = torch.randint(0, 100, (8, 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        first = model(input_ids=prompts).logits[:, -1].argmax(-1)  # the same on every rank
    i, j = next((i, j) for i in range(8) for j in range(8) if first[i] != first[j])
    mine = prompts[[i if rank == 0 else j]]
    # rank 0's first new token is its EOS, so it is done after one token; rank 1 goes on
    out = model.generate(mine, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=int(first[i]))
    dist.barrier()
    return out.shape[1]


def test_generate_with_uneven_lengths_finishes():
    lengths = run_distributed(_generate_uneven, 2, timeout=120)
    assert lengths[0] == 5 and lengths[1] == 10, lengths
