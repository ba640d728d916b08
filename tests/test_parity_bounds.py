"""hfzero.testing.parity's float64 reference samples the rounding of the micro-batch splits its judged runs use.

A run that accumulates 2 micro-batches of a 4-row batch computes each 2-row micro-batch as one fp32 computation,
and a CPU's kernels can round a 2-row computation differently from a 1-row or a 4-row one (the GEMM blocking,
vector widths and reduction trees are picked per shape). ``_ShapeRoundedLM`` makes that difference large and
deterministic: its fp32 forward on exactly 2 rows perturbs the logits by 2^-12 relative (fixed signs), as a
kernel picked for that shape might, exaggerated; its 1-row, 4-row and float64 forwards are exact. A reference
that samples only the whole batch and one-row chunks does not see it; one told the run's split does.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from hfzero.testing.parity import ParityReference, float64_reference

VOCAB, HIDDEN, ROWS, SEQ, STEPS, LR, CLIP = 32, 16, 4, 8, 4, 1e-2, 0.25
SKEWED_ROWS = 2
"""The micro-batch shape whose fp32 computation carries the extra rounding: the judged run's (4 rows / 2)."""


class _ShapeRoundedLM(nn.Module):
    """A tiny causal LM (embedding, tanh layer, head) called as transformers' are: ``model(input_ids=,
    labels=).loss``, the loss in the model's dtype."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.hidden = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> types.SimpleNamespace:
        logits = self.head(torch.tanh(self.hidden(self.embed(input_ids))))  # (B, T, V)
        if logits.dtype == torch.float32 and input_ids.shape[0] == SKEWED_ROWS:
            signs = torch.randint(0, 2, logits.shape, generator=torch.Generator().manual_seed(1)) * 2 - 1
            logits = logits * (1 + 2.0**-12 * signs)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return types.SimpleNamespace(loss=loss)


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (ROWS, SEQ), generator=g) for _ in range(STEPS)]


def _reference(**splits) -> ParityReference:
    return float64_reference(_ShapeRoundedLM(), lambda model: torch.optim.AdamW(model.parameters(), lr=LR),
                             _batches(), CLIP, **splits)


def _accumulating_run(accumulation: int) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """fp32, ``accumulation`` micro-batches per step (loss / accumulation, backward each, the losses' sum),
    clipping, AdamW: per-step losses, gradient norms and final parameters."""
    model = _ShapeRoundedLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for ids in _batches():
        total = 0.0
        for micro in ids.chunk(accumulation):  # (B / A, T) each
            loss = model(input_ids=micro, labels=micro).loss / accumulation
            loss.backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_the_reference_samples_the_runs_micro_batch_split() -> None:
    losses, norms, params = _accumulating_run(ROWS // SKEWED_ROWS)
    ref = _reference(splits=ROWS, run_splits=(ROWS // SKEWED_ROWS,))
    assert min(ref.norms) > CLIP  # clipping acts at every step, so the norm's bound feeds every parameter's
    ref.check_losses(losses)
    ref.check_norms(norms)
    ref.check_params(params)
    # the run's error is one that the whole batch and one-row chunks (the finest split) do not sample
    blind = _reference(splits=ROWS)
    with pytest.raises(AssertionError, match="step 0: loss"):
        blind.check_losses(losses)
    with pytest.raises(AssertionError, match="over its rounding bound"):
        blind.check_params(params)


def test_unsplit_runs_and_bad_splits() -> None:
    """A run on the whole batch stays within the bounds of a reference told of no split, and splits that do not
    divide the batch, or a run split that is not a union of the finest split's chunks, are refused."""
    losses, norms, params = _accumulating_run(1)
    ref = _reference()
    ref.check_losses(losses)
    ref.check_norms(norms)
    ref.check_params(params)
    with pytest.raises(ValueError, match="divide"):
        _reference(run_splits=(3,))
    with pytest.raises(ValueError, match="unions"):
        _reference(splits=2, run_splits=(4,))
