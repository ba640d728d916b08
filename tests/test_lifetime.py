"""Engines are freed (issue 33 item 3): after ``del model, optimizer`` (and the Trainer, accelerator or Pipeline
that held them) the engine is collected and every byte it held is back, and ``hfzero.unprepare`` gives a plain
module back. See [Note: engine lifetime] in hfzero/runtime/lifetime.py.

Each case runs inside a spawned gloo world of 2 (several cases per spawn, one after another in the same process,
as a notebook or a sweep does) and is checked twice: a weak reference to its engine must be dead, and the live
memory must be what it was before the model was built (``hfzero.testing.lifetime``: on CPU a census of the
tensors the garbage collector sees, on CUDA ``memory_allocated`` too). Before the first case every module the cases
import is imported and each tiny model runs once, so third-party module-level constants created on first use
(peft's, torch.distributed.pipelining's) are in the baseline.

``ALLOWANCE``: torch keeps every DeviceMesh it builds in a registry of its own (a 2-element rank tensor, 8 bytes,
per mesh of the TP, EP and SP cases); anything of an engine is far larger (the smallest case's engine holds
~100 KB), so the allowance cannot hide a leak of one.
"""

from __future__ import annotations

import functools
import gc
import os
import tempfile
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch

from hfzero.testing import run_distributed

ALLOWANCE = 256
"""Bytes the live memory may grow by across a case: torch's DeviceMesh registry (see the module docstring)."""

WORLD = 2
STEPS = 2
SEQ = 8


_device = torch.device("cpu")
"""Where the plain cases place their models (a rank's GPU in the CUDA test)."""


# ---- the cases: each builds, trains and deletes, tracking its engine(s) in ``watch`` ------------------------------
def _train(model, optimizer, rank: int, world: int, steps: int = STEPS) -> list[float]:
    """``steps`` steps of the causal LM (``train_causal_lm``: 2 rows per rank); this rank's losses."""
    from hfzero.testing.models import train_causal_lm

    model.train()
    return train_causal_lm(model, optimizer, rank, world, steps, SEQ)


def _plain_case(stage: int, kind: str = "gpt2", **config: Any) -> Callable[..., None]:
    def case(rank: int, world: int, watch: Any) -> None:
        import hfzero
        from hfzero.testing.models import tiny_causal_lm

        model = tiny_causal_lm(kind).to(_device)
        model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                          hfzero.ZeroConfig(stage=stage, **config))
        watch.track(hfzero.get_engine(model))
        _train(model, optimizer, rank, world)
        del model, optimizer
    return case


def _offload(rank: int, world: int, watch: Any) -> None:
    """Stage 3 with the optimizer offloaded, the CPU path forced: the fold thread must not hold the engine."""
    from hfzero.runtime.offload import FORCE_ENV

    os.environ[FORCE_ENV] = "1"
    try:
        _plain_case(3, param_persistence_threshold=0, offload_optimizer=True)(rank, world, watch)
    finally:
        os.environ.pop(FORCE_ENV)


def _features(rank: int, world: int, watch: Any) -> None:
    """Stage 3 with checkpointing (hosted checkpoints forced), tiled MLPs, generate (synced) and a profiler left
    running: every hook and patch they install."""
    import hfzero
    from hfzero.runtime.activations.checkpoint import FORCE_ENV
    from hfzero.testing.models import tiny_causal_lm

    os.environ[FORCE_ENV] = "1"
    try:
        model = tiny_causal_lm("llama")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        config = hfzero.ZeroConfig(stage=3, param_persistence_threshold=0, mlp_tiles=2, cpu_checkpointing=True)
        model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
        watch.track(hfzero.get_engine(model))
        with tempfile.TemporaryDirectory() as run_dir:
            profiler = hfzero.ZeroProfiler(model, optimizer, run_dir).start()  # never stopped
            _train(model, optimizer, rank, world)
            model.eval()
            model.generate(torch.zeros(1, 4, dtype=torch.long), max_new_tokens=2, do_sample=False)
            del model, optimizer, profiler
    finally:
        os.environ.pop(FORCE_ENV)


def _async_save(rank: int, world: int, watch: Any) -> None:
    """Stage 2 with an asynchronous checkpoint save (its staging buffer, its thread), waited for."""
    import hfzero
    from hfzero.checkpoint.background import wait
    from hfzero.testing.models import tiny_causal_lm

    model = tiny_causal_lm()
    model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      hfzero.ZeroConfig(stage=2, async_save=True))
    watch.track(hfzero.get_engine(model))
    _train(model, optimizer, rank, world)
    with tempfile.TemporaryDirectory() as directory:
        target = _shared_dir(directory)
        hfzero.save_checkpoint(target, model, optimizer)
        _train(model, optimizer, rank, world)
        wait()
    del model, optimizer


