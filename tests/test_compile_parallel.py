"""torch.compile with pipeline and tensor parallelism (docs/compile.md): ``hfzero.compile_regions(pipe.module)``
after ``hfzero.pipeline`` trains as eagerly, with no graph break and no recompile; compiling tensor-parallel
(DTensor) blocks is refused with a ConfigError, in either order.

One spawn (2 gloo ranks) runs every case: a tiny Llama (2 blocks, hidden 32), fp32, 3 steps, clipping at 0.5.
Pipeline: pp=2 x dp=1 at ZeRO stages 1 and 3 (stage 3 with every parameter partitioned and gathered per
micro-batch: stage3_gather="micro"), 1F1B over 2 micro-batches, the block of each rank's stage compiled;
trained once eagerly and once compiled, every loss and every final (whole) parameter agree within 1e-6. The
backend is "aot_eager" (dynamo + AOTAutograd: the layers where guards, graph breaks and the pipeline's
autograd matter), wrapped to count compiled forward runs so the case cannot pass by compiling nothing;
inductor's code generation is not what is tested and would cost minutes of compilation on 2 CPU cores.
TP (tp=2 x dp=1), which depends on torch (``TP_COMPILE_TORCH``): from torch 2.14, ``compile_regions`` after
``prepare_tensor_parallel`` and before it, and ``torch.compile`` of the whole prepared model (stage 1; stage 3:
whole, and regions compiled before), train as eagerly (every loss and every parameter within 1e-6, compiled
code counted as run); compiling through a ZeroAccelerator with tp_size=2 and a dynamo backend (the Trainer's
`--torch_compile`) is not built and is refused, and so is a ``torch.compile`` wrapper given to
``prepare_tensor_parallel``, on every torch. Before 2.14 all of these are refused (checked on a newer torch
too, with the version gate forced off in the worker), and torch itself fails on the prepared model compiled
anyway (dynamo cannot fake DTensor parameters whose local shards live in hfzero's flat buffer; see TP_REFUSAL):
that canary runs only where torch is older than 2.14 (not in CI, whose torch is 2.14.1 and whose floor run
cannot build this TP model under transformers 5.17).
"""

from __future__ import annotations

import pytest
import torch

from hfzero.runtime.compile import tensor_parallel_compiles
from hfzero.testing import run_distributed
from hfzero.testing.compiled import assert_trains_as_eagerly, counted_aot_eager

pytestmark = pytest.mark.slow

STEPS = 3
WARMUP = 2
CLIP = 0.5
CASES = {"pp2-stage1": 1, "pp2-stage3": 3}  # name: ZeRO stage
TP_ORDERS = ["after", "before"]
TP_CASES = {"tp-after": (1, "after"), "tp-before": (1, "before"), "tp-whole": (1, "whole"),
            "tp-stage3-whole": (3, "whole"), "tp-stage3-before": (3, "before")}  # name: (ZeRO stage, how the model is compiled)
TP_COMPILES = tensor_parallel_compiles()


def _prepare_tp(model: torch.nn.Module, stage: int = 1):
    """``prepare_tensor_parallel`` of ``model`` at tp=2 x dp=1, ZeRO ``stage``, fp32, every parameter partitioned
    at stage 3; returns (model, optimizer)."""
    import hfzero
    from hfzero.parallel.tensor import prepare_tensor_parallel

    model, optimizer, _ = prepare_tensor_parallel(
        model, lambda params: torch.optim.AdamW(params, lr=1e-2),
        hfzero.ZeroConfig(stage=stage, tp_size=2, dtype="fp32", param_persistence_threshold=0))
    return model, optimizer


def _tp_refusal(order: str, torch_too: bool) -> dict:
    """The ConfigError of compiling a tp=2 model's blocks ``order`` prepare_tensor_parallel (or None); "after"
    with ``torch_too``, also what torch itself does with the prepared model compiled anyway (why hfzero refuses
    before torch 2.14: None if it ran)."""
    import hfzero
    from hfzero.testing.models import tiny_causal_lm

    model, refusal, torch_error = tiny_causal_lm("llama"), None, None
    try:
        if order == "before":
            hfzero.compile_regions(model, backend="aot_eager")
        model, _ = _prepare_tp(model)
        hfzero.compile_regions(model, backend="aot_eager")
    except hfzero.ConfigError as error:
        refusal = str(error)
    if order == "after" and torch_too:
        ids = torch.randint(0, 128, (2, 8))
        try:
            torch.compile(model, backend="aot_eager")(input_ids=ids, labels=ids).loss.backward()
        except Exception as error:  # noqa: BLE001 - recorded: the test checks it is dynamo's fake-tensor failure
            torch_error = str(error)
    return {"refusal": refusal, "torch_error": torch_error}


