"""Section: world-1 matrix on the device's own backend (NCCL on CUDA, gloo on CPU). Stages 0-3 x
fp32/bf16/fp16 x optimizer offload on/off x 1 or 2 micro-batches per step, each against a plain
single-device AdamW loop on the same model, batches and device: per-step losses and final parameters.
Tolerances: fp32 within the rounding bounds derived against a float64 run of the loop on the same device
(hfzero/testing/parity.py, micro-batch splits included; a fixed 1e-5 against an fp32 loop held for one
reduction order and not another's), each row reporting the share of the bound it used; 16-bit against the
fp32 loop, losses 5e-2, parameters 2e-2 (+2e-2 relative), as tests/test_parity.py. On CPU the offload path
is forced (runtime/offload.py's FORCE_ENV)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any

import torch
import torch.distributed

import hfzero
from hfzero.runtime.offload import FORCE_ENV
from hfzero.testing.gpu_check.common import Checks, Options, close, in_process_group
from hfzero.testing.models import micro_batches, tiny_causal_lm, token_batches
from hfzero.testing.parity import ParityReference, float64_reference
from hfzero.testing.workloads import param_groups

LR, CLIP = 1e-3, 1.0


@dataclasses.dataclass(frozen=True)
class Case:
    stage: int
    dtype: str
    offload: bool
    accumulation: int

    @property
    def name(self) -> str:
        return f"stage{self.stage}-{self.dtype}-{'offload' if self.offload else 'device'}-acc{self.accumulation}"


def cases(quick: bool = False) -> list[Case]:
    """All 48 cases; ``quick``: 12 of them, every stage with each dtype once, offload and accumulation mixed."""
    if quick:
        return [Case(s, d, o, a) for s in (0, 1, 2, 3) for d, o, a in (("fp32", False, 2), ("bf16", True, 1),
                                                                         ("fp16", True, 2))]
    return [Case(s, d, o, a) for s in (0, 1, 2, 3) for d in ("fp32", "bf16", "fp16") for o in (False, True)
            for a in (1, 2)]


def _model(size: dict[str, int], device: str) -> torch.nn.Module:
    return tiny_causal_lm("gpt2", **size).to(device)


def reference(size: dict[str, int], device: str, steps: int, batch: int, seq: int) -> dict[str, Any]:
    """Plain fp32 AdamW, full batch, on ``device``: losses and final parameters (CPU copies)."""
    model = _model(size, device)
    optimizer = torch.optim.AdamW(param_groups(model), lr=LR)
    losses = []
    for tokens in token_batches(steps, batch, seq, vocab=size["vocab"]):
        tokens = tokens.to(device)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().float().cpu() for n, p in model.named_parameters()}}


def reference64(size: dict[str, int], device: str, steps: int, batch: int, seq: int,
                run_splits: tuple[int, ...]) -> ParityReference:
    """``reference`` in float64 on ``device``, with the rounding bounds of the fp32 runs of it that split each batch
    into ``run_splits`` micro-batches (ranks x accumulation), sampled at those splits and at one row per chunk;
    see [Note: Adam rounding bound]. The finest split, one row per chunk, makes the sampled rounding (per-row
    errors summed in absolute value) one that no chance cancellation makes small: with 2 chunks the fp32 AdamW
    loop itself ended 1.05x over one element's bound (quick sizes, CPU). Sampled at 1 row and 4 only, the quick
    accumulation-2 cases (2 rows per micro-batch) used 1.00 of it on an Intel Xeon."""
    batches = [tokens.to(device) for tokens in token_batches(steps, batch, seq, vocab=size["vocab"])]
    return float64_reference(_model(size, device), lambda model: torch.optim.AdamW(param_groups(model), lr=LR),
                             batches, CLIP, splits=batch, run_splits=run_splits)


def train(case: Case, size: dict[str, int], device: str, steps: int, batch: int, seq: int, rank: int = 0,
          world: int = 1) -> dict[str, Any]:
    """hfzero on this rank: losses (averaged over ranks) and final full parameters (CPU copies)."""
    os.environ[FORCE_ENV] = "1" if case.offload and device == "cpu" else "0"
    model = _model(size, device)
    extra = {"param_persistence_threshold": 0} if case.stage == 3 else {}
    if case.dtype == "fp16":  # a modest scale: a skipped (overflowed) step would leave the reference behind
        extra["initial_loss_scale"] = 2.0**10
    config = hfzero.ZeroConfig(stage=case.stage, dtype=case.dtype, offload_optimizer=case.offload, **extra)
    model, optimizer = hfzero.prepare(model, torch.optim.AdamW(param_groups(model), lr=LR), config)
    engine = hfzero.get_engine(model)
    losses, skipped = [], 0
    for tokens in token_batches(steps, batch, seq, vocab=size["vocab"]):
        micro = micro_batches(tokens.to(device), rank, world, case.accumulation)
        total = 0.0
        for index, mb in enumerate(micro):
            loss = model(input_ids=mb, labels=mb).loss.float() / case.accumulation
            deferred = optimizer.no_sync() if index < len(micro) - 1 else contextlib.nullcontext()
            with deferred:
                optimizer.backward(loss)
            total += loss.item()
        optimizer.clip_grad_norm_(CLIP)
        optimizer.step()
        skipped += int(optimizer.last_step_skipped)
        optimizer.zero_grad()
        if world > 1:  # the ranks' mean loss (a CPU tensor: run with gloo only)
            mean = torch.tensor([total])
            torch.distributed.all_reduce(mean)
            total = float(mean) / world
        losses.append(total)
    full = hfzero.full_state_dict(model, rank0_only=False) if case.stage == 3 else None
    params = {n: (full[n] if full is not None else p.detach()).float().cpu() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "offloaded": engine.offload is not None, "skipped": skipped}


def matrix_rank(rank: int, world: int, todo: list[Case], size: dict[str, int], device: str, steps: int,
                batch: int, seq: int) -> dict[str, Any]:
    if device == "cuda":
        torch.cuda.set_device(0)
    run_splits = tuple(sorted({case.accumulation for case in todo if case.dtype == "fp32"}))  # world 1 runs
    out: dict[str, Any] = {"reference": reference(size, device, steps, batch, seq),
                           "reference64": reference64(size, device, steps, batch, seq, run_splits)}
    for case in todo:
        try:
            out[case.name] = train(case, size, device, steps, batch, seq)
        except Exception as error:  # noqa: BLE001 - one case's failure is reported, the others still run
            out[case.name] = {"error": f"{type(error).__name__}: {error}"}
    return out


def compare(case: Case, got: dict[str, Any], ref: dict[str, Any], ref64: ParityReference) -> tuple[bool, str]:
    """fp32: within ``ref64``'s derived bounds; 16-bit: within the fixed 16-bit tolerances of the fp32 loop ``ref``."""
    if "error" in got:
        return False, got["error"]
    offloaded = got["offloaded"] == case.offload
    common = f"skipped steps {got['skipped']}, offloaded {got['offloaded']}"
    if case.dtype == "fp32":
        ratio, where = ref64.worst(got["losses"], got["params"])
        return ratio <= 1 and offloaded and not got["skipped"], \
            f"worst |fp32 - float64| / derived bound {ratio:.2f} (of losses and parameters: {where}), {common}"
    ok_loss, loss_diff = close(got["losses"], ref["losses"], 5e-2)
    worst, ok_params = 0.0, True
    for name, value in ref["params"].items():
        diff = (got["params"][name] - value).abs()
        ok_params &= bool((diff <= 2e-2 + 2e-2 * value.abs()).all())
        worst = max(worst, float(diff.max()))
    return ok_loss and ok_params and offloaded and not got["skipped"], \
        f"max loss diff {loss_diff:.2e}, max parameter diff {worst:.2e}, {common}"


def run(options: Options, checks: Checks) -> dict[str, Any]:
    size = {"hidden": 32, "layers": 2, "vocab": 128} if options.quick else {"hidden": 256, "layers": 4, "vocab": 1024}
    steps, batch, seq = (2, 4, 16) if options.quick else (4, 8, 64)
    backend = "nccl" if options.device == "cuda" else "gloo"
    todo = cases(options.quick)
    out = in_process_group(matrix_rank, 1, todo, size, options.device, steps, batch, seq, backend=backend)
    rows = {}
    for case in todo:
        ok, detail = compare(case, out[case.name], out["reference"], out["reference64"])
        checks.add(case.name, ok, detail)
        rows[case.name] = detail
    return {"summary": {"backend": backend, "model": size, "steps": steps, "cases": len(todo),
                        "failed": [n for n, c in zip(rows, checks.items) if not c["ok"]]}, "rows": rows}
