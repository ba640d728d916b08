"""Long sequences: the longest sequence each configuration trains one step on, under a per-rank memory limit.

4 gloo ranks, a Llama-shaped decoder (SwiGLU MLP, RMSNorm, rotary, untied 32k vocabulary), bf16 with fp32
master weights and AdamW, one sequence per replica. Configurations:

- ddp: ZeRO stage 0 (DDP's memory: 16Ψ per rank), each rank its own sequence of T tokens;
- stage3: ZeRO stage 3 over the 4 ranks, each rank its own sequence of T tokens;
- stage3_sp4: stage 3 + Ulysses sequence parallelism over the 4 ranks: one sequence of T tokens split 4 ways;
- stage3_sp4_tiled_ckpt: the same + tiled MLP (``mlp_tiles``) + tiled logits/loss (``loss_tiles``) +
  activation checkpointing with ``cpu_checkpointing`` (see the note on CPU hosts below).

The memory limit is a per-rank peak RSS budget (``--budget-gib``): a probe "trains" when one optimizer step
runs and every rank's peak resident set (VmHWM, reset after the model is prepared, so it is the step's peak
over the process, runtime and model states included) stays within the budget. Each probe is a fresh set
of 4 spawned processes with a fresh process group (``run_distributed``). The search doubles the length from
``--start`` until a probe exceeds the budget (or reaches ``--max-len``, then reports ">= max-len": the step
time at very long sequences on 2 shared cores, not memory, ends the search), then bisects ``--bisect``
times. Lengths are multiples of 64.

Beside each measured peak: the estimator's prediction = the rank's runtime RSS (measured at its start, before
the model, as ``hfzero plan --verify`` does) + the larger of two phases:

- forward / backward: the model states that exist before the first optimizer step (``estimate.model_states_bytes``
  less Adam's two moments, which the step allocates) + stage 3's gathered units (``estimate.stage3_gathered_bytes``)
  and gradient staging (``estimate.stage3_grad_staging_bytes``) + the activation model
  (``decoder_activation_bytes`` with sp, mlp_tiles, loss_tiles, checkpointing: its ``peak``, plus the checkpoints
  it places in host memory, which on a CPU host are the same memory);
- the optimizer step: all model states + the step's fp32 gradients (``estimate.step_fp32_grad_bytes``) + stage 3's
  gather and staging pools, which stay allocated between passes.

The ranks run with glibc's mmap threshold pinned (``--mmap-threshold``, default 128 KiB, passed to the spawned
ranks as ``MALLOC_MMAP_THRESHOLD_``), so that a freed tensor's memory leaves the resident set when it is freed
and the RSS peak is the peak of live memory, which is what the estimator models. With glibc's default
(``--mmap-threshold 0``) the threshold is dynamic: after the first free of an mmapped block of up to 32 MiB it
rises to that block's size, later blocks of up to that size come from the heap, and freed heap memory that
other allocations fragment stays resident; the peak then includes memory no tensor holds (measured: stage 3 +
SP=4 + tiling + checkpoints at T=16384, 914 MiB against 655 MiB pinned; see docs/sequence.md).

On a CPU host ``cpu_checkpointing`` moves nothing (the checkpoints already live in host memory; hfzero
logs it): the gain of the last configuration over stage3_sp4 is the tiling and the checkpointing.

    python benchmarks/long_context.py [--budget-gib 1.5] [--max-len 16384] [--mmap-threshold 0] [--json OUT]
    python benchmarks/long_context.py --lengths 2048,4096 --variants stage3_sp4_tiled_ckpt   # probes, no search
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

import torch

MODEL = {"hidden": 128, "layers": 2, "heads": 4, "kv_heads": 4, "ffn": 344, "vocab": 32000}
MODELS = {"8m": MODEL,  # 8.6M parameters: the search's model (step time on 2 shared cores)
          "100m": {"hidden": 768, "layers": 8, "heads": 12, "kv_heads": 12, "ffn": 2048, "vocab": 32000}}  # 106M
MMAP_THRESHOLD = 128 * 1024
"""glibc's M_MMAP_THRESHOLD for the ranks (bytes; 0: glibc's dynamic default). See the module docstring."""


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    stage: int
    sp: int = 1
    tiles: int = 1  # mlp_tiles and loss_tiles
    checkpointing: bool = False


VARIANTS = [Variant("ddp", 0), Variant("stage3", 3), Variant("stage3_sp4", 3, sp=4),
            Variant("stage3_sp4_tiled_ckpt", 3, sp=4, tiles=8, checkpointing=True)]


def _llama(model: dict[str, int]) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=model["vocab"], hidden_size=model["hidden"], intermediate_size=model["ffn"],
                         num_hidden_layers=model["layers"], num_attention_heads=model["heads"],
                         num_key_value_heads=model["kv_heads"], max_position_embeddings=1 << 20,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    lm = LlamaForCausalLM(config).train()
    lm.config.use_cache = False
    return lm


def _config(v: Variant) -> Any:
    import hfzero

    return hfzero.ZeroConfig(stage=v.stage, dtype="bf16", sp_size=v.sp, mlp_tiles=v.tiles, loss_tiles=v.tiles,
                             cpu_checkpointing=v.checkpointing)


def _probe(rank: int, world: int, v: Variant, model_kw: dict[str, int], seq: int, steps: int) -> dict[str, Any]:
    import transformers.models.llama.modeling_llama  # noqa: F401  (imported before the runtime is measured)

    import hfzero
    from hfzero.parallel.sequence import prepare_sequence_parallel, split_batch
    from hfzero.testing.procmem import reset_peak, status

    runtime = reset_peak()  # torch, transformers, hfzero and the process group, before the model
    model = _llama(model_kw)
    if v.checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if v.sp > 1:
        model, optimizer, mesh = prepare_sequence_parallel(model, optimizer, _config(v))
        replica, sp_rank = mesh.dp_rank, mesh.sp_rank
    else:
        model, optimizer = hfzero.prepare(model, optimizer, _config(v))
        replica, sp_rank = rank, 0
    generator = torch.Generator().manual_seed(replica)
    batches = [torch.randint(0, model_kw["vocab"], (1, seq), generator=generator) for _ in range(steps)]
    construction = status("VmHWM")  # the peak while the model was built and prepared
    before = reset_peak()
    times, losses = [], []
    for ids in batches:
        batch = split_batch({"input_ids": ids}, sp_rank, v.sp) if v.sp > 1 else {"input_ids": ids, "labels": ids}
        start = time.perf_counter()
        loss = model(**batch).loss
        optimizer.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    return {"runtime": runtime, "before": before, "peak": status("VmHWM"), "times": times, "losses": losses,
            "construction": construction}


def _predict(v: Variant, model_kw: dict[str, int], seq: int, runtime: float, world: int = 4,
             steps: int = 1) -> float:
    """The peak RSS the estimator predicts for one rank: its runtime + the larger of two phases (see the module
    docstring). ``steps`` > 1: Adam's states exist from the second forward on."""
    from hfzero.planning import estimate as est

    lm = _llama(model_kw)
    params = sum(p.numel() for p in lm.parameters())
    shape = est.DecoderShape.from_hf_config(lm.config)
    states = est.model_states_bytes(params, world, v.stage, param_bytes=2, grad_bytes=2, optimizer_k=12)
    adam = states - est.model_states_bytes(params, world, v.stage, param_bytes=2, grad_bytes=2, optimizer_k=4)
    gathered = staging = 0.0
    if v.stage == 3:
        root, units = est.stage3_unit_numels(lm.config)
        gathered = est.stage3_gathered_bytes(root, units, world)
        staging = est.stage3_grad_staging_bytes(root, units, world)
    acts = est.decoder_activation_bytes(shape, seq, 1, dtype="bf16", device="cpu", sp=v.sp,
                                        checkpointing=v.checkpointing, cpu=v.checkpointing,
                                        mlp_tiles=v.tiles, loss_tiles=v.tiles)
    train = states - (adam if steps == 1 else 0.0) + gathered + staging + acts.peak + acts.checkpoints_host
    step = states + est.step_fp32_grad_bytes(params, world, v.stage) + gathered + staging
    return runtime + max(train, step)


