"""torch.compile with hfzero (docs/compile.md, [Note: compiled regions]): compiled training equals eager
training at stages 0-3, hfzero breaks no graph inside a decoder block, and nothing recompiles after warm-up.

One spawn (2 gloo ranks) runs every custom-loop case: a tiny GPT-2 (2 blocks, hidden 32), fp32, 4 steps of
2 micro-batches (the first under no_sync), gradient clipping at 0.5, several buckets, and at stage 3 every
parameter partitioned (persistence threshold 0: each block is gathered and released around its use). Each case trains once eagerly and once
compiled and compares every micro-batch loss and the final (whole) parameters within 1e-6. Compilation
uses the "aot_eager" backend (dynamo + AOTAutograd, the layers where graph breaks, guards and the
saved-for-backward tensors of stage 3's released parameters matter; inductor's code generation is not
what is tested), wrapped to count how often compiled graphs ran, so a case cannot pass by compiling
nothing. The Trainer case runs an unmodified Trainer script under `hfzero run --torch_compile`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hfzero.testing import run_distributed
from hfzero.testing.compiled import assert_trains_as_eagerly, counted_aot_eager

pytestmark = pytest.mark.slow

STEPS = 4
WARMUP = 2
ACCUMULATION = 2

# (name, stage, how, when, gradient checkpointing)
CASES = [
    ("stage0-whole-after", 0, "whole", "after", False),
    ("stage1-whole-before", 1, "whole", "before", False),
    ("stage2-regional-after", 2, "regional", "after", False),
    ("stage3-whole-after", 3, "whole", "after", False),
    ("stage3-regional-before-checkpointing", 3, "regional", "before", True),
]


def _train(rank: int, world: int, stage: int, how: str | None, when: str, checkpointing: bool,
           backend) -> dict:
    import torch._dynamo
    from torch._dynamo.utils import counters

    import hfzero
    from hfzero.runtime.compile import compile_regions
    from hfzero.testing.models import micro_batches, tiny_causal_lm, token_batches

    model = tiny_causal_lm("gpt2")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if how == "regional" and when == "before":
        compile_regions(model, backend=backend)
    if how == "whole" and when == "before":
        model = torch.compile(model, backend=backend)
    model, optimizer = hfzero.prepare(model, optimizer, hfzero.ZeroConfig(stage=stage, dtype="fp32", reduce_bucket_size=4096,
                                                                          param_persistence_threshold=0))
    forward = model
    if how == "regional" and when == "after":
        compile_regions(model, backend=backend)
    if how == "whole" and when == "after":
        forward = torch.compile(model, backend=backend)
    losses, warm, recompiled = [], 0, None
    try:
        for step, batch in enumerate(token_batches(STEPS, 8, 16)):
            if step == WARMUP:  # from here on a failing guard raises instead of recompiling
                warm = counters["stats"]["unique_graphs"]
                torch._dynamo.config.error_on_recompile = how is not None
            for micro, x in enumerate(micro_batches(batch, rank, world, ACCUMULATION)):
                sync = micro == ACCUMULATION - 1
                with model.no_sync() if not sync else torch.enable_grad():
                    loss = forward(input_ids=x, labels=x).loss / ACCUMULATION
                    loss.backward()
                losses.append(loss.item())
            optimizer.clip_grad_norm_(0.5)
            optimizer.step()
            optimizer.zero_grad()
    except torch._dynamo.exc.RecompileError as error:
        recompiled = str(error)
    finally:
        torch._dynamo.config.error_on_recompile = False
    state = hfzero.full_state_dict(model, rank0_only=False)
    params = {k.removeprefix("_orig_mod."): v for k, v in state.items()}
    return {"losses": losses, "params": params, "recompiled": recompiled,
            "new_graphs_after_warmup": counters["stats"]["unique_graphs"] - warm}


def _cases(rank: int, world: int) -> dict:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.config.recompile_limit = 64  # the cases share the cache: no case may hit the limit
    backend, calls = counted_aot_eager()  # aot_eager, counting forward graph runs
    out = {}
    for name, stage, how, when, checkpointing in CASES:
        eager = _train(rank, world, stage, None, when, checkpointing, backend)
        counters["graph_break"].clear()
        before = calls["graphs"]
        compiled = _train(rank, world, stage, how, when, checkpointing, backend)
        compiled["graph_calls"] = calls["graphs"] - before
        compiled["breaks"] = [reason.split("\n")[1] for reason, n in counters["graph_break"].items() for _ in range(n)]
        out[name] = {"eager": eager, "compiled": compiled}
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_cases, 2, timeout=900)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_compiled_training_equals_eager(results: list[dict], name: str) -> None:
    for rank, out in enumerate(results):
        eager, compiled = out[name]["eager"], out[name]["compiled"]
        _, stage, how, _, _ = next(c for c in CASES if c[0] == name)
        graphs = 1 if how == "whole" and stage < 3 else 2  # per micro-batch: the model's, or each block's
        assert_trains_as_eagerly(rank, eager, compiled, graphs * STEPS * ACCUMULATION)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_graph_breaks_only_at_unit_boundaries(results: list[dict], name: str) -> None:
    """No graph break inside a decoder block. Regional compilation and whole-model compilation at stages 0-2:
    no break at all. Whole-model at stage 3: only at the units' own forward hooks (gather / release, run
    eagerly at the start and end of each unit; the hooks on a unit's submodules stay traceable). With
    gradient checkpointing: also at the checkpoint call, which wraps the whole block body (transformers
    checkpoints inside the layer's forward) and runs the compiled body."""
    _, stage, how, _, checkpointing = next(c for c in CASES if c[0] == name)
    allowed = ["HfzeroCheckpoint.__call__"] if checkpointing else []
    if how == "whole" and stage == 3:
        allowed += ["UnitScheduler._hook_pre_forward", "UnitScheduler._hook_post_forward"]
    for rank, out in enumerate(results):
        breaks = out[name]["compiled"]["breaks"]
        # (how many depends on what dynamo already compiled for the earlier cases: they share its cache)
        assert all(any(a in b for a in allowed) for b in breaks), f"rank {rank}: {breaks}"


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_no_recompile_after_warmup(results: list[dict], name: str) -> None:
    for rank, out in enumerate(results):
        compiled = out[name]["compiled"]
        assert compiled["recompiled"] is None, f"rank {rank}: a guard failed after step {WARMUP}: {compiled['recompiled']}"
        assert compiled["new_graphs_after_warmup"] == 0, f"rank {rank}: new graphs after step {WARMUP}"


TRAINER_SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "llama_trainer.py")


def _trainer_args(out: Path) -> list[str]:
    return [TRAINER_SCRIPT, "--output_dir", str(out), "--max_steps", "3", "--per_device_train_batch_size", "2",
            "--gradient_accumulation_steps", "2", "--learning_rate", "1e-3", "--max_grad_norm", "0.5",
            "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true",
            "--seed", "0", "--zero_stage", "3", "--zero_param_persistence_threshold", "0"]


def test_trainer_torch_compile_under_hfzero_run_equals_eager(tmp_path: Path) -> None:
    """An unmodified Trainer script under `hfzero run --zero_stage 3 --torch_compile` (the Trainer's
    accelerator compiles the whole model, then ZeRO prepares it) logs the losses of the same run uncompiled."""
    from test_integration_common import assert_losses_match, hfzero_run, losses

    hfzero_run(2, _trainer_args(tmp_path / "eager"))
    hfzero_run(2, [*_trainer_args(tmp_path / "compiled"), "--torch_compile", "--torch_compile_backend", "aot_eager"])
    eager, compiled = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert len(eager) == 3
    assert_losses_match(compiled, eager, rel=1e-6)
