"""Tiled MLP (runtime/activations/tiled_mlp.py, ZeroConfig mlp_tiles): one process, fp32 Llama. Loss and
gradients equal the untiled model's (1e-6) with and without activation checkpointing and through
hfzero.prepare; one slice's intermediate alive at a time in forward and in backward's recomputation; the
profiler's saved-tensor role drops by the MLP's intermediates; bad input refused. The sequence-parallel
composition (sp2 x dp2, stage 3, checkpoints through the host path) runs in tests/test_sequence_parallel.py.
"""

from __future__ import annotations

import weakref

import pytest
import torch

import hfzero
from hfzero.config import ConfigError
from hfzero.runtime.activations.tiled_mlp import enable_tiled_mlp, mlp_modules

VOCAB, HIDDEN, FFN, LAYERS = 128, 32, 96, 2


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).float().train()
    model.config.use_cache = False
    return model


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(3))  # 17: uneven tiles


def _grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = _ids()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_tiled_mlp_matches_the_untiled_model(checkpointing: bool) -> None:
    want_loss, want = _grads(_llama())
    model = _llama()
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert enable_tiled_mlp(model, 4) == LAYERS
    loss, got = _grads(model)
    torch.testing.assert_close(loss, want_loss, atol=1e-6, rtol=0)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=0, msg=name)
    with torch.no_grad():  # evaluation: the same logits, no checkpoint
        torch.testing.assert_close(model(input_ids=_ids()).logits, _llama()(input_ids=_ids()).logits, atol=1e-6, rtol=0)


def test_one_slice_alive_at_a_time() -> None:
    """The activation's output (one slice's intermediate) of the previous call is freed before the next call,
    in the forward (3 slices per layer) and in backward's recomputation (again 3 per layer, last slice first)."""
    model = _llama()
    enable_tiled_mlp(model, 3)
    calls: list[tuple[int, bool]] = []
    last: list[weakref.ref] = []

    def hook(module, args, output) -> None:
        calls.append((output.shape[1], all(ref() is None for ref in last)))
        last[:] = [weakref.ref(output)]

    for mlp in mlp_modules(model):
        mlp.act_fn.register_forward_hook(hook)
    ids = _ids()
    loss = model(input_ids=ids, labels=ids).loss
    forward = len(calls)
    loss.backward()
    assert forward == 3 * LAYERS and len(calls) == 6 * LAYERS  # every slice recomputed once
    assert sorted({size for size, _ in calls}) == [5, 6]  # 17 positions in slices of 6, 5, 6
    assert all(freed for _, freed in calls[1:])


def test_prepare_tiles_and_the_profiler_sees_no_intermediates(tmp_path) -> None:
    """Through hfzero.prepare(mlp_tiles=4): the same step as untiled (1e-6), and the profiler's saved-tensor role
    drops by the gated MLP's four saved (B, T, f) tensors per layer (gate, act, up, product: 4 x 4 bytes)."""
    from hfzero.profiler import ZeroProfiler, load_run

    ids, saved, params = _ids(), {}, {}
    for tiles in (1, 4):
        model = _llama()
        model, optimizer = hfzero.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0),
                                          hfzero.ZeroConfig(mlp_tiles=tiles))
        with ZeroProfiler(model, optimizer, tmp_path / str(tiles)):
            optimizer.backward(model(input_ids=ids, labels=ids).loss)
            optimizer.step()
        saved[tiles] = load_run(tmp_path / str(tiles)).ranks[0].of_kind("step")[0]["roles"]["activations"]
        params[tiles] = [p.detach().clone() for p in model.parameters()]
    assert saved[1] - saved[4] == LAYERS * 4 * 4 * ids.numel() * FFN
    for tiled, untiled in zip(params[4], params[1]):
        torch.testing.assert_close(tiled, untiled, atol=1e-6, rtol=0)


def test_bad_mlp_tiles_are_refused() -> None:
    with pytest.raises(ConfigError, match="mlp_tiles"):
        hfzero.ZeroConfig(mlp_tiles=0)
    model = _llama()
    with pytest.raises(ConfigError, match="integer >= 2"):
        enable_tiled_mlp(model, 1)
    enable_tiled_mlp(model, 2)
    with pytest.raises(ConfigError, match="tiled already"):
        enable_tiled_mlp(model, 2)
    with pytest.raises(ConfigError, match="tiled in 2"):
        hfzero.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0), hfzero.ZeroConfig(mlp_tiles=3))
    with pytest.raises(ConfigError, match="has none"):
        enable_tiled_mlp(torch.nn.Linear(2, 2), 2)
    from hfzero.testing.models import tiny_moe_lm

    with pytest.raises(ConfigError, match="mixture-of-experts"):
        enable_tiled_mlp(tiny_moe_lm(), 2)
