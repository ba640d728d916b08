"""The profile behind docs/screenshots/memory_by_role.png: a Llama from config (fp32, AdamW, gradient
checkpointing) on dp=2 x tp=2 gloo ranks, ZeRO-2 with P_a (``partition_activations``), recorded by
ZeroProfiler for a few steps, so the dashboard's memory-by-role view has every bar: model states beside
the formula, transient buckets, measured activations and checkpoints beside the activation estimate,
and the rest of the rank's peak.

    python benchmarks/memory_by_role_profile.py OUT_DIR [--hidden 512] [--layers 6] [--seq 512] [--batch 4] [--steps 3]
    python tests/test_dashboard_browser.py OUT_DIR SHOTS_DIR   # then copy SHOTS_DIR/memory_by_role.png

Prints each rank's measured ``activations`` / ``act_checkpoint`` peaks and the header's prediction.
"""

from __future__ import annotations

import argparse
import warnings

import torch

import hfzero
from hfzero.profiler import ZeroProfiler, load_run
from hfzero.testing import run_distributed

VOCAB = 4096


def _worker(rank: int, world: int, out: str, hidden: int, layers: int, seq: int, batch: int, steps: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from hfzero.parallel.tensor import prepare_tensor_parallel

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=round(2.6875 * hidden),
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=seq, tie_word_embeddings=False, use_cache=False)
    zero = hfzero.ZeroConfig(stage=2, tp_size=2, partition_activations=True)
    model, optimizer, mesh = prepare_tensor_parallel(
        LlamaForCausalLM(config).float().train(), lambda params: torch.optim.AdamW(params, lr=1e-3), zero)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    g = torch.Generator().manual_seed(1)
    with ZeroProfiler(model, optimizer, out):
        for _ in range(steps):
            ids = torch.randint(0, VOCAB, (mesh.dp_size * batch, seq), generator=g)
            mine = ids.chunk(mesh.dp_size)[mesh.dp_rank]  # (batch, seq) per data-parallel replica
            model(input_ids=mine, labels=mine).loss.backward()
            optimizer.step()
            optimizer.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the profile directory to write")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4, help="sequences per data-parallel replica")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    run_distributed(_worker, 4, args.out, args.hidden, args.layers, args.seq, args.batch, args.steps, timeout=600)
    run = load_run(args.out)
    predicted = run.header["activation_prediction"]
    for rank, log in run.ranks.items():
        steps = log.of_kind("step")
        peak = {role: max(s["roles"].get(role, 0) for s in steps) for role in ("activations", "act_checkpoint")}
        print(f"rank {rank}: measured {peak}; predicted saved {predicted['saved']:,.0f}, "
              f"checkpoints {predicted['checkpoints']:,.0f}, total {predicted['total']:,.0f}")


if __name__ == "__main__":
    main()
