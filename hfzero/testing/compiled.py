"""A torch.compile backend for tests: aot_eager that counts how often its forward graphs run.

The compiled-vs-eager tests (tests/test_compile.py, tests/test_compile_parallel.py) use it to check that
compiled code actually ran (a count that stays 0 means dynamo fell back to eager). Holds no tensor memory.
"""

from __future__ import annotations

from typing import Any


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