def _tp_train(stage: int, how: str, backend) -> dict:
    """A tp=2 model trained STEPS steps: eagerly (``backend`` None), or compiled ``how``: "after" / "before"
    (``compile_regions`` after or before ``prepare_tensor_parallel``), "whole" (``torch.compile`` of the prepared
    model). Returns the losses and every parameter whole (gathered over tp, and over dp at stage 3)."""
    import hfzero
    from hfzero.testing.models import tiny_causal_lm, token_batches

    model = tiny_causal_lm("llama")
    if backend is not None and how == "before":
        hfzero.compile_regions(model, backend=backend)
    model, optimizer = _prepare_tp(model, stage)
    forward = model
    if backend is not None and how == "after":
        hfzero.compile_regions(model, backend=backend)
    elif backend is not None and how == "whole":
        forward = torch.compile(model, backend=backend)
    losses = []
    for batch in token_batches(STEPS, 4, 16):
        loss = forward(input_ids=batch, labels=batch).loss
        optimizer.backward(loss)
        optimizer.clip_grad_norm_(CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    params = {k: v.clone() for k, v in hfzero.full_state_dict(model, rank0_only=False).items()}
    return {"losses": losses, "params": params}


def _pp(rank: int, stage: int, backend):
    import hfzero
    from hfzero.testing.models import tiny_causal_lm
    from hfzero.testing.pipeline import stage_params

    model = tiny_causal_lm("llama")
    config = hfzero.ZeroConfig(stage=stage, dtype="fp32", param_persistence_threshold=0)
    pipe = hfzero.pipeline(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config, pp_size=2,
                           schedule="1F1B", n_microbatches=2, stage3_gather="micro")
    if backend is not None:
        hfzero.compile_regions(pipe.module, backend=backend)

    def step(batch: torch.Tensor) -> float:
        loss = pipe.forward_backward(batch)
        pipe.clip_grad_norm_(CLIP)
        pipe.optimizer.step()
        pipe.optimizer.zero_grad()
        return loss

    return step, lambda: stage_params(pipe)


def _train(rank: int, stage: int, backend) -> dict:
    import torch._dynamo
    from torch._dynamo.utils import counters

    from hfzero.testing.models import token_batches

    step, params = _pp(rank, stage, backend)
    losses, warm, recompiled = [], 0, None
    try:
        for index, batch in enumerate(token_batches(STEPS, 4, 16)):
            if index == WARMUP:  # from here on a failing guard raises instead of recompiling
                warm = counters["stats"]["unique_graphs"]
                torch._dynamo.config.error_on_recompile = backend is not None
            losses.append(step(batch))
    except torch._dynamo.exc.RecompileError as error:
        recompiled = str(error)
    finally:
        torch._dynamo.config.error_on_recompile = False
    return {"losses": losses, "params": params(), "recompiled": recompiled,
            "new_graphs_after_warmup": counters["stats"]["unique_graphs"] - warm}


def _cases(rank: int, world: int) -> dict:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.config.recompile_limit = 64  # the cases share the cache: no case may hit the limit
    backend, calls = counted_aot_eager()  # aot_eager, counting forward graph runs
    out = {}
    for name, stage in CASES.items():
        eager = _train(rank, stage, None)
        counters["graph_break"].clear()
        before = calls["graphs"]
        compiled = _train(rank, stage, backend)
        compiled["graph_calls"] = calls["graphs"] - before
        compiled["breaks"] = [reason.split("\n")[0] for reason, n in counters["graph_break"].items() for _ in range(n)]
        out[name] = {"eager": eager, "compiled": compiled}
    if TP_COMPILES:
        for name, (stage, how) in TP_CASES.items():
            eager = _tp_train(stage, how, None)
            before = calls["graphs"]
            compiled = _tp_train(stage, how, backend)
            compiled["graph_calls"] = calls["graphs"] - before
            out[name] = {"eager": eager, "compiled": compiled}
    import hfzero.runtime.compile as compile_module

    gate = compile_module.tensor_parallel_compiles
    if TP_COMPILES:  # this worker only: hfzero's refusals as on a torch before 2.14
        compile_module.tensor_parallel_compiles = lambda version=None: False
    try:
        for order in TP_ORDERS:
            out[f"refusal-{order}"] = _tp_refusal(order, torch_too=not TP_COMPILES)
    finally:
        compile_module.tensor_parallel_compiles = gate
    out["tp-wrapper"] = _wrapper_refusal()
    out["tp-accelerate"] = _accelerate_refusal()  # last: it creates accelerate's process-wide state
    return out


def _wrapper_refusal() -> dict:
    """``prepare_tensor_parallel`` given a ``torch.compile`` wrapper (whose layers the TP plan cannot name: torch
    would skip every plan entry with a warning and the model would train unsharded): refused on every torch."""
    import hfzero
    from hfzero.testing.models import tiny_causal_lm

    try:
        _prepare_tp(torch.compile(tiny_causal_lm("llama"), backend="aot_eager"))
    except hfzero.ConfigError as error:
        return {"refusal": str(error)}
    return {"refusal": None}


def _accelerate_refusal() -> dict:
    """ZeroAccelerator (the Trainer's `--torch_compile` path) with tp_size=2 and a dynamo backend: refused."""
    import hfzero
    from hfzero.integrations.accelerate import ZeroAccelerator

    try:
        ZeroAccelerator(zero_config=hfzero.ZeroConfig(stage=1, tp_size=2), dynamo_backend="aot_eager", cpu=True)
    except hfzero.ConfigError as error:
        return {"refusal": str(error)}
    return {"refusal": None}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_cases, 2, timeout=600)


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_training_equals_eager(results: list[dict], name: str) -> None:
    for rank, out in enumerate(results):
        # per step: this rank's 1 block, once per micro-batch (pp=2, 2 micro-batches)
        assert len(out[name]["eager"]["losses"]) == STEPS
        assert_trains_as_eagerly(rank, out[name]["eager"], out[name]["compiled"], 2 * STEPS)


