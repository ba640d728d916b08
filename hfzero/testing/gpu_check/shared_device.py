"""Section: 2 and 4 gloo ranks sharing one device (cuda:0; NCCL refuses two ranks on one GPU, gloo moves
CUDA tensors for the data-parallel collectives).

- parity: stages 1-3 (fp32, one and two micro-batches) against the float64 run of matrix.py's plain AdamW
  loop, within its derived rounding bounds;
- host syncs (CUDA): ``torch.cuda.set_sync_debug_mode("warn")`` over steady-state steps, warnings counted
  here; stage 1 with 2 and 4 micro-batches per step (no_sync): more micro-batches must add no sync;
- prefetch trace: stage 3 with a prefetch budget below one decoder block (the next unit is prefetched
  whatever its size: units - 1 gathers ahead per pass, forward and backward, once the first step has
  recorded the order) and one of four blocks (prefetch happens), the same gathers per step;
- the offload copy stream (CUDA): stage 2 offloaded under ``TORCH_CUDA_SANITIZER=1``, which raises on an
  unsynchronized access between streams.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import torch

import hfzero
from hfzero.testing import run_distributed
from hfzero.testing.gpu_check.common import Checks, Options
from hfzero.testing.gpu_check.matrix import Case, compare, reference64, train
from hfzero.testing.models import micro_batches, tiny_causal_lm, token_batches
from hfzero.testing.offload import OffloadCase, train_case
from hfzero.testing.workloads import param_groups

SIZE = {"hidden": 32, "layers": 4, "vocab": 128}
STEPS, BATCH, SEQ = 3, 8, 16
PARITY = [Case(stage, "fp32", False, acc) for stage in (1, 2, 3) for acc in (1, 2)]


def _device(device: str) -> str:
    if device == "cuda":
        torch.cuda.set_device(0)
        return "cuda:0"
    return device


def parity_rank(rank: int, world: int, device: str, with_extras: bool, todo: list[Case]) -> dict[str, Any]:
    device = _device(device)
    out: dict[str, Any] = {}
    for case in todo:
        out[case.name] = train(case, SIZE, device, STEPS, BATCH, SEQ, rank, world)
    if with_extras:
        out["trace"] = {budget: trace(rank, world, device, budget) for budget in ("below_block", "four_blocks")}
        if device.startswith("cuda"):
            out["syncs"] = {micro: count_syncs(rank, world, device, micro) for micro in (2, 4)}
    return out


def trace(rank: int, world: int, device: str, budget: str) -> dict[str, Any]:
    """Stage 3 with the prefetch budget below one block or of four: gathers per step and per pass."""
    model = tiny_causal_lm("gpt2", **SIZE).to(device)
    block = sum(p.numel() for p in model.transformer.h[0].parameters())
    numel = block // 2 if budget == "below_block" else 4 * block
    config = hfzero.ZeroConfig(stage=3, param_persistence_threshold=0, allgather_bucket_size=numel)
    model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    engine = hfzero.get_engine(model)
    steps = []
    for tokens in token_batches(3, BATCH, SEQ, vocab=SIZE["vocab"]):
        events = engine.trace(True)
        before = engine.comm.stats().get("all_gather")
        mb = micro_batches(tokens.to(device), rank, world, 1)[0]
        optimizer.backward(model(input_ids=mb, labels=mb).loss)
        optimizer.step()
        optimizer.zero_grad()
        after = engine.comm.stats().get("all_gather")
        gathers = [name for kind, name in events if kind == "gather"]
        # a gather waited on right away was on demand; one waited on later was prefetched
        ahead = sum(1 for i, (kind, name) in enumerate(events) if kind == "gather"
                    and (i + 1 >= len(events) or events[i + 1] != ("wait", name)))
        steps.append({"gathers": len(gathers), "prefetched": ahead,
                      "all_gather_calls": (after.calls if after else 0) - (before.calls if before else 0)})
        engine.trace(False)
    return {"block_numel": block, "budget_numel": numel, "units": len(engine.units), "steps": steps}


def count_syncs(rank: int, world: int, device: str, micro: int) -> list[int]:
    """Host syncs per steady-state step (after one warm-up step): stage 1 fp32, ``micro`` micro-batches."""
    model = tiny_causal_lm("gpt2", **SIZE).to(device)
    model, optimizer = hfzero.prepare(model, torch.optim.AdamW(param_groups(model), lr=1e-3),
                                      hfzero.ZeroConfig(stage=1))
    per_step = []
    batches = [t.to(device) for t in token_batches(3, BATCH * micro // 2, SEQ, vocab=SIZE["vocab"])]
    for step, tokens in enumerate(batches):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if step > 0:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                parts = micro_batches(tokens, rank, world, micro)
                for index, mb in enumerate(parts):
                    deferred = optimizer.no_sync() if index < micro - 1 else contextlib.nullcontext()
                    with deferred:
                        optimizer.backward(model(input_ids=mb, labels=mb).loss / micro)
                optimizer.clip_grad_norm_(1.0)
                optimizer.step()
                optimizer.zero_grad()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        if step > 0:
            per_step.append(sum(1 for w in caught if "synchroniz" in str(w.message)))
    return per_step


def sanitized_offload(rank: int, world: int) -> dict[str, Any]:
    torch.cuda.set_device(0)
    result = train_case(rank, world, OffloadCase(2, accumulation=2, offload=True), "cuda:0")
    return {"losses": result["losses"], "offloaded": result["offloaded"], "copy_stream": result["copy_stream"]}


def run(options: Options, checks: Checks) -> dict[str, Any]:
    cuda = options.device == "cuda"
    worlds = (2,) if options.quick else (2, 4)
    todo = [c for c in PARITY if c.accumulation == 2] if options.quick else PARITY
    figures: dict[str, Any] = {"not_run": [] if cuda else ["host syncs (needs CUDA)", "CUDA sanitizer (needs CUDA)"]}
    run_splits = tuple(sorted({world * case.accumulation for world in worlds for case in todo}))  # ranks x micro
    ref64 = reference64(SIZE, _device(options.device), STEPS, BATCH, SEQ, run_splits)  # here: ranks return plain data
    for world in worlds:
        outs = checks.run(f"world {world}: ranks ran", run_distributed, parity_rank, world, options.device,
                          world == 2, todo, timeout=600)
        if outs is None:
            continue
        for case in todo:
            ok, detail = compare(case, outs[0][case.name], {}, ref64)  # fp32 cases: the float64 bounds only
            same = all(o[case.name]["losses"] == outs[0][case.name]["losses"] for o in outs)
            checks.add(f"world {world} {case.name} matches plain AdamW", ok and same, detail)
        if world != 2:
            continue
        below, ahead = outs[0]["trace"]["below_block"], outs[0]["trace"]["four_blocks"]
        figures["trace"] = {"below_block": below, "four_blocks": ahead}
        checks.add("prefetch: budget below one block still prefetches the next unit (units - 1 per pass)",
                   all(s["prefetched"] >= 2 * (below["units"] - 1) for s in below["steps"][1:]), below["steps"])
        checks.add("prefetch: a four-block budget prefetches", all(s["prefetched"] > 0 for s in ahead["steps"][1:]),
                   ahead["steps"])
        checks.add("prefetch: the same gathers per step either way (prefetch adds none)",
                   [s["gathers"] for s in below["steps"][1:]] == [s["gathers"] for s in ahead["steps"][1:]]
                   and [s["all_gather_calls"] for s in below["steps"][1:]] == [s["all_gather_calls"] for s in ahead["steps"][1:]],
                   {"below": below["steps"], "ahead": ahead["steps"]})
        if cuda:
            syncs = {micro: [o["syncs"][micro] for o in outs] for micro in (2, 4)}
            figures["host_syncs_per_step"] = syncs
            checks.add("host syncs: 4 micro-batches per step add none over 2 (none per micro-batch)",
                       all(a == b for r2, r4 in zip(syncs[2], syncs[4]) for a, b in zip(r2, r4)), syncs)
    if cuda:
        os.environ["TORCH_CUDA_SANITIZER"] = "1"  # read by torch at import in the spawned ranks
        try:
            outs = checks.run("offload under TORCH_CUDA_SANITIZER=1: no race reported", run_distributed,
                              sanitized_offload, 2, timeout=300)
        finally:
            os.environ.pop("TORCH_CUDA_SANITIZER")
        if outs is not None:
            checks.add("offload under TORCH_CUDA_SANITIZER=1: no race reported",
                       all(o["offloaded"] and o["copy_stream"] for o in outs), outs[0]["losses"])
    figures["summary"] = {k: v for k, v in figures.items() if k != "trace"}
    return figures
