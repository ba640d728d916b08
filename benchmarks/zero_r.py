"""ZeRO-R measured: the tables of docs/zero-r.md in one run.

1. Activation bytes vs the estimator: tiny GPT-2 and Llama (one process), eager and sdpa attention,
   fp32 and bf16, with and without checkpointing: the profiler's measured roles (``activations`` +
   ``act_checkpoint`` at the forward's end) beside ``hfzero.planning.estimate.decoder_activation_bytes``.
2. Checkpoint bytes per rank with and without P_a and offload: a Llama on dp=2 x tp=2 (4 gloo ranks),
   checkpointing, P_a, P_a+cpu: the checkpoint function's measured peak and the activations saved
   outside the checkpoints, beside the estimate.
3. Fragmentation before / after MD (``contiguous_checkpoints``): a checkpointed Llama trained for
   ``--steps`` steps in a fresh process per variant (the glibc mmap threshold is process-wide), with
   glibc's dynamic mmap threshold and with hfzero's fixed 1 MiB one (see [Note: host allocator]): peak
   RSS (VmHWM) growth from step 2 to the last step, RSS at the last step's end, and the heap's
   free-but-held bytes and fraction of the arena (mallinfo2) in the last step at the forward's end
   (checkpoints held) and at the step's end.

    python benchmarks/zero_r.py [--steps 12] [--seq 128] [--batch 4] [--json OUT]

Figures are bytes; ratios are measured / estimate. On a CPU host "fragmentation" is glibc's heap
(see docs/zero-r.md for what MD can and cannot show there).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

import hfzero
from hfzero.planning import estimate as est
from hfzero.profiler import ZeroProfiler, load_run
from hfzero.testing import run_distributed
from hfzero.testing.models import tiny_causal_lm


def _checkpointing(model: torch.nn.Module) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _llama(hidden: int, layers: int, tie: bool = True) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                         tie_word_embeddings=tie)
    model = LlamaForCausalLM(config)
    model.config.use_cache = False
    return model.float()


# --------------------------------------------------------------------------------------------------
# 1. activations vs the estimator (one process)
# --------------------------------------------------------------------------------------------------


def activation_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for kind in ("gpt2", "llama"):
        for attention in ("eager", "sdpa"):
            for dtype in ("fp32", "bf16"):
                for checkpointing in (False, True):
                    rows.append(_activation_case(kind, attention, dtype, checkpointing, args))
    return rows


def _activation_case(kind: str, attention: str, dtype: str, checkpointing: bool,
                     args: argparse.Namespace) -> dict[str, Any]:
    model = tiny_causal_lm(kind, hidden=args.hidden, layers=args.layers, vocab=512, positions=1024).train()
    model.set_attn_implementation(attention)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = hfzero.prepare(model, optimizer, hfzero.ZeroConfig(stage=0, dtype=dtype))
    if checkpointing:
        _checkpointing(model)
    ids = torch.randint(0, 512, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as run_dir:
        with ZeroProfiler(model, optimizer, run_dir):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        run = load_run(run_dir)
        roles = run.ranks[0].of_kind("step")[0]["roles"]
        predicted = run.header["activation_prediction"]
    measured = roles.get("activations", 0) + roles.get("act_checkpoint", 0)
    return {"model": kind, "attention": attention, "dtype": dtype, "checkpointing": checkpointing,
            "act_checkpoint": roles.get("act_checkpoint", 0), "measured": measured, "estimate": predicted["saved"],
            "ratio": measured / predicted["saved"], "estimate_peak": predicted["total"],
            "korthikanti": est.activation_bytes(
                est.TransformerShape.from_hf_config(model.config), args.seq, args.batch, checkpointing=checkpointing,
                dtype_bytes=4 if dtype == "fp32" else 2, fused_attention=attention == "sdpa").total}


# --------------------------------------------------------------------------------------------------
# 2. checkpoint bytes per rank: dp=2 x tp=2
# --------------------------------------------------------------------------------------------------

TP_VARIANTS = {"no checkpointing": (False, False, False), "checkpointing": (True, False, False),
               "checkpointing + P_a": (True, True, False), "checkpointing + P_a+cpu": (True, True, True)}


def _tp_worker(rank: int, world: int, seq: int, batch: int, hidden: int, layers: int) -> list[dict[str, Any]]:
    from hfzero.parallel.tensor import prepare_tensor_parallel
    from hfzero.runtime.activations import ActivationAccounting

    rows = []
    for name, (checkpointing, partition, cpu) in TP_VARIANTS.items():
        config = hfzero.ZeroConfig(stage=2, tp_size=2, partition_activations=partition, cpu_checkpointing=cpu)
        model, optimizer, mesh = prepare_tensor_parallel(
            _llama(hidden, layers, tie=False), lambda params: torch.optim.SGD(params, lr=0.01), config)
        model.train()
        if checkpointing:
            _checkpointing(model)
        accounting = ActivationAccounting(model).attach()
        ids = torch.randint(0, 512, (2 * batch, seq), generator=torch.Generator().manual_seed(0))
        mine = ids.chunk(mesh.dp_size)[mesh.dp_rank]  # (batch, seq) per data-parallel replica
        loss = model(input_ids=mine, labels=mine).loss
        stored = model.hfzero_checkpoint.stored.live if checkpointing else 0
        saved = accounting.saved.live
        loss.backward()
        optimizer.step()
        accounting.detach()
        estimate = est.decoder_activation_bytes(
            est.DecoderShape.from_hf_config(model.config), seq, batch, dtype="fp32", checkpointing=checkpointing,
            tp=2, partition=partition, cpu=cpu, device="cpu")
        rows.append({"variant": name, "rank": rank, "checkpoints": stored, "checkpoints_estimate":
                     estimate.checkpoints + estimate.checkpoints_host, "host": cpu, "activations": saved,
                     "activations_estimate": estimate.layers + estimate.head})
    return rows


def checkpoint_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    per_rank = run_distributed(_tp_worker, 4, args.seq, args.batch, args.hidden, args.layers, timeout=600)
    return [row for rows in per_rank for row in rows if row["rank"] == 0]


# --------------------------------------------------------------------------------------------------
# 3. fragmentation before / after MD (a fresh process per variant)
# --------------------------------------------------------------------------------------------------

MD_VARIANTS = {"glibc dynamic threshold": 0, "hfzero 1 MiB threshold": 1 << 20}


def _md_worker(rank: int, world: int, threshold: int, contiguous: bool, args: dict[str, int],
               run_dir: str) -> dict[str, Any]:
    model = _llama(args["hidden"], args["layers"]).train()
    config = hfzero.ZeroConfig(stage=2, contiguous_checkpoints=contiguous, host_mmap_threshold=threshold)
    model, optimizer = hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config)
    _checkpointing(model)
    generator = torch.Generator().manual_seed(0)
    with ZeroProfiler(model, optimizer, run_dir, activations=False):
        for _ in range(args["steps"]):
            ids = torch.randint(0, 512, (args["batch"], args["seq"]), generator=generator)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    log = load_run(run_dir).ranks[0]
    steps = log.of_kind("step")
    last = steps[-1]["allocator"]
    live = [r for r in log.of_kind("phase") if r["step"] == steps[-1]["step"] and r["phase"] == "forward"
            and r["edge"] == "end"][0]["allocator"]  # the checkpoints are held here
    return {"peak_rss_step2": steps[1]["allocator"]["rss_peak"], "peak_rss_last": last["rss_peak"],
            "rss_last": last["rss"], "heap_arena": last["heap_arena"], "heap_free": last["heap_free"],
            "fragmentation": last["fragmentation"], "heap_free_live": live["heap_free"],
            "fragmentation_live": live["fragmentation"],
            "checkpoint_bytes": max(s["roles"].get("act_checkpoint", 0) for s in steps)}


def fragmentation_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    sizes = {"hidden": args.hidden, "layers": args.layers, "seq": args.seq, "batch": args.batch, "steps": args.steps}
    for allocator, threshold in MD_VARIANTS.items():
        for contiguous in (False, True):
            with tempfile.TemporaryDirectory() as run_dir:
                out = run_distributed(_md_worker, 1, threshold, contiguous, sizes, run_dir, timeout=600)[0]
            growth = (out["peak_rss_last"] - out["peak_rss_step2"]) / out["peak_rss_step2"]
            rows.append({"allocator": allocator, "MD": contiguous, **out, "peak_rss_growth": growth})
    return rows


# --------------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------------


def _table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, bool):
            return "yes" if value else "no"
        if isinstance(value, float) and abs(value) < 10 and not value.is_integer():
            return f"{value:.3f}"
        if isinstance(value, (int, float)):
            return f"{value:,.0f}"
        return str(value)

    lines = ["| " + " | ".join(title for _, title in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row[key]) for key, _ in columns) + " |" for row in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="steps of the fragmentation runs")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="sequences per data-parallel replica")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--only", choices=("activations", "checkpoints", "fragmentation"), action="append",
                        help="run only these tables (repeatable)")
    parser.add_argument("--json", metavar="OUT", help="also write every row as JSON")
    args = parser.parse_args()
    wanted = set(args.only or ("activations", "checkpoints", "fragmentation"))
    result: dict[str, Any] = {"args": vars(args)}
    print(f"s={args.seq}, b={args.batch}, h={args.hidden}, L={args.layers}\n")
    if "activations" in wanted:
        result["activations"] = activation_rows(args)
        print("Activation bytes (one forward) vs the estimator\n")
        print(_table(result["activations"], [
            ("model", "model"), ("attention", "attention"), ("dtype", "dtype"), ("checkpointing", "ckpt"),
            ("measured", "measured"), ("estimate", "estimate"), ("ratio", "ratio"),
            ("estimate_peak", "estimated peak (+ recompute)"), ("korthikanti", "Korthikanti")]) + "\n")
    if "checkpoints" in wanted:
        result["checkpoints"] = checkpoint_rows(args)
        print("Checkpoint bytes per rank, Llama dp=2 x tp=2 (rank 0)\n")
        print(_table(result["checkpoints"], [
            ("variant", "variant"), ("checkpoints", "checkpoints (measured)"),
            ("checkpoints_estimate", "estimate"), ("host", "in host memory"),
            ("activations", "other saved (measured)"), ("activations_estimate", "estimate")]) + "\n")
    if "fragmentation" in wanted:
        result["fragmentation"] = fragmentation_rows(args)
        print(f"Fragmentation before / after MD, checkpointed Llama, {args.steps} steps, stage 2, 1 rank\n")
        print(_table(result["fragmentation"], [
            ("allocator", "host allocator"), ("MD", "MD"), ("checkpoint_bytes", "checkpoints"),
            ("peak_rss_step2", "peak RSS step 2"), ("peak_rss_last", "peak RSS last"),
            ("peak_rss_growth", "growth"), ("rss_last", "RSS at end"), ("heap_free_live", "heap free, fwd end"),
            ("fragmentation_live", "free / arena, fwd end"), ("heap_free", "heap free, step end"),
            ("fragmentation", "free / arena, step end")]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