def probe(v: Variant, model_kw: dict[str, int], seq: int, budget: float, steps: int = 1,
          mmap_threshold: int = MMAP_THRESHOLD) -> dict[str, Any]:
    """One probe: 4 fresh ranks train ``steps`` steps at ``seq``; the worst rank's figures and the prediction.
    ``mmap_threshold``: glibc's M_MMAP_THRESHOLD in the ranks (0: glibc's dynamic default)."""
    from hfzero.testing import run_distributed

    started = time.perf_counter()
    saved = os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    if mmap_threshold:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)  # read by glibc when each spawned rank starts
    try:
        ranks = run_distributed(_probe, 4, v, model_kw, seq, steps, timeout=3600)
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        if saved is not None:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
    worst = max(ranks, key=lambda r: r["peak"])
    predicted = _predict(v, model_kw, seq, worst["runtime"], steps=steps)
    out = {"variant": v.name, "seq": seq, "steps": steps, "peak": worst["peak"], "before": worst["before"],
           "runtime": worst["runtime"], "predicted": predicted, "ratio": worst["peak"] / predicted,
           "step_s": max(r["times"][-1] for r in ranks), "fits": worst["peak"] <= budget,
           "loss": ranks[0]["losses"][-1], "wall_s": time.perf_counter() - started}
    print(f"  {v.name:24s} T={seq:6d} peak {worst['peak'] / 2**20:7.0f} MiB  predicted {predicted / 2**20:7.0f} MiB "
          f"({out['ratio']:.3f}; runtime {worst['runtime'] / 2**20:.0f}, before step {worst['before'] / 2**20:.0f})  step {out['step_s']:6.1f} s  {'fits' if out['fits'] else 'OVER'}", flush=True)
    return out


