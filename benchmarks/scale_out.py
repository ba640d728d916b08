"""Bytes per step per rank, total and inter-node, for flat ZeRO against HSDP on simulated nodes.

    python benchmarks/scale_out.py [--world 4] [--ranks-per-node 2] [--steps 3] [--accumulation 1] [--json]

Every rank of ``--world`` gloo ranks trains a GPT-2 (``--hidden`` x ``--layers``, fp32) for a few steps under
each system, one after the other in one spawn; ``--ranks-per-node`` simulates nodes (``ZeroConfig.ranks_per_node``).
Bytes are deterministic, so a few steps suffice; they follow the paper's logical volume and the node split of
[Note: node traffic] in hfzero/comm/collectives.py. Printed beside the closed form of docs/multinode.md:
flat stage 3 crosses nodes with half of (A + 2A) Ψ_p x 4 bytes on 2 nodes (2 of 4 ring hops cross), HSDP with the
shard group = a node with 2 x Ψ_p / G x 4 bytes (the replicate all-reduce of the shard), plus the clip norm;
stage 3 with hpZ (secondary partition) with half of (A + A) Ψ_p x 4 bytes (backward gathers stay in the node).
The quantized rows (hpZ + qwZ, hpZ + qwZ + qgZ int8 / int4, ``--block`` elements per scale) are printed beside
the byte model of hfzero/planning/quantized.py (which the other flat rows match too), plus the clip norm.
Step time on gloo is printed too (wall, median), for what it is: all ranks share this host's cores.

    python benchmarks/scale_out.py --loss-steps 200 --lr 1e-3

trains plain hpZ and the three quantized systems for 200 steps on a learnable task (rows counting up by a
random stride) and prints each quantized system's loss relative to hpZ's every 10 steps from step 20;
``--loss-systems NAME ...`` runs only those beside plain hpZ, e.g. qgZ alone or with error feedback ("... EF").

    python benchmarks/scale_out.py --rss-rounds 3 --steps 10 [--rss-systems "stage 3 + hpZ" "hpZ+qwZ+qgZ int8"]

runs each system alone in processes of its own, the systems interleaved over the rounds, and prints the median over
rounds of the largest per-rank peak RSS and of the median step time, beside the first system's, with the quantized
collectives' kept buffers (COMM_BUFFER) and error-feedback residuals (QUANT_RESIDUAL) per rank.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

import hfzero
from hfzero.planning.quantized import node_comm_bytes_per_step
from hfzero.testing import run_distributed
from hfzero.testing.models import micro_batches, tiny_causal_lm, token_batches

SYSTEMS = {  # name -> (stage, shard_size, hpZ, quantize_weights, quantize_gradients); shard_size -1: ranks per node
    "flat stage 2": (2, 0, False, None, None),
    "HSDP stage 2": (2, -1, False, None, None),
    "flat stage 3": (3, 0, False, None, None),
    "HSDP stage 3": (3, -1, False, None, None),
    "stage 3 + hpZ": (3, 0, True, None, None),
    "hpZ + qwZ": (3, 0, True, "int8", None),
    "hpZ+qwZ+qgZ int8": (3, 0, True, "int8", "int8"),
    "hpZ+qwZ+qgZ int4": (3, 0, True, "int8", "int4"),
}
EXTRA_SYSTEMS = {  # loss runs only (``--loss-systems``): qgZ alone, and with error feedback (" EF")
    "hpZ+qgZ int8": (3, 0, True, None, "int8"),
    "hpZ+qgZ int8 EF": (3, 0, True, None, "int8"),
    "hpZ+qwZ+qgZ int8 EF": (3, 0, True, "int8", "int8"),
    "hpZ+qwZ+qgZ int4 EF": (3, 0, True, "int8", "int4"),
}
LOSS_SYSTEMS = {  # name -> (system, micro-batches, init seed); controls: fp32 rounding only, another initialization
    "stage 3 + hpZ": ("stage 3 + hpZ", 1, 0),
    "control: hpZ, 2 mb": ("stage 3 + hpZ", 2, 0),
    "control: hpZ, seed 1": ("stage 3 + hpZ", 1, 1),
    "hpZ + qwZ": ("hpZ + qwZ", 1, 0),
    "hpZ+qwZ+qgZ int8": ("hpZ+qwZ+qgZ int8", 1, 0),
    "hpZ+qwZ+qgZ int4": ("hpZ+qwZ+qgZ int4", 1, 0),
    **{name: (name, 1, 0) for name in EXTRA_SYSTEMS},
}


def _prepare(name: str, args: argparse.Namespace, seed: int = 0):
    stage, shard, hpz, qw, qg = SYSTEMS[name] if name in SYSTEMS else EXTRA_SYSTEMS[name]
    model = tiny_causal_lm("gpt2", seed=seed, hidden=args.hidden, layers=args.layers, vocab=args.vocab, positions=args.seq)
    config = hfzero.ZeroConfig(stage=stage, shard_size=args.ranks_per_node if shard < 0 else shard, dtype=args.dtype,
                               ranks_per_node=args.ranks_per_node, param_persistence_threshold=0,
                               secondary_partition=hpz, quantize_weights=qw, quantize_gradients=qg,
                               quantize_block=args.block, quantize_error_feedback=name.endswith(" EF"))
    return hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=args.lr), config)


def bench(rank: int, world: int, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    out = {}
    batches = token_batches(args.steps, world * args.accumulation * 2, args.seq, vocab=args.vocab)
    for name, (stage, _, hpz, qw, qg) in SYSTEMS.items():
        model, optimizer = _prepare(name, args)
        engine = hfzero.get_engine(model)
        totals, inter, seconds = [], [], []
        for batch in batches:
            before = engine.comm.stats()
            dist.barrier()
            start = time.perf_counter()
            for mb in micro_batches(batch, rank, world, args.accumulation):
                optimizer.backward(model(input_ids=mb, labels=mb).loss / args.accumulation)
            optimizer.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad()
            dist.barrier()
            seconds.append(time.perf_counter() - start)
            after = engine.comm.stats()
            totals.append(sum(s.bytes - (before[k].bytes if k in before else 0) for k, s in after.items()))
            inter.append(sum(s.inter_node_bytes - (before[k].inter_node_bytes if k in before else 0)
                             for k, s in after.items()))
        padded, shard_numel = engine.num_params_padded, engine.layout.shard_numel
        element = engine.param_shard.element_size() if stage == 3 else engine.param_flat.element_size()
        a = args.accumulation
        if engine.replicate is None:  # the estimator's bytes (hfzero/planning/quantized.py) plus the clip norm
            model_inter = node_comm_bytes_per_step(
                padded, world, stage, nodes=world // args.ranks_per_node, accumulation_steps=a,
                secondary_partition=hpz, param_bytes=element, grad_bytes=element, quantize_weights=qw,
                quantize_gradients=qg, quantize_block=args.block)[1] + 8 * engine.comm.node_crossings / world
        else:
            model_inter = element * 2 * shard_numel
        out[name] = {"bytes_per_step": statistics.mean(totals), "inter_node_bytes_per_step": statistics.mean(inter),
                     "model_inter_node_bytes": model_inter, "step_seconds": statistics.median(seconds),
                     "model_state_bytes": engine.model_state_bytes(), "params": engine.num_params}
        del model, optimizer, engine
    return out


def _sequences(step: int, rows: int, seq: int, vocab: int) -> torch.Tensor:
    """A learnable task (loss falls well below ln(vocab)): each row counts up from a random start by a random
    stride, mod vocab. (rows, seq)"""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, vocab, (rows, 1), generator=g)
    stride = torch.randint(1, 8, (rows, 1), generator=g)
    return (start + stride * torch.arange(seq)) % vocab


def loss_run(rank: int, world: int, args: argparse.Namespace) -> dict[str, list[float]]:
    """Per-step mean loss over the ranks of ``--loss-steps`` steps for each of LOSS_SYSTEMS, the same data."""
    out = {}
    for name, (system, micro, seed) in LOSS_SYSTEMS.items():
        if name != "stage 3 + hpZ" and args.loss_systems and name not in args.loss_systems:
            continue
        model, optimizer = _prepare(system, args, seed)
        losses = []
        for step in range(args.loss_steps):
            total = torch.zeros(())
            for mb in micro_batches(_sequences(step, world * 4, args.seq, args.vocab), rank, world, micro):
                loss = model(input_ids=mb, labels=mb).loss / micro
                optimizer.backward(loss)
                total += loss.detach().float()
            optimizer.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad()
            value = total.reshape(1).clone()
            dist.all_reduce(value)
            losses.append(value.item() / world)
        out[name] = losses
        del model, optimizer
    return out


def rss_run(rank: int, world: int, args: argparse.Namespace, name: str) -> dict[str, float]:
    """One system alone in its processes: the median step time over ``--steps`` steps after 2 warm-up steps, and
    this rank's peak RSS (ru_maxrss: the process's high-water mark, imports included)."""
    import resource

    model, optimizer = _prepare(name, args)
    seconds = []
    for step in range(args.steps + 2):
        mb = _sequences(step, world * 4, args.seq, args.vocab).chunk(world)[rank]
        dist.barrier()
        start = time.perf_counter()
        optimizer.backward(model(input_ids=mb, labels=mb).loss)
        optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        dist.barrier()
        seconds.append(time.perf_counter() - start)
    engine = hfzero.get_engine(model)
    roles = {k.value: v for k, v in engine.memory_by_role().items()}
    return {"step_seconds": statistics.median(seconds[2:]), "peak_rss_bytes": 1024 * resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss, "comm_buffer_bytes": roles.get("comm_buffer", 0),
        "quant_residual_bytes": roles.get("quant_residual", 0)}


def _rss_rounds(args: argparse.Namespace) -> None:
    """``--rss-rounds R``: each system of ``--rss-systems`` in processes of its own, the systems interleaved, R
    rounds; per system the median over rounds of the largest per-rank peak RSS and of the median step time."""
    figures: dict[str, list[dict]] = {name: [] for name in args.rss_systems}
    for _ in range(args.rss_rounds):
        for name in args.rss_systems:
            per_rank = run_distributed(rss_run, args.world, args, name, timeout=1800)
            figures[name].append({"peak_rss_bytes": max(r["peak_rss_bytes"] for r in per_rank),
                                  "step_seconds": per_rank[0]["step_seconds"],
                                  "comm_buffer_bytes": per_rank[0]["comm_buffer_bytes"],
                                  "quant_residual_bytes": per_rank[0]["quant_residual_bytes"]})
    if args.json:
        print(json.dumps(figures, indent=1))
        return
    base = args.rss_systems[0]
    base_rss = statistics.median(f["peak_rss_bytes"] for f in figures[base])
    base_step = statistics.median(f["step_seconds"] for f in figures[base])
    print(f"world {args.world} on {args.world // args.ranks_per_node} simulated node(s), {args.dtype} GPT-2 hidden "
          f"{args.hidden} x {args.layers}; {args.rss_rounds} interleaved rounds, each system in its own processes; "
          f"medians over rounds; rank-max peak RSS")
    print(f"{'system':<22} {'peak RSS MB':>12} {'vs first':>9} {'step s':>8} {'vs first':>9} {'comm buf':>10} "
          f"{'residual':>10}")
    for name, rounds in figures.items():
        rss = statistics.median(f["peak_rss_bytes"] for f in rounds)
        step = statistics.median(f["step_seconds"] for f in rounds)
        print(f"{name:<22} {rss / 1e6:>12.1f} {rss - base_rss:>+9,.0f} {step:>8.3f} {step / base_step:>9.3f} "
              f"{rounds[0]['comm_buffer_bytes']:>10,} {rounds[0]['quant_residual_bytes']:>10,}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--block", type=int, default=256, help="quantize_block")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--loss-steps", type=int, default=0,
                        help="instead of bytes: train this many steps (e.g. 200) of each quantized system and plain hpZ "
                             "on a learnable task, and print the relative loss difference every 10 steps after 20")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--loss-systems", nargs="*", default=None,
                        help="with --loss-steps: only these systems (plain hpZ always runs), e.g. 'hpZ+qwZ+qgZ int8 EF'")
    parser.add_argument("--rss-rounds", type=int, default=0,
                        help="instead of bytes: peak RSS and step time per system, each in its own processes, the "
                             "systems interleaved over this many rounds")
    parser.add_argument("--rss-systems", nargs="+", default=["stage 3 + hpZ", "hpZ+qwZ+qgZ int8"])
    args = parser.parse_args()
    if args.rss_rounds:
        _rss_rounds(args)
        return
    if args.loss_steps:
        _print_losses(run_distributed(loss_run, args.world, args, timeout=3600)[0], args)
        return
    figures = run_distributed(bench, args.world, args, timeout=1800)[0]  # rank 0's; every rank moves the same
    if args.json:
        print(json.dumps(figures, indent=1))
        return
    flat = figures["flat stage 3"]["inter_node_bytes_per_step"]
    print(f"world {args.world} on {args.world // args.ranks_per_node} simulated node(s), gloo, {args.dtype} GPT-2 hidden "
          f"{args.hidden} x {args.layers}, vocab {args.vocab}, accumulation {args.accumulation}; per rank per step")
    print(f"{'system':<18} {'bytes':>12} {'inter-node':>12} {'model':>12} {'vs flat s3':>10} {'states':>11} {'step s':>7}")
    for name, f in figures.items():
        print(f"{name:<18} {f['bytes_per_step']:>12,.0f} {f['inter_node_bytes_per_step']:>12,.0f} "
              f"{f['model_inter_node_bytes']:>12,.0f} {f['inter_node_bytes_per_step'] / flat:>10.3f} "
              f"{f['model_state_bytes']:>11,} {f['step_seconds']:>7.3f}")


def _print_losses(losses: dict[str, list[float]], args: argparse.Namespace) -> None:
    base = losses["stage 3 + hpZ"]
    logged = list(range(20, args.loss_steps, 10)) + [args.loss_steps - 1]
    print(f"{args.loss_steps} steps, {args.dtype} GPT-2 hidden {args.hidden} x {args.layers}, lr {args.lr}, block "
          f"{args.block}; loss of plain hpZ, then each system's relative difference from it, at logged steps")
    others = [name for name in list(LOSS_SYSTEMS)[1:] if name in losses]
    print(f"{'step':>5} {'hpZ loss':>9} " + " ".join(f"{n:>18}" for n in others))
    for step in logged:
        print(f"{step:>5} {base[step]:>9.4f} " + " ".join(
            f"{(losses[n][step] - base[step]) / base[step]:>+18.4%}" for n in others))
    worst = {n: max(abs(losses[n][s] - base[s]) / base[s] for s in logged) for n in others}
    print(f"first loss {base[0]:.4f}; worst |relative difference| at logged steps >= 20: "
          + ", ".join(f"{n} {w:.3%}" for n, w in worst.items()))


if __name__ == "__main__":
    main()
