"""Count the host synchronizations of a training step, by owner and phase (tests, the GPU check).

[Note: host-sync budget]
A host synchronization (reading a device value on the host: ``.item()``, ``.tolist()``, a Python
``bool`` of a tensor, a blocking copy between host and device, a data-dependent shape such as
``nonzero`` or a boolean mask, ...) drains the device's queue: the host stops issuing kernels until
everything before it has run, so the compute it could have queued ahead is lost. hfzero's budget is at
most one per optimizer step, none per micro-batch (the architecture note): its checks ride on
asynchronous collectives read where the step already waits. The budget is on hfzero's own
synchronizations, those charged to hfzero's frames by [Note: host-sync attribution] (sync_census.py),
including what the torch helpers hfzero calls do; the model's (transformers' masking_utils), the
training loop's and gloo's C++ threads' are reported beside it, not charged.

``measure`` trains a tiny causal LM on one rank and counts, per phase of each counted step ("early": the
micro-batches under ``no_sync`` before the last, "last": the last micro-batch's forward and backward,
"step": ``clip_grad_norm_``, ``step`` and ``zero_grad``, "probe": one planted ``.item()`` of the caller,
which proves the counting and the attribution see a known sync): the census (the proxy on CPU), and on
CUDA also torch's own reports; ``budget`` turns either into the verdict.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from hfzero.testing.sync_census import CudaSyncWarnings, SiteCounts, SyncCensus

PHASES = ("early", "last", "step", "probe")
"""The phases of a counted step, in order (see the module docstring)."""


def _probe(place: torch.device) -> float:
    """The planted synchronization: one host read of a device value, charged to this frame ("caller")."""
    return torch.ones(1, device=place).item()


def summarize(counts: SiteCounts, steps: int) -> dict[str, Any]:
    """Per-step figures of ``counts``: by owner, hfzero's by phase, the probe's, and every site."""
    return {"per_step_by_owner": {o: n / steps for o, n in sorted(counts.by_owner().items())},
            "hfzero_per_step": counts.total("hfzero") / steps,
            "hfzero_by_phase": {p: counts.total("hfzero", [p]) / steps for p in PHASES[:3]},
            "probe": [s for s in counts.sites() if s["phase"] == "probe"],
            "sites": counts.sites()[:40]}


def budget(summary: dict[str, Any], steps: int) -> tuple[bool, str]:
    """The verdict of [Note: host-sync budget] on one ``summarize`` output: hfzero's own at most one per
    step, none in the micro-batches before the last; and the planted probe counted once per step, charged
    to its caller (else the counting saw nothing and proved nothing). Returns (ok, detail)."""
    probe = summary["probe"]
    probe_ok = len(probe) == 1 and probe[0]["count"] == steps and probe[0]["owner"] == "caller" \
        and "_probe" in probe[0]["where"]
    ok = summary["hfzero_per_step"] <= 1 and summary["hfzero_by_phase"]["early"] == 0 and probe_ok
    hfzero = [f"{s['phase']} {s['where']} {s['api']} x{s['count']}" for s in summary["sites"] if s["owner"] == "hfzero"]
    return ok, (f"hfzero per step {summary['hfzero_per_step']:g} (by phase {summary['hfzero_by_phase']}), "
                f"probe {'ok' if probe_ok else probe}, by owner {summary['per_step_by_owner']}; hfzero's: {hfzero}")


def _host_scalars(optimizer: Any) -> list[torch.Tensor]:
    """The optimizer's ``step`` counters: torch keeps them on the host unless capturable or fused."""
    inner = getattr(optimizer, "inner", optimizer)
    return [s["step"] for s in inner.state.values() if isinstance(s.get("step"), torch.Tensor)
            and s["step"].device.type == "cpu"]


def measure(rank: int, world_size: int, stage: int, accumulation_steps: int, *, steps: int = 3,
            warmup: int = 2, device: str | None = None, dtype: str = "fp32", no_sync: bool = True,
            model_kind: str = "llama", model_size: dict[str, int] | None = None, clip: float | None = 1.0,
            **config: Any) -> dict[str, Any]:
    """Train a tiny causal LM on this rank (in a process group already set up) and count host syncs.

    ``warmup`` steps first (recording stage 3's unit orders, building buffers), then ``steps`` counted
    steps of ``accumulation_steps`` micro-batches, the first ones under ``optimizer.no_sync()`` when
    ``no_sync`` (as Trainer and accelerate do), each followed by ``clip_grad_norm_(clip)`` (None: none),
    ``step`` and ``zero_grad``. ``config``: more ZeroConfig options. Returns ``proxy`` (the census's
    ``summarize``), on CUDA ``cuda`` (torch's reports, ``summarize`` plus ``cpp_thread_lines`` per step),
    else None, and ``steps``.
    """
    import hfzero
    from hfzero.testing.models import micro_batches, tiny_causal_lm, token_batches

    place = torch.device(device) if device is not None else torch.device("cpu")
    if place.type == "cuda" and place.index is None:  # rank r on GPU r (all on cuda:0 with one GPU)
        place = torch.device("cuda", rank % torch.cuda.device_count())
    if place.type == "cuda":
        torch.cuda.set_device(place)  # before the first collective: NCCL binds to the current device
    size = model_size or {}
    model = tiny_causal_lm(model_kind, **size).to(place)
    options = {"stage": stage, "dtype": dtype, "param_persistence_threshold": 0, **config}
    model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      hfzero.ZeroConfig(**options))
    cuda = place.type == "cuda"
    census = SyncCensus(place.type)
    reports = CudaSyncWarnings() if cuda else None
    vocab = size.get("vocab", 128)
    batches = [b.to(place) for b in token_batches(warmup + steps, 2 * world_size * accumulation_steps, 8, vocab=vocab)]

    def counted(phase: str, on: bool) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        if on:
            stack.enter_context(census.phase(phase))
            if reports is not None:
                stack.enter_context(reports.phase(phase))
        return stack

    for step, batch in enumerate(batches):
        on = step >= warmup
        if on and step == warmup:
            census.host(_host_scalars(optimizer))  # created by the first step
        with reports.watching() if on and reports is not None else contextlib.nullcontext():
            micro = micro_batches(batch, rank, world_size, accumulation_steps)
            for index, ids in enumerate(micro):
                last = index == len(micro) - 1
                deferred = optimizer.no_sync() if no_sync and not last else contextlib.nullcontext()
                with counted("last" if last else "early", on), deferred:
                    optimizer.backward(model(input_ids=ids, labels=ids).loss / accumulation_steps)
            with counted("step", on):
                if clip is not None:
                    optimizer.clip_grad_norm_(clip)
                optimizer.step()
                optimizer.zero_grad()
            with counted("probe", on):
                _probe(place)
            if on and cuda:
                torch.cuda.synchronize()  # gloo's threads are done before stderr is read back
    out: dict[str, Any] = {"steps": steps, "proxy": summarize(census.counts, steps), "cuda": None}
    if reports is not None:
        out["cuda"] = {**summarize(reports.counts, steps), "cpp_thread_lines_per_step": reports.cpp_thread_lines / steps}
    return out


def measure_cases(rank: int, world_size: int, cases: list[tuple[int, int]], steps: int, warmup: int,
                  device: str | None, kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    """``measure`` for each (stage, accumulation) of ``cases`` in this process (one spawn for many; a
    ``run_distributed`` target)."""
    return [measure(rank, world_size, stage, acc, steps=steps, warmup=warmup, device=device, **kwargs)
            for stage, acc in cases]
