"""The engine's private torch entry points (hfzero/runtime/torch_api.py): found on the torch under test, and each
fallback forced on: training with an exception in a backward (or stage 3's forward), ``zero_grad()`` and more
steps gives what the private path gives (stages 0-3, world 1 in this process); a compile wrapper is still
recognized; a torch without the end-of-backward callback gets a clear error at the first backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hfzero
from hfzero.runtime import torch_api
from hfzero.runtime.compile import is_compiled
from hfzero.testing.models import tiny_causal_lm, token_batches
from test_engine_faults import STEPS, _train_with_fault


def test_the_private_entry_points_are_found_on_this_torch():
    """So the paths CI runs are the private ones; a torch that drops one shows up here, not as a silent fallback."""
    assert torch_api._graph_task_id is not None
    assert torch_api._queue_callback is not None
    assert torch_api._optimized_module is not None
    assert torch_api._has_base


def _force_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_api, "_graph_task_id", None)
    monkeypatch.setattr(torch_api, "_has_base", False)


@pytest.mark.parametrize("stage,where", [(0, "backward"), (2, "backward"), (3, "backward"),
                                         (3, "forward")])
def test_fallbacks_train_like_the_private_path(monkeypatch, stage, where):
    private = _train_with_fault(0, 1, stage, 2, where, False)
    _force_fallbacks(monkeypatch)
    assert torch_api.graph_task_id() == -1
    fallback = _train_with_fault(0, 1, stage, 2, where, False)
    assert private["raised"] == fallback["raised"] == 1
    assert len(fallback["losses"]) == STEPS - 1
    assert fallback["losses"] == private["losses"]
    for name, value in private["params"].items():
        torch.testing.assert_close(fallback["params"][name], value, atol=0, rtol=0, msg=name)


def test_compile_wrapper_fallback_recognizes_torch_compile(monkeypatch):
    model = nn.Sequential(nn.Linear(4, 4))
    compiled = torch.compile(model, backend="eager")  # wrapping compiles nothing until it is called
    assert torch_api.is_compile_wrapper(compiled) and not torch_api.is_compile_wrapper(model)
    monkeypatch.setattr(torch_api, "_optimized_module", None)
    assert torch_api.is_compile_wrapper(compiled) and not torch_api.is_compile_wrapper(model)
    assert is_compiled(nn.Sequential(compiled)) and not is_compiled(model)


def test_view_base_fallback_is_the_tensor_itself(monkeypatch):
    flat = torch.zeros(8)
    view = flat[:4]
    assert torch_api.view_base(view) is flat and torch_api.view_base(flat) is flat
    monkeypatch.setattr(torch_api, "_has_base", False)
    assert torch_api.view_base(view) is view


def test_no_backward_callback_is_a_clear_error(monkeypatch):
    model = tiny_causal_lm("gpt2")
    model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      hfzero.ZeroConfig(stage=2))
    monkeypatch.setattr(torch_api, "_queue_callback", None)
    (ids,) = token_batches(1, 2, 8)
    with pytest.raises(RuntimeError, match="no end-of-backward callback"):
        optimizer.backward(model(input_ids=ids, labels=ids).loss)
