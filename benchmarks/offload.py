"""ZeRO-Offload side by side: the ordinary path, the optimizer offloaded (host step on fused CPU AdamW) and
offloaded with ``fused=False`` (foreach host step), at one stage, in interleaved rounds (machine noise hits
every variant alike): median step time and its ratio to the ordinary path, and model-state bytes per rank
on the device and on the host, measured from the engine beside the estimator's split.

On CPU (gloo) the offload path is forced with HFZERO_FORCE_HOST_OFFLOAD=1 (testing switch: host
placement, synchronous copies): it measures what the offload machinery costs where nothing is gained,
and the fused host step. On CUDA (``--device cuda``, NCCL, one rank per GPU) it is the real thing and
also reports the peak CUDA memory allocated per variant.

    python benchmarks/offload.py [--stage 2] [--steps 6] [--hidden 256] [--layers 4] [--device cpu] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import hfzero
from hfzero.planning.estimate import model_states_bytes, model_states_cpu_bytes, precision_bytes
from hfzero.roles import MODEL_STATE_ROLES
from hfzero.runtime.offload import FORCE_ENV
from hfzero.testing import run_distributed
from hfzero.testing.models import tiny_causal_lm

VARIANTS = {"plain": (False, None), "offload": (True, None), "offload-foreach": (True, False)}


def _build(offload: bool, fused: bool | None, args: argparse.Namespace, device: str):
    os.environ[FORCE_ENV] = "1" if offload and device == "cpu" else "0"
    model = tiny_causal_lm("gpt2", hidden=args.hidden, layers=args.layers, vocab=args.vocab, positions=args.seq)
    config = hfzero.ZeroConfig(stage=args.stage, dtype=args.dtype, reduce_bucket_size=args.bucket,
                               offload_optimizer=offload)
    options = {} if fused is None else {"fused": fused}
    model, optimizer = hfzero.prepare(model.to(device), torch.optim.AdamW(model.parameters(), lr=1e-4, **options), config)
    return model, optimizer, hfzero.get_engine(model)


def _step(model, optimizer, ids: torch.Tensor) -> None:
    optimizer.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.clip_grad_norm_(1.0)
    optimizer.step()
    optimizer.zero_grad()


def bench(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    device = "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(rank)).to(device)
    built = {name: _build(offload, fused, args, device) for name, (offload, fused) in VARIANTS.items()}
    times: dict[str, list[float]] = {name: [] for name in built}
    peaks: dict[str, int] = {name: 0 for name in built}
    for step in range(args.steps + 1):
        for name, (model, optimizer, _) in built.items():
            if device != "cpu":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            dist.barrier()
            start = time.perf_counter()
            _step(model, optimizer, ids)
            if device != "cpu":
                torch.cuda.synchronize()
                peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated())
            dist.barrier()
            if step >= 1:  # warm-up excluded
                times[name].append(time.perf_counter() - start)
    out = {}
    for name, (_, _, engine) in built.items():
        host = sum(v for k, v in engine.host_memory_by_role().items() if k in MODEL_STATE_ROLES)
        out[name] = {"median_s": statistics.median(times[name]), "model_states": engine.model_state_bytes(),
                     "host_model_states": host, "num_params": engine.num_params, "peak_allocated": peaks[name],
                     "offloaded": engine.offload is not None,
                     "persistent": int(getattr(engine, "num_persistent_params", 0))}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2, help="batch size per rank")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--bucket", type=int, default=0, help="reduce_bucket_size (0: sized to the model)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()
    backend = "nccl" if args.device == "cuda" else "gloo"
    figures = run_distributed(bench, args.world, args, backend=backend, timeout=3600)[0]
    p, g, k = precision_bytes(args.dtype, "adam")
    print(f"world {args.world}, {backend}, stage {args.stage}, GPT-2 hidden {args.hidden} x {args.layers} layers, "
          f"vocab {args.vocab}, seq {args.seq}, batch {args.batch}/rank, {args.dtype} AdamW, {args.steps} timed steps "
          "(median); model states per rank at the end of a step (MB = 1e6 bytes)")
    print(f"{'variant':<16} {'step s':>8} {'x plain':>8} {'device MB':>10} {'estimate':>9} {'host MB':>9} "
          f"{'estimate':>9} {'peak alloc MB':>14}")
    rows = []
    base = figures["plain"]["median_s"]
    for name, fig in figures.items():
        psi, offloaded = fig["num_params"], fig["offloaded"]
        kwargs = dict(param_bytes=p, grad_bytes=g, optimizer_k=k, offload_optimizer=offloaded,
                      persistent_params=fig["persistent"])
        row = {"variant": name, "median_step_s": round(fig["median_s"], 4), "ratio_vs_plain": round(fig["median_s"] / base, 3),
               "device_MB": round((fig["model_states"] - fig["host_model_states"]) / 1e6, 3),
               "device_estimate_MB": round(model_states_bytes(psi, args.world, args.stage, **kwargs) / 1e6, 3),
               "host_MB": round(fig["host_model_states"] / 1e6, 3),
               "host_estimate_MB": round(model_states_cpu_bytes(psi, args.world, args.stage, **kwargs) / 1e6, 3),
               "peak_allocated_MB": round(fig["peak_allocated"] / 1e6, 3) if args.device == "cuda" else None}
        rows.append(row)
        peak = f"{row['peak_allocated_MB']:>14.3f}" if row["peak_allocated_MB"] is not None else f"{'-':>14}"
        print(f"{name:<16} {row['median_step_s']:>8.4f} {row['ratio_vs_plain']:>8.3f} {row['device_MB']:>10.3f} "
              f"{row['device_estimate_MB']:>9.3f} {row['host_MB']:>9.3f} {row['host_estimate_MB']:>9.3f} {peak}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