def search(v: Variant, model_kw: dict[str, int], budget: float, start: int, max_len: int,
           bisect: int, mmap_threshold: int = MMAP_THRESHOLD) -> dict[str, Any]:
    """The longest multiple of 64 that trains within ``budget``: doubling, then ``bisect`` halvings."""
    probes, good, bad, seq = [], None, None, start
    while seq <= max_len:
        result = probe(v, model_kw, seq, budget, mmap_threshold=mmap_threshold)
        probes.append(result)
        if not result["fits"]:
            bad = seq
            break
        good, seq = result, seq * 2
    if good is None:
        return {"variant": v.name, "longest": 0, "capped": False, "best": None, "probes": probes}
    for _ in range(bisect if bad is not None else 0):
        mid = (good["seq"] + bad) // 2 // 64 * 64
        if mid <= good["seq"]:
            break
        result = probe(v, model_kw, mid, budget, mmap_threshold=mmap_threshold)
        probes.append(result)
        if result["fits"]:
            good = result
        else:
            bad = mid
    return {"variant": v.name, "longest": good["seq"], "capped": bad is None, "best": good, "probes": probes}


def reprice(path: str) -> int:
    """Print every probe of a saved run (``--json``) with the prediction the current estimator makes for it (the
    measured peaks and runtimes are the run's): the estimator can be revised without rerunning the probes."""
    with open(path, encoding="utf-8") as f:
        run = json.load(f)
    model, by_name = run["model"], {v.name: v for v in VARIANTS}
    probes = run.get("probes") or [p for s in run["searches"].values() for p in s["probes"]]
    probes += list((run.get("timing") or {}).values())
    print(f"{path}: model {model}, mmap threshold {run.get('mmap_threshold', 'dynamic (not recorded)')}")
    print("| configuration | T | steps | peak RSS / rank (MiB) | predicted (MiB) | measured / predicted |")
    print("|---|---|---|---|---|---|")
    for p in probes:
        steps = p.get("steps", 2 if p in (run.get("timing") or {}).values() else 1)
        predicted = _predict(by_name[p["variant"]], model, p["seq"], p["runtime"], steps=steps)
        print(f"| {p['variant']} | {p['seq']} | {steps} | {p['peak'] / 2**20:.0f} | {predicted / 2**20:.0f} | "
              f"{p['peak'] / predicted:.3f} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-gib", type=float, default=1.0, help="per-rank peak RSS limit (GiB)")
    parser.add_argument("--start", type=int, default=512, help="first length probed (x2 for the SP configurations)")
    parser.add_argument("--max-len", type=int, default=16384)
    parser.add_argument("--bisect", type=int, default=2)
    parser.add_argument("--common", type=int, default=0, help="length for step time per token (default: ddp's longest)")
    parser.add_argument("--variants", default=",".join(v.name for v in VARIANTS))
    parser.add_argument("--model", choices=sorted(MODELS), default="8m")
    parser.add_argument("--mmap-threshold", type=int, default=MMAP_THRESHOLD,
                        help="glibc M_MMAP_THRESHOLD in the ranks, bytes (0: glibc's dynamic default)")
    parser.add_argument("--lengths", default="", help="comma-separated lengths: probe each variant at each, no search")
    parser.add_argument("--reprice", default=None, metavar="JSON",
                        help="a saved run (--json): print its probes' measured peaks beside the current prediction")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.reprice:
        return reprice(args.reprice)
    budget = args.budget_gib * 2**30
    model = MODELS[args.model]
    chosen = [v for v in VARIANTS if v.name in args.variants.split(",")]
    print(f"model {model}, budget {args.budget_gib} GiB per rank (peak RSS), 4 gloo ranks, "
          f"mmap threshold {args.mmap_threshold or 'dynamic'}", flush=True)
    if args.lengths:
        probes = [probe(v, model, int(t), budget, mmap_threshold=args.mmap_threshold)
                  for v in chosen for t in args.lengths.split(",")]
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"model": model, "mmap_threshold": args.mmap_threshold, "probes": probes,
                           "command": " ".join(sys.argv)}, f, indent=1)
        return 0
    results = {}
    for v in chosen:
        print(f"search {v.name}", flush=True)
        results[v.name] = search(v, model, budget, args.start * (2 if v.sp > 1 else 1), args.max_len, args.bisect,
                                 args.mmap_threshold)
    common = args.common or min(r["longest"] for r in results.values() if r["longest"]) // 64 * 64
    print(f"step time per token at T={common} (2 steps, the second timed)", flush=True)
    timing = {v.name: probe(v, model, common, budget, steps=2, mmap_threshold=args.mmap_threshold) for v in chosen}
    rows = []
    for v in chosen:
        r, best = results[v.name], results[v.name]["best"] or {}
        rows.append({"variant": v.name, "longest": r["longest"], "capped": r["capped"],
                     "peak_mib": best.get("peak", 0) / 2**20, "predicted_mib": best.get("predicted", 0) / 2**20,
                     "ratio": best.get("ratio"), "us_per_token": timing[v.name]["step_s"] / common * 1e6})
    print("\n| configuration | longest T (1 step) | peak RSS / rank (MiB) | predicted (MiB) | measured / predicted "
          f"| step time per token at T={common} (µs) |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        longest = (">= " if row["capped"] else "") + str(row["longest"])
        print(f"| {row['variant']} | {longest} | {row['peak_mib']:.0f} | {row['predicted_mib']:.0f} | "
              f"{row['ratio']:.3f} | {row['us_per_token']:.0f} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"model": model, "mmap_threshold": args.mmap_threshold, "budget_gib": args.budget_gib,
                       "rows": rows, "searches": results,
                       "timing": timing, "command": " ".join(sys.argv)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
