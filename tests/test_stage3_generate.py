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


def _encoder_decoder(rank: int, world: int) -> dict:
    import copy

    from hfzero.testing.models import tiny_seq2seq

    reference = tiny_seq2seq()
    model = copy.deepcopy(reference)
    model, _ = hfzero.prepare(model, torch.optim.AdamW(model.parameters()),
                              hfzero.ZeroConfig(stage=3, param_persistence_threshold=0))
    engine = hfzero.get_engine(model)
    units = [u.name for u in engine.units]
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        hidden = model.get_encoder()(input_ids=ids).last_hidden_state  # the encoder alone: root + encoder units
        want_hidden = reference.get_encoder()(input_ids=ids).last_hidden_state
        logits = model.lm_head(hidden)  # lm_head alone (root unit)
        want_logits = reference.lm_head(want_hidden)
    out = model.generate(ids, max_new_tokens=5, do_sample=False, num_beams=1)
    want = reference.generate(ids, max_new_tokens=5, do_sample=False, num_beams=1)
    sharded = all(u.state.value == "sharded" for u in engine.units)
    return {"units": units, "hidden": (hidden - want_hidden).abs().max(), "logits": (logits - want_logits).abs().max(),
            "ids": out, "want": want, "sharded": sharded}


def test_encoder_decoder_submodules_and_generate_at_stage3():
    """get_encoder()(...), lm_head alone and generate() gather their units on demand (BART, every tensor
    partitioned); the encoder blocks are units of their own; generated ids equal the unsharded model's."""
    for result in run_distributed(_encoder_decoder, 2, timeout=300):
        assert "model.encoder.layers.0" in result["units"] and "model.decoder.layers.1" in result["units"]
        assert result["hidden"] < 1e-5 and result["logits"] < 1e-5
        assert torch.equal(result["ids"], result["want"]), (result["ids"], result["want"])
        assert result["sharded"]