@pytest.mark.parametrize("name", list(CASES))
def test_no_graph_break_and_no_recompile_after_warmup(results: list[dict], name: str) -> None:
    for rank, out in enumerate(results):
        compiled = out[name]["compiled"]
        assert compiled["breaks"] == [], f"rank {rank}: graph breaks {compiled['breaks']}"
        assert compiled["recompiled"] is None, \
            f"rank {rank}: a guard failed after step {WARMUP}: {compiled['recompiled']}"
        assert compiled["new_graphs_after_warmup"] == 0, f"rank {rank}: new graphs after step {WARMUP}"


@pytest.mark.skipif(not TP_COMPILES, reason=f"torch {torch.__version__} cannot compile hfzero's tensor-parallel "
                    "blocks (TP_COMPILE_TORCH); the refusal is tested instead")
@pytest.mark.parametrize("name", list(TP_CASES))
def test_compiled_tensor_parallel_equals_eager(results: list[dict], name: str) -> None:
    blocks = 1 if TP_CASES[name][1] == "whole" else 2  # per step: the model's graph, or each of the 2 blocks'
    for rank, out in enumerate(results):
        assert len(out[name]["eager"]["losses"]) == STEPS
        assert_trains_as_eagerly(rank, out[name]["eager"], out[name]["compiled"], blocks * STEPS)


@pytest.mark.parametrize("order", TP_ORDERS)
def test_compiling_tensor_parallel_blocks_is_refused(results: list[dict], order: str) -> None:
    """Before torch 2.14 (on a newer torch: with the version gate forced off in the worker)."""
    for rank, out in enumerate(results):
        error = out[f"refusal-{order}"]["refusal"]
        assert error is not None, f"rank {rank}: compiling TP blocks {order} prepare was not refused"
        assert "needs torch>=2.14" in error and "train tensor parallelism eagerly" in error, error


def test_a_compiled_wrapper_is_refused_on_every_torch(results: list[dict]) -> None:
    for rank, out in enumerate(results):
        error = out["tp-wrapper"]["refusal"]
        assert error is not None and "torch.compile wrapper" in error and "compile after" in error, \
            f"rank {rank}: {error}"


def test_the_accelerator_refuses_tensor_parallel_with_a_dynamo_backend(results: list[dict]) -> None:
    """The Trainer's `--torch_compile` with tp_size > 1: refused on every torch, saying what to do instead."""
    wanted = "compile_regions(model) before prepare_tensor_parallel" if TP_COMPILES else "needs torch>=2.14"
    for rank, out in enumerate(results):
        error = out["tp-accelerate"]["refusal"]
        assert error is not None and wanted in error, f"rank {rank}: {error}"


@pytest.mark.skipif(TP_COMPILES, reason=f"torch {torch.__version__} compiles hfzero's tensor-parallel blocks")
def test_torch_before_2_14_fails_on_hfzero_dtensor_parameters(results: list[dict]) -> None:
    """Why TP is refused before torch 2.14: the prepared TP model compiled anyway fails in dynamo."""
    for rank, out in enumerate(results):
        error = out["refusal-after"]["torch_error"]
        assert error is not None and "different device" in error, f"rank {rank}: {error}"


def test_tensor_parallel_compiles_from_torch_2_14() -> None:
    assert not tensor_parallel_compiles("2.13.0+cpu") and not tensor_parallel_compiles("2.10.0a0+git1234")
    assert tensor_parallel_compiles("2.14.1+cu130") and tensor_parallel_compiles("3.0.0")
    assert tensor_parallel_compiles("unknown")  # an unreadable version is taken as new enough
