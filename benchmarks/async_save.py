"""How long a checkpoint save blocks training, synchronous vs asynchronous (``ZeroConfig.async_save``).

    python benchmarks/async_save.py [--world 2] [--stage 2] [--layers 8] [--hidden 512] [--rounds 3] [--json]

Trains a Llama (about 41M parameters with the defaults; fp32, AdamW) on ``--world`` spawned ranks (gloo), one
tiny batch per step so a step is short beside a save. In alternating rounds, each rank runs three steps, saves,
runs three more steps, both for a synchronous save and for an asynchronous one, and records:

- ``blocked``: seconds ``save_checkpoint`` keeps the training loop (the whole save when synchronous; when
  asynchronous, the small collectives, the manifest and copying the persistent buffers), plus, asynchronous,
  ``copy_wait``: seconds the next optimizer step waits for the background's copy of the master and
  optimizer-state slices into the staging buffer (``ZeroEngine.wait_checkpoint_copy``; 0 when the copy ended
  during that step's forward and backward);
- ``full``: seconds from the save's start until the checkpoint is complete on disk (synchronous: ``blocked``;
  asynchronous: until the background write ends, taken from a save waited for at once in the same round);
- ``step``: median seconds of a training step without a save, and of the steps run while the background
  write goes on (they share the CPU with it);
- ``lost``: per save, ``blocked`` + the three steps after the save - three median steps: the training time the
  save costs in all (asynchronous: the blocked part plus the slowdown of the steps that share the host with
  the background copy and write; on a host with no spare cores that slowdown is about the write's CPU time);
- ``staging``: the staging buffer's bytes (CKPT_STAGING);
- ``peak_over``: per mode (``none``: six steps and no save; ``sync``; ``async``, its background write waited
  for at the end), the process's peak RSS during the phase (VmHWM, reset at its start) minus its RSS at the
  start (the max over rounds after the first; the first asynchronous round is shown apart), and ``rss``: the RSS at the start of every phase, so growth across rounds shows. The staging
  buffer is allocated by the first asynchronous save and kept (a model state), so it is inside ``rss`` from
  then on, not in ``peak_over``.

Prints the medians over rounds of the busier rank, and ratios side by side; ``--json`` prints everything.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import hfzero
from hfzero.checkpoint import save_checkpoint, wait_for_save
from hfzero.roles import MemoryRole
from hfzero.testing import procmem, run_distributed


def _llama(layers: int, hidden: int, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 8 / 3) // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                         num_key_value_heads=max(1, hidden // 64), max_position_embeddings=64)
    return LlamaForCausalLM(config)


def _rank(rank: int, world: int, root: str, stage: int, layers: int, hidden: int, vocab: int, rounds: int) -> dict:
    torch.set_num_threads(1)
    model = _llama(layers, hidden, vocab)
    model, opt = hfzero.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4), hfzero.ZeroConfig(stage=stage))
    batch = torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(rank))
    engine = hfzero.get_engine(model)
    waited = [0.0]
    wait_checkpoint_copy = engine.wait_checkpoint_copy

    def timed_wait() -> None:
        started = time.perf_counter()
        wait_checkpoint_copy()
        waited[0] += time.perf_counter() - started

    engine.wait_checkpoint_copy = timed_wait

    def step() -> float:
        started = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        opt.backward(loss)
        opt.step()
        return time.perf_counter() - started

    for _ in range(2):
        step()  # warm-up
    out: dict = {"sync": [], "async": [], "async_save_call": [], "copy_wait": [], "async_full": [], "step": [],
                 "step_during_write": [], "peak_over": {"none": [], "sync": [], "async": []}, "rss": []}

    def phase_start() -> int:
        dist.barrier()
        rss = procmem.reset_peak()
        out["rss"].append(rss)
        return rss

    for r in range(rounds):
        start_rss = phase_start()
        out["step"] += [step() for _ in range(6)]
        out["peak_over"]["none"].append(procmem.status("VmHWM") - start_rss)
        for mode in ("sync", "async"):
            start_rss = phase_start()
            out["step"] += [step() for _ in range(3)]
            dist.barrier()
            started = time.perf_counter()
            save_checkpoint(Path(root) / mode, model, opt, async_save=mode == "async")
            call = time.perf_counter() - started
            waited[0] = 0.0
            during = [step() for _ in range(3)]
            if mode == "async":
                out["step_during_write"] += during
                out["async_save_call"].append(call)
                out["copy_wait"].append(waited[0])
                call += waited[0]
                wait_for_save()
            out["peak_over"][mode].append(procmem.status("VmHWM") - start_rss)
            out[mode].append(call)
            out[f"{mode}_during"] = out.get(f"{mode}_during", []) + [sum(during)]
        dist.barrier()  # the full write of an asynchronous save: the save waited for at once
        started = time.perf_counter()
        save_checkpoint(Path(root) / "async-full", model, opt, async_save=True)
        wait_for_save()
        out["async_full"].append(time.perf_counter() - started)
    typical = statistics.median(out["step"])
    for mode in ("sync", "async"):
        out[f"{mode}_lost"] = [b + d - 3 * typical for b, d in zip(out[mode], out.pop(f"{mode}_during"))]
    out["staging"] = hfzero.get_engine(model).memory_by_role().get(MemoryRole.CKPT_STAGING, 0)
    out["params"] = sum(p.numel() for p in hfzero.get_engine(model).layout.slots)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="hfzero-async-save-", dir=".")
    try:
        ranks = run_distributed(_rank, args.world, root, args.stage, args.layers, args.hidden, args.vocab,
                                args.rounds, timeout=1800)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = statistics.median
    rows = [{"rank": r, "sync_blocked": med(x["sync"]), "async_blocked": med(x["async"]),
             "async_save_call": med(x["async_save_call"]), "copy_wait": med(x["copy_wait"]),
             "async_full": med(x["async_full"]), "step": med(x["step"]),
             "step_during_write": med(x["step_during_write"]), "sync_lost": med(x["sync_lost"]),
             "async_lost": med(x["async_lost"]), "staging_bytes": x["staging"],
             "peak_over": {mode: max(v[1:] or v) for mode, v in x["peak_over"].items()},
             "first_async_peak_over": x["peak_over"]["async"][0],
             "rss_first_last": (x["rss"][0], x["rss"][-1])}
            for r, x in enumerate(ranks)]
    busiest = max(rows, key=lambda row: row["sync_blocked"])
    report = {"params": ranks[0]["params"], "world": args.world, "stage": args.stage, "rounds": args.rounds,
              "ranks": rows, "raw": ranks}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    b = busiest
    print(f"Llama {report['params'] / 1e6:.1f}M params, fp32 + AdamW, stage {args.stage}, world {args.world}, "
          f"medians of {args.rounds} rounds, rank {b['rank']} (the slower synchronous save):")
    print(f"  training step            {b['step'] * 1e3:8.1f} ms  (during a background write "
          f"{b['step_during_write'] * 1e3:.1f} ms, x{b['step_during_write'] / b['step']:.2f})")
    print(f"  synchronous save blocks  {b['sync_blocked'] * 1e3:8.1f} ms  = {b['sync_blocked'] / b['step']:.2f} steps")
    print(f"  asynchronous save blocks {b['async_blocked'] * 1e3:8.1f} ms  = {b['async_blocked'] / b['step']:.3f} steps"
          f"  (x{b['async_blocked'] / b['sync_blocked']:.3f} of synchronous; the save call "
          f"{b['async_save_call'] * 1e3:.1f} ms + the next step's wait for the copy {b['copy_wait'] * 1e3:.1f} ms)")
    print(f"  training time lost per save: synchronous {b['sync_lost'] * 1e3:.1f} ms, asynchronous "
          f"{b['async_lost'] * 1e3:.1f} ms (blocked + the slowdown of the 3 steps after the save)")
    print(f"  asynchronous full write  {b['async_full'] * 1e3:8.1f} ms  = {b['async_full'] / b['step']:.2f} steps")
    print(f"  staging buffer (CKPT_STAGING) {b['staging_bytes'] / 2**20:.1f} MiB per rank")
    for row in rows:
        over = row["peak_over"]
        first, last = row["rss_first_last"]
        print(f"  rank {row['rank']}: peak RSS above the phase's start (max over rounds after the first): no save "
              f"{over['none'] / 2**20:.1f} MiB, synchronous {over['sync'] / 2**20:.1f} MiB, asynchronous "
              f"{over['async'] / 2**20:.1f} MiB (first round, allocating the staging buffer: "
              f"{row['first_async_peak_over'] / 2**20:.1f} MiB); RSS at the first / last phase start "
              f"{first / 2**20:.1f} / {last / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
