"""Every parameter's view in the flat buffers starts 16-byte aligned (see [Note: slot alignment] in
runtime/layout.py), at stages 0-3, fp32 and bf16, world 1 and 2, on a small BERT classifier and a
tiny GPT-2 with sizes chosen so that unpadded slots would fall off 16-byte boundaries; padding stays
zero through a training step.

Checked by address (``data_ptr() % 16``; on CPU, and on one CUDA device with NCCL when there is one): parameters as modules see them in forward (stage 3: the
gathered unit's views), and each parameter's range in the rank's master weights, optimizer states
and reduced gradients.
"""

from __future__ import annotations

import pytest
import torch

from hfzero import ZeroConfig, prepare
from hfzero.checkpoint.ranges import held_ranges
from hfzero.testing import run_distributed
from hfzero.testing.models import micro_batches, tiny_causal_lm, token_batches

VOCAB, SEQ, BATCH = 37, 8, 4
CASES = [(model, stage, dtype) for model in ("bert", "gpt2") for stage in (0, 1, 2, 3) for dtype in ("fp32", "bf16")]


def _model(kind: str) -> torch.nn.Module:
    if kind == "gpt2":
        return tiny_causal_lm("gpt2", hidden=12, layers=1, vocab=VOCAB, positions=SEQ + 1)
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=18, num_hidden_layers=1, num_attention_heads=3,
                        intermediate_size=37, max_position_embeddings=SEQ + 1, type_vocab_size=2, num_labels=3,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config).float()


def _misaligned(tensor: torch.Tensor, start: int) -> bool:
    return (tensor.data_ptr() + start * tensor.element_size()) % 16 != 0


def _check(rank: int, world: int, kind: str, stage: int, dtype: str, device: str) -> dict[str, object]:
    model = _model(kind).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    config = ZeroConfig(stage=stage, dtype=dtype, reduce_bucket_size=200, param_persistence_threshold=20)
    model, opt = prepare(model, opt, config)
    engine = opt.engine
    bad: set[str] = set()
    names = {p: n for n, p in model.named_parameters()}

    def record(module, args, kwargs):
        for p in module.parameters(recurse=False):
            if p.requires_grad and p.numel() > 0 and _misaligned(p, 0):
                bad.add(f"param {names[p]}")
    hooks = [m.register_forward_pre_hook(record, with_kwargs=True) for m in model.modules()]
    for batch in token_batches(1, BATCH, SEQ, vocab=VOCAB):
        mb = micro_batches(batch, rank, world, 1)[0].to(device)
        labels = mb if kind == "gpt2" else mb[:, 0] % 3
        opt.backward(model(input_ids=mb, labels=labels).loss)
        for r in held_ranges(engine.layout, engine.rank):
            bucket = engine.layout.buckets[r.bucket]
            if _misaligned(engine.reducer.owned_grad(bucket), r.view_start):
                bad.add(f"grad {r.name}[{r.start}:]")
        opt.step()
    for hook in hooks:
        hook.remove()
    padding_nonzero = 0
    for b, view in enumerate(engine.master_views):
        state = engine.optimizer.state[view]
        covered = torch.zeros(view.numel(), dtype=torch.bool)
        for r in held_ranges(engine.layout, engine.rank):
            if r.bucket != b:
                continue
            covered[r.view_start: r.view_start + r.numel] = True
            for what, flat in [("master", view), *((k, v) for k, v in state.items() if v.shape == view.shape)]:
                if _misaligned(flat, r.view_start):
                    bad.add(f"{what} {r.name}[{r.start}:]")
        for flat in [view, *(v for v in state.values() if v.shape == view.shape)]:
            padding_nonzero += int((flat.detach().float().cpu()[~covered] != 0).sum())
    layout = engine.layout
    return {"bad": sorted(bad), "padding_nonzero": padding_nonzero, "params": layout.num_params,
            "padded": layout.total_padded, "shard_world": layout.shard_world}


def _all_cases(rank: int, world: int, device: str) -> list[dict[str, object]]:
    return [_check(rank, world, *case, device) for case in CASES]


def _assert_aligned(results: list[list[dict[str, object]]]) -> None:
    for rank, per_case in enumerate(results):
        for case, result in zip(CASES, per_case):
            assert result["bad"] == [], f"rank {rank} {case}: {len(result['bad'])} unaligned: {result['bad'][:6]}"
            assert result["padding_nonzero"] == 0, f"rank {rank} {case}: padding elements became non-zero"
            # the padding is small: < ALIGN elements per parameter plus each bucket's tail
            assert result["padded"] - result["params"] < 0.2 * result["params"], (case, result)


@pytest.mark.parametrize("world", [1, 2])
def test_parameter_views_are_16_byte_aligned(world):
    _assert_aligned(run_distributed(_all_cases, world, "cpu"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA device (NCCL, world 1); the layout's offsets are checked on CPU above")
def test_parameter_views_are_16_byte_aligned_on_cuda():
    _assert_aligned(run_distributed(_all_cases, 1, "cuda", backend="nccl", timeout=600))
