"""Section: 2 and 4 gloo ranks sharing one device (cuda:0; NCCL refuses two ranks on one GPU, gloo moves
CUDA tensors for the data-parallel collectives).

- parity: stages 1-3 (fp32, one and two micro-batches) against the float64 run of matrix.py's plain AdamW
  loop, within its derived rounding bounds;
- host syncs by owner (hfzero/testing/host_syncs.py): stages 1-3 with 1 and 4 micro-batches per step
  (--quick: stage 3 with 1 and 2; no_sync), each synchronization charged to the Python frame that made it ([Note: host-sync
  attribution]); on CUDA torch's own reports under ``torch.cuda.set_sync_debug_mode("warn")`` decide, on
  CPU the census (the proxy). hfzero's own: at most one per step, none in the micro-batches before the
  last, none added by more micro-batches; a planted ``.item()`` must be counted once per step and charged
  to its caller (the counting is not blind). The model's (transformers' masking_utils, once per forward
  without a mask), the loop's and gloo's C++ threads' (stderr lines) are reported, not charged;
- prefetch trace: stage 3 with a prefetch budget below one decoder block (the next unit is prefetched
  whatever its size: units - 1 gathers ahead per pass, forward and backward, once the first step has
  recorded the order) and one of four blocks (prefetch happens), the same gathers per step;
- the offload copy stream (CUDA): stage 2 offloaded under ``TORCH_CUDA_SANITIZER=1``, which raises on an
  unsynchronized access between streams.
"""

from __future__ import annotations

import os
from typing import Any

import torch

import hfzero
from hfzero.testing import run_distributed
from hfzero.testing.gpu_check.common import Checks, Options
from hfzero.testing.gpu_check.matrix import Case, compare, reference64, train
from hfzero.testing.host_syncs import budget, measure_cases
from hfzero.testing.models import micro_batches, tiny_causal_lm, token_batches
from hfzero.testing.offload import OffloadCase, train_case

SIZE = {"hidden": 32, "layers": 4, "vocab": 128}
STEPS, BATCH, SEQ = 3, 8, 16
PARITY = [Case(stage, "fp32", False, acc) for stage in (1, 2, 3) for acc in (1, 2)]
SYNC_STEPS = 2


def sync_cases(quick: bool) -> list[tuple[int, int]]:
    """(stage, micro-batches per step) of the host-sync count: 1 and 4 (--quick: 2) micro-batches, so a
    per-micro-batch sync shows as a difference."""
    return [(stage, acc) for stage in ((3,) if quick else (1, 2, 3)) for acc in ((1, 2) if quick else (1, 4))]


def _device(device: str) -> str:
    if device == "cuda":
        torch.cuda.set_device(0)
        return "cuda:0"
    return device


def parity_rank(rank: int, world: int, device: str, with_extras: bool, todo: list[Case],
                syncs: list[tuple[int, int]]) -> dict[str, Any]:
    device = _device(device)
    out: dict[str, Any] = {}
    for case in todo:
        out[case.name] = train(case, SIZE, device, STEPS, BATCH, SEQ, rank, world)
    if with_extras:
        out["trace"] = {budget: trace(rank, world, device, budget) for budget in ("below_block", "four_blocks")}
        out["syncs"] = measure_cases(rank, world, syncs, SYNC_STEPS, 1, device,
                                     {"model_kind": "gpt2", "model_size": SIZE})
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


def sanitized_offload(rank: int, world: int) -> dict[str, Any]:
    torch.cuda.set_device(0)
    result = train_case(rank, world, OffloadCase(2, accumulation=2, offload=True), "cuda:0")
    return {"losses": result["losses"], "offloaded": result["offloaded"], "copy_stream": result["copy_stream"]}


def _sync_checks(checks: Checks, cases: list[tuple[int, int]], outs: list[dict[str, Any]], cuda: bool) -> dict:
    """The host-sync verdicts of every rank (torch's reports on CUDA, the census on CPU) and their figures."""
    counted = "cuda" if cuda else "proxy"
    figures: dict[str, Any] = {}
    for index, (stage, acc) in enumerate(cases):
        results = [o["syncs"][index] for o in outs]
        verdicts = [budget(r[counted], SYNC_STEPS) for r in results]
        checks.add(f"host syncs, stage {stage}, {acc} micro-batch(es): hfzero's <= 1 per step, none before the "
                   "last micro-batch, the planted probe charged to its caller",
                   all(ok for ok, _ in verdicts), next((d for ok, d in verdicts if not ok), verdicts[0][1]))
        row = {"by_owner_per_step": results[0][counted]["per_step_by_owner"],
               "hfzero_per_step": [r[counted]["hfzero_per_step"] for r in results],
               "proxy_hfzero_per_step": [r["proxy"]["hfzero_per_step"] for r in results]}
        if cuda:
            row["cpp_thread_lines_per_step"] = [r["cuda"]["cpp_thread_lines_per_step"] for r in results]
        figures[f"stage{stage}-acc{acc}"] = checks.figure(f"host syncs stage {stage} acc {acc}", row)
    for stage in sorted({s for s, _ in cases}):
        per = {acc: figures[f"stage{stage}-acc{acc}"]["hfzero_per_step"] for s, acc in cases if s == stage}
        most = max(per)
        checks.add(f"host syncs, stage {stage}: {most} micro-batches add none of hfzero's over 1", per[most] == per[1],
                   per)
    return figures


def run(options: Options, checks: Checks) -> dict[str, Any]:
    cuda = options.device == "cuda"
    worlds = (2,) if options.quick else (2, 4)
    todo = [c for c in PARITY if c.accumulation == 2] if options.quick else PARITY
    syncs = sync_cases(options.quick)
    figures: dict[str, Any] = {"not_run": [] if cuda else ["CUDA sanitizer (needs CUDA)"]}
    ref64 = reference64(SIZE, _device(options.device), STEPS, BATCH, SEQ)  # here: spawned ranks return plain data
    for world in worlds:
        cases = todo if world == 2 else [c for c in todo if c.accumulation == 2]
        outs = checks.run(f"world {world}: ranks ran", run_distributed, parity_rank, world, options.device,
                          world == 2, cases, syncs, timeout=900 if options.quick else 600)
        if outs is None:
            continue
        for case in cases:
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
        figures["host_syncs"] = _sync_checks(checks, syncs, outs, cuda)
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
