"""A torch.compile backend for tests: aot_eager that counts how often its forward graphs run, and the check
that a compiled run trained as the eager one did.

The compiled-vs-eager tests (tests/test_compile.py, tests/test_compile_parallel.py) use it to check that
compiled code actually ran (a count that stays 0 means dynamo fell back to eager). Holds no tensor memory.
"""

from __future__ import annotations

from typing import Any

import torch


def counted_aot_eager() -> tuple[Any, dict[str, int]]:
    """``(backend, calls)``: dynamo + AOT autograd with no code generation (``aot_eager``), whose forward
    graphs add 1 to ``calls["graphs"]`` each time they run."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    calls = {"graphs": 0}

    def counted(gm: Any, example_inputs: Any) -> Any:
        def run(args: Any) -> Any:
            calls["graphs"] += 1
            return gm(*args)
        run._boxed_call = True
        return run

    return aot_autograd(fw_compiler=counted, bw_compiler=boxed_nop), calls


def assert_trains_as_eagerly(rank: int, eager: dict, compiled: dict, min_graph_calls: int) -> None:
    """A compiled run (``compiled``: its ``losses``, final ``params`` by name, and ``graph_calls`` counted by
    ``counted_aot_eager``) ran compiled code at least ``min_graph_calls`` times and matches the eager run
    (``eager``) within 1e-6 in every loss and every parameter."""
    assert compiled["graph_calls"] >= min_graph_calls, f"rank {rank}: compiled code did not run"
    torch.testing.assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), atol=1e-6,
                               rtol=0, msg=lambda m: f"rank {rank} losses: {m}")
    assert sorted(compiled["params"]) == sorted(eager["params"])
    for key, value in eager["params"].items():
        torch.testing.assert_close(compiled["params"][key], value, atol=1e-6, rtol=0,
                                   msg=lambda m, key=key: f"rank {rank} parameter {key}: {m}")