def _shared_dir(directory: str) -> str:
    """One directory for every rank (rank 0's), for a collective save."""
    import torch.distributed as dist

    names = [directory]
    dist.broadcast_object_list(names, src=0)
    return os.path.join(names[0], "checkpoint")


def _tensor_parallel(rank: int, world: int, watch: Any) -> None:
    import hfzero
    from hfzero.parallel.tensor import prepare_tensor_parallel
    from hfzero.testing.models import tiny_causal_lm

    config = hfzero.ZeroConfig(stage=3, tp_size=2, param_persistence_threshold=0)
    model, optimizer, mesh = prepare_tensor_parallel(tiny_causal_lm("llama"), lambda p: torch.optim.AdamW(p, lr=1e-3),
                                                     config)
    watch.track(hfzero.get_engine(model))
    _train(model, optimizer, 0, 1)  # one dp replica: both TP ranks read the same rows
    del model, optimizer, mesh


def _sequence_parallel(rank: int, world: int, watch: Any) -> None:
    import hfzero
    from hfzero.parallel.sequence import prepare_sequence_parallel, split_batch
    from hfzero.testing.models import tiny_causal_lm, token_batches

    model = tiny_causal_lm("llama")
    config = hfzero.ZeroConfig(stage=3, sp_size=2, param_persistence_threshold=0, loss_tiles=2)
    model, optimizer, mesh = prepare_sequence_parallel(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    watch.track(hfzero.get_engine(model))
    for ids in token_batches(STEPS, 2, SEQ):
        model(**split_batch({"input_ids": ids}, mesh.sp_rank, mesh.sp_size)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    del model, optimizer, mesh


def _expert_parallel(rank: int, world: int, watch: Any) -> None:
    import hfzero
    from hfzero.parallel.expert import prepare_expert_parallel
    from hfzero.testing.models import tiny_moe_lm

    model, optimizer, mesh = prepare_expert_parallel(tiny_moe_lm(), lambda p: torch.optim.AdamW(p, lr=1e-3),
                                                     hfzero.ZeroConfig(stage=3, ep_size=2, param_persistence_threshold=0))
    watch.track(hfzero.get_engine(model))
    _train(model, optimizer, rank, world)
    del model, optimizer, mesh


def _pipeline(rank: int, world: int, watch: Any) -> None:
    import hfzero
    from hfzero.parallel.pipeline import PipelineConfig
    from hfzero.testing.models import tiny_causal_lm, token_batches

    model = tiny_causal_lm("llama")
    pipe = hfzero.pipeline(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                           hfzero.ZeroConfig(stage=3, param_persistence_threshold=0),
                           PipelineConfig(pp_size=2, n_microbatches=2))
    watch.track(pipe.engine)
    for ids in token_batches(STEPS, 4, SEQ):
        pipe.train_step(ids)
    del pipe, model


def _trainer(rank: int, world: int, watch: Any) -> None:
    import hfzero
    from hfzero.testing.models import tiny_causal_lm, token_batches

    rows = [{"input_ids": row, "labels": row} for batch in token_batches(STEPS, 2 * world, SEQ) for row in batch]
    with tempfile.TemporaryDirectory() as out:
        args = hfzero.ZeroTrainingArguments(output_dir=out, max_steps=STEPS, per_device_train_batch_size=2,
                                            report_to="none", disable_tqdm=True, save_strategy="no", use_cpu=True,
                                            logging_steps=1, zero_stage=3, zero_param_persistence_threshold=0)
        trainer = hfzero.ZeroTrainer(model=tiny_causal_lm(), args=args, train_dataset=rows)
        trainer.train()
        watch.track(hfzero.get_engine(trainer.model))
        del trainer, args


def _accelerator(free_memory: bool) -> Callable[..., None]:
    """ZeroAccelerator at stage 3: deleted with the model and optimizer, or kept after ``free_memory()``."""
    def case(rank: int, world: int, watch: Any) -> None:
        import hfzero
        from hfzero.integrations.accelerate import ZeroAccelerator
        from hfzero.testing.models import micro_batches, tiny_causal_lm, token_batches

        accelerator = ZeroAccelerator(zero_config=hfzero.ZeroConfig(stage=3, param_persistence_threshold=0), cpu=True)
        model = tiny_causal_lm()
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        watch.track(hfzero.get_engine(model))
        for batch in token_batches(STEPS, 2 * world, SEQ):
            (ids,) = micro_batches(batch, rank, world, 1)
            accelerator.backward(model(input_ids=ids, labels=ids).loss)
            optimizer.step()
            optimizer.zero_grad()
        if free_memory:
            accelerator.free_memory()
            del model, optimizer
            watch.kept = accelerator  # the accelerator outlives the check
        else:
            del accelerator, model, optimizer
    return case


CASES: dict[str, Callable[..., None]] = {
    **{f"stage{stage}": _plain_case(stage, param_persistence_threshold=0) for stage in range(4)},
    "stage1-bf16": _plain_case(1, dtype="bf16"),
    "stage3-persistent": _plain_case(3),  # every tiny parameter below the default threshold: kept whole
    "stage3-quantized": _plain_case(3, param_persistence_threshold=0, quantize_weights="int8",
                                    quantize_gradients="int8", quantize_error_feedback=True, ranks_per_node=1),
    "stage3-offload": _offload,
    "stage3-features": _features,
    "stage2-async-save": _async_save,
    "tensor-parallel": _tensor_parallel,
    "sequence-parallel": _sequence_parallel,
    "expert-parallel": _expert_parallel,
    "pipeline": _pipeline,
    "trainer": _trainer,
    "accelerator": _accelerator(free_memory=False),
    "accelerator-free-memory": _accelerator(free_memory=True),
}


def _warm_up(rank: int, world: int) -> None:
    """Import what the cases import and run each tiny model once (on a GPU too, where the first matmul allocates
    cuBLAS's workspace), so module-level constants and per-device workspaces are in the baseline."""
    import peft  # noqa: F401 - the Trainer imports it on first use
    import torch.distributed.pipelining  # noqa: F401

    import hfzero.integrations.accelerate  # noqa: F401
    import hfzero.integrations.trainer  # noqa: F401
    import hfzero.parallel.expert  # noqa: F401
    import hfzero.parallel.sequence  # noqa: F401
    from hfzero.testing.models import tiny_causal_lm, tiny_moe_lm

    for device in dict.fromkeys([torch.device("cpu"), _device]):
        ids = torch.zeros(1, SEQ, dtype=torch.long, device=device)
        for model in (tiny_causal_lm("gpt2"), tiny_causal_lm("llama"), tiny_moe_lm()):
            model.to(device)(input_ids=ids, labels=ids).loss.backward()
    del model, ids


def _run_cases(rank: int, world: int, names: list[str], device: str) -> dict[str, dict]:
    from hfzero.testing.lifetime import LifetimeWatch

    global _device
    _device = torch.device(device)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _warm_up(rank, world)
        out = {}
        for name in names:
            watch = LifetimeWatch(device)
            CASES[name](rank, world, watch)
            report = watch.check()
            out[name] = {"freed": report.freed(ALLOWANCE), "describe": report.describe(),
                         "tracked": report.engines_tracked, "alive": report.engines_alive,
                         "grown": report.after - report.before}
    return out


@functools.lru_cache(maxsize=None)
def _results() -> list[dict[str, dict]]:
    return run_distributed(_run_cases, WORLD, list(CASES), "cpu", timeout=1500)


@pytest.mark.parametrize("name", list(CASES))
def test_engine_is_collected_and_its_memory_returned(name: str) -> None:
    for rank, out in enumerate(_results()):
        got = out[name]
        assert got["tracked"] >= 1, f"rank {rank}: the case tracked no engine"
        assert got["freed"], f"rank {rank}: {got['describe']}"


# ---- unprepare --------------------------------------------------------------------------------------------------
RESTAGE = {0: 3, 1: 2, 2: 1, 3: 0}
"""The stage a model unprepared at each stage is prepared again at (each pair crosses the stage-3 boundary or the
sharded optimizer's)."""


def _snapshot(model: torch.nn.Module) -> dict[str, Any]:
    """What hfzero must leave as it found: each module's instance attributes and hooks, the parameters' hooks."""
    return {
        "attributes": {name: sorted(m.__dict__) for name, m in model.named_modules()},
        "hooks": {name: [len(getattr(m, table)) for table in ("_forward_hooks", "_forward_pre_hooks",
                                                              "_backward_hooks", "_state_dict_hooks")]
                  for name, m in model.named_modules()},
        "grad_hooks": sum(len(p._post_accumulate_grad_hooks or {}) + len(p._backward_hooks or {})
                          for p in model.parameters()),
        "attention": model.config._attn_implementation,
    }


def _unprepare_run(rank: int, world: int, stage: int) -> dict[str, Any]:
    import hfzero
    from hfzero.testing.lifetime import live_bytes
    from hfzero.testing.models import tiny_causal_lm, token_batches

    config = dict(param_persistence_threshold=0, mlp_tiles=2)
    model = tiny_causal_lm("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    user_function = model.model.layers[0]._gradient_checkpointing_func
    ids = token_batches(1, 2, SEQ)[0]
    before = _snapshot(model)
    baseline = live_bytes()  # the model's own parameters included
    model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      hfzero.ZeroConfig(stage=stage, **config))
    engine = weakref.ref(hfzero.get_engine(model))
    _train(model, optimizer, rank, world)
    model.eval()
    with torch.no_grad():
        prepared = model(input_ids=ids).logits
    plain = hfzero.unprepare(model, optimizer)
    out: dict[str, Any] = {"same_object": plain is model}
    with torch.no_grad():
        out["forward_equal"] = torch.equal(plain(input_ids=ids).logits, prepared)
    out["left_as_found"] = _snapshot(plain) == before
    out["checkpoint_function"] = all(m._gradient_checkpointing_func is user_function for m in plain.model.layers)
    out["own_memory"] = all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in plain.parameters())
    try:
        hfzero.get_engine(plain)
        out["engine_gone"] = False
    except ValueError:
        out["engine_gone"] = True
    try:
        optimizer.step()
        out["step_error"] = None
    except RuntimeError as error:
        out["step_error"] = str(error)
    del prepared
    out["grown_with_optimizer_alive"] = live_bytes() - baseline
    del optimizer
    out["engine_collected"] = engine() is None
    # trains again as a fresh model with the same weights does, at another stage
    weights = {k: v.clone() for k, v in plain.state_dict().items()}
    again = _retrain(plain, rank, world, RESTAGE[stage], config)
    fresh = tiny_causal_lm("llama", seed=1)
    fresh.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    fresh.load_state_dict(weights)
    out["retrained"] = again
    out["reference"] = _retrain(fresh, rank, world, RESTAGE[stage], config)
    return out


def _retrain(model: torch.nn.Module, rank: int, world: int, stage: int, config: dict) -> list[float]:
    import hfzero

    model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      hfzero.ZeroConfig(stage=stage, **config))
    return _train(model, optimizer, rank, world, steps=3)


