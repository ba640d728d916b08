"""Per-rank peak RSS while loading a Llama through ``from_pretrained``, sharded vs ordinary.

    python benchmarks/load.py [--world 2] [--layers 12] [--hidden 768] [--vocab 32000] [--dtype fp32]

Saves a Llama (about 110M parameters with the defaults, tied embeddings) once, then on each of
``--world`` spawned ranks, from a post-import baseline (process group up; a tiny model of the same
class loaded once so lazy imports and first-use allocations are not counted), measures VmHWM growth:

- ``sharded: from_pretrained``: ``with hfzero.sharded_init(): from_pretrained(...)`` (issue 20's
  bound: 1.25 x model bytes / N + the largest tensor);
- ``sharded: + prepare``: the same model then ``hfzero.prepare`` at stage 3 (the shard is read here:
  parameter shard, gradient shard and fp32 master/Adam state are the engine's model states);
- ``ordinary: from_pretrained`` and ``ordinary: + prepare``, for contrast (every rank holds the model).

Each variant also runs one optimizer step (2 rows of 16 tokens) and reports the peak after it and the
seconds from the start of ``from_pretrained`` to the end of that step (time to the first step). ``--pp 2``
builds a pipeline of ``--pp`` stages instead (pp x dp = ``--world``): each rank keeps its stage (the sharded
path reads only that; see [Note: stage-only builds]).

Each variant runs in fresh processes. Prints one line per rank and variant, and ``--json``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

import hfzero
from hfzero.roles import MODEL_STATE_ROLES, MemoryRole
from hfzero.testing import run_distributed
from hfzero.testing.procmem import reset_peak, status

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _llama(layers: int, hidden: int, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 8 / 3) // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                         num_key_value_heads=max(1, hidden // 64), max_position_embeddings=256,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def _rank(rank: int, world: int, path: str, warmup: str, sharded: bool, dtype: str, stage: int, pp: int) -> dict:
    from transformers import AutoModelForCausalLM

    from hfzero.parallel.pipeline import PipelineConfig, pipeline

    def load(where: str):
        if sharded:
            with hfzero.sharded_init():
                return AutoModelForCausalLM.from_pretrained(where, dtype=DTYPES[dtype])
        return AutoModelForCausalLM.from_pretrained(where, dtype=DTYPES[dtype])

    config = hfzero.ZeroConfig(stage=stage, dtype=dtype)  # the engine keeps the model's dtype
    batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))  # (B, T), warm-up vocab

    def build(model):
        """The engine (or this rank's pipeline stage) and a function running one optimizer step."""
        optimizer = torch.optim.AdamW(model.parameters())
        if pp > 1:
            pipe = pipeline(model, optimizer, config, PipelineConfig(pp_size=pp, n_microbatches=2))
            pipe.release_other_stages(model)
            return pipe.engine, lambda: pipe.train_step(batch)
        model, optimizer = hfzero.prepare(model, optimizer, config)

        def step():
            optimizer.backward(model(input_ids=batch, labels=batch).loss)
            optimizer.step()
            optimizer.zero_grad()
        return hfzero.get_engine(model), step

    small = load(warmup)
    build(small)[1]()  # lazy imports, first-use allocations and the first step's code paths, not counted
    del small
    base = reset_peak()
    started = time.perf_counter()
    model = load(path)
    loaded = status("VmHWM") - base
    engine, step = build(model)
    prepared = status("VmHWM") - base
    step()
    first_step = time.perf_counter() - started
    stepped = status("VmHWM") - base
    roles = engine.memory_by_role()
    states = sum(roles.get(role, 0) for role in MODEL_STATE_ROLES)
    return {"from_pretrained": loaded, "prepare": prepared, "first_step": stepped, "seconds_to_first_step":
            first_step, "param_shard": roles.get(MemoryRole.PARAM_SHARD, 0),
            "other_states": states - roles.get(MemoryRole.PARAM_SHARD, 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--saved_dtype", choices=sorted(DTYPES), default=None,
                        help="the checkpoint's dtype (default: --dtype, the dtype from_pretrained loads in)")
    parser.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=3)
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (pp x dp = --world); 1: no pipeline")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="hfzero-load-")
    saved = DTYPES[args.saved_dtype or args.dtype]  # the checkpoint's dtype (an fp32 save loaded in bf16)
    model = _llama(args.layers, args.hidden, args.vocab).to(saved)
    params = sum(p.numel() for p in model.parameters())
    itemsize = DTYPES[args.dtype].itemsize
    largest = max(p.numel() for p in model.parameters()) * itemsize
    model.save_pretrained(f"{root}/model")
    _llama(max(2, args.pp), 64, 256).to(saved).save_pretrained(f"{root}/warmup")
    del model
    model_bytes = params * itemsize
    bound = 1.25 * model_bytes / args.world + largest
    report = {"params": params, "model_bytes": model_bytes, "largest_tensor_bytes": largest, "world": args.world,
              "bound_bytes": bound, "dtype": args.dtype, "stage": args.stage,
              "saved_dtype": args.saved_dtype or args.dtype, "pp": args.pp}
    for sharded in (True, False):
        label = "sharded" if sharded else "ordinary"
        report[label] = run_distributed(_rank, args.world, f"{root}/model", f"{root}/warmup", sharded, args.dtype,
                                        args.stage, args.pp)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    mib = 1 << 20
    where = f"stage {args.stage}" + (f", pp={args.pp}" if args.pp > 1 else "")
    print(f"Llama {params / 1e6:.1f}M params, {args.dtype} (saved in {args.saved_dtype or args.dtype}), {where}: model "
          f"{model_bytes / mib:.0f} MiB, largest tensor {largest / mib:.0f} MiB, world {args.world}; bound 1.25 x "
          f"model / N + largest = {bound / mib:.0f} MiB")
    for label in ("sharded", "ordinary"):
        for rank, figures in enumerate(report[label]):
            print(f"{label:8s} rank {rank}: peak RSS growth from_pretrained {figures['from_pretrained'] / mib:7.1f} MiB, "
                  f"+ prepare {figures['prepare'] / mib:7.1f} MiB, + first step {figures['first_step'] / mib:7.1f} MiB "
                  f"(engine: parameter shard {figures['param_shard'] / mib:.1f} MiB, other model states "
                  f"{figures['other_states'] / mib:.1f} MiB); {figures['seconds_to_first_step']:.2f} s from "
                  "from_pretrained to the end of the first step")


if __name__ == "__main__":
    main()