def _unprepare_wrappers(rank: int, world: int) -> dict[str, Any]:
    """Stage 3 under tensor, sequence and pipeline parallelism, unprepared after a step."""
    import hfzero
    from hfzero.parallel.pipeline import PipelineConfig
    from hfzero.parallel.sequence import prepare_sequence_parallel, split_batch
    from hfzero.parallel.tensor import prepare_tensor_parallel
    from hfzero.testing.models import tiny_causal_lm, token_batches

    out: dict[str, Any] = {}
    ids = token_batches(1, 2, SEQ)[0]
    config = hfzero.ZeroConfig(stage=3, tp_size=2, param_persistence_threshold=0)
    model, optimizer, _ = prepare_tensor_parallel(tiny_causal_lm("llama"), lambda p: torch.optim.AdamW(p, lr=1e-3),
                                                  config)
    _train(model, optimizer, 0, 1)
    with torch.no_grad():
        prepared = model(input_ids=ids).logits
        plain = hfzero.unprepare(model, optimizer)
        out["tp_forward_equal"] = torch.equal(plain(input_ids=ids).logits, prepared)

    model = tiny_causal_lm("llama")
    before = _snapshot(model)
    config = hfzero.ZeroConfig(stage=3, sp_size=2, param_persistence_threshold=0, loss_tiles=2)
    model, optimizer, mesh = prepare_sequence_parallel(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    model(**split_batch({"input_ids": ids}, mesh.sp_rank, mesh.sp_size)).loss.backward()
    optimizer.step()
    plain = hfzero.unprepare(model, optimizer)
    out["sp_left_as_found"] = _snapshot(plain) == before  # attention, its hooks and the tiled loss undone
    with torch.no_grad():  # the whole sequence, without position_ids: plain attention again
        out["sp_loss"] = plain(input_ids=ids, labels=ids).loss.item()

    model = tiny_causal_lm("llama")
    pipe = hfzero.pipeline(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                           hfzero.ZeroConfig(stage=3, param_persistence_threshold=0),
                           PipelineConfig(pp_size=2, n_microbatches=2))
    pipe.train_step(token_batches(1, 4, SEQ)[0])
    stage = hfzero.unprepare(pipe.module, pipe.optimizer)
    out["pp_stage_whole"] = all(p.numel() > 0 and p.untyped_storage().nbytes() == p.numel() * p.element_size()
                                for p in stage.parameters())
    out["pp_plain"] = not [k for m in stage.modules() for k in m.__dict__ if k.startswith("hfzero")]
    return out


def _unprepare_all(rank: int, world: int) -> dict[Any, dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out: dict[Any, dict] = {stage: _unprepare_run(rank, world, stage) for stage in range(4)}
        out["wrappers"] = _unprepare_wrappers(rank, world)
        return out


@functools.lru_cache(maxsize=None)
def _unprepared() -> list[dict[Any, dict]]:
    return run_distributed(_unprepare_all, WORLD, timeout=1500)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_unprepare_gives_a_plain_module_back(stage: int) -> None:
    for rank, results in enumerate(_unprepared()):
        got = results[stage]
        assert got["same_object"] and got["engine_gone"], f"rank {rank}"
        assert got["forward_equal"], f"rank {rank}: the unprepared module's forward differs from the prepared one's"
        assert got["left_as_found"], f"rank {rank}: a hook or attribute of hfzero is left on the model"
        assert got["checkpoint_function"], f"rank {rank}: the layers did not get the user's checkpoint function back"
        assert got["own_memory"], f"rank {rank}: a parameter still views a flat buffer"
        assert got["step_error"] is not None and "unprepare" in got["step_error"], f"rank {rank}: {got['step_error']}"
        # the engine's buffers and the optimizer's states are freed while the model and optimizer still live
        assert got["grown_with_optimizer_alive"] <= ALLOWANCE, f"rank {rank}: {got['grown_with_optimizer_alive']} B"
        assert got["engine_collected"], f"rank {rank}: the engine outlived its optimizer"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_unprepared_model_prepares_and_trains_again(stage: int) -> None:
    for rank, results in enumerate(_unprepared()):
        got = results[stage]
        assert len(got["retrained"]) == 3
        assert got["retrained"] == got["reference"], f"rank {rank}: {got['retrained']} != {got['reference']}"


def test_unprepare_under_tensor_sequence_and_pipeline_parallelism() -> None:
    """TP keeps its DTensor parameters (the model's layout) and forwards as prepared; SP's attention, hooks and
    tiled loss are undone (a whole sequence runs plainly); a pipeline stage module comes back whole and plain."""
    for rank, results in enumerate(_unprepared()):
        got = results["wrappers"]
        assert got["tp_forward_equal"], f"rank {rank}"
        assert got["sp_left_as_found"], f"rank {rank}: sequence parallelism left something on the model"
        assert 0 < got["sp_loss"] < 10, f"rank {rank}: {got['sp_loss']}"
        assert got["pp_stage_whole"] and got["pp_plain"], f"rank {rank}"


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts this process's open descriptors in /proc")
def test_a_profiler_never_stopped_leaves_no_descriptor_open() -> None:
    """The profiler's allocator probe keeps /proc files open between samples; dropped without ``stop()`` (a
    profiled model deleted mid-run), it closes them when collected."""
    from hfzero.profiler.allocator import AllocatorProbe

    before = len(os.listdir("/proc/self/fd"))
    probe = AllocatorProbe(torch.device("cpu"))
    assert probe.sample()["rss"] > 0 and len(os.listdir("/proc/self/fd")) == before + 2
    del probe
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == before


# ---- CUDA: the same census on memory_allocated ------------------------------------------------------------------
CUDA_CASES = ["stage0", "stage1", "stage2", "stage3", "stage1-bf16", "stage3-offload"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < WORLD,
                    reason=f"needs {WORLD} CUDA devices (NCCL, one rank per GPU): checks memory_allocated after del; "
                           "the CPU census runs above")
@pytest.mark.parametrize("name", CUDA_CASES)
def test_engine_is_collected_and_device_memory_returned_on_cuda(name: str) -> None:
    for rank, out in enumerate(_results_cuda()):
        got = out[name]
        assert got["tracked"] >= 1 and got["freed"], f"rank {rank}: {got['describe']}"


@functools.lru_cache(maxsize=None)
def _results_cuda() -> list[dict[str, dict]]:
    return run_distributed(_run_cuda_cases, WORLD, CUDA_CASES, backend="nccl", timeout=900)


def _run_cuda_cases(rank: int, world: int, names: list[str]) -> dict[str, dict]:
    """The plain cases on this rank's GPU (the models built on the CPU and moved before prepare)."""
    torch.cuda.set_device(rank)
    return _run_cases(rank, world, names, f"cuda:{rank}")
