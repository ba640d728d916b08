"""A custom accelerate training loop with hfzero's ZeroAccelerator (causal LM on the bundled corpus).

    hfzero run --nproc_per_node 2 examples/accelerate_loop.py --output_dir out/loop --zero_stage 2
    hfzero run --nproc_per_node 2 examples/accelerate_loop.py --output_dir out/loop --zero_stage 3
    torchrun --nproc_per_node 2 examples/accelerate_loop.py --output_dir out/loop --stage 1 --bf16

ZeRO options come from --stage/--bf16 here, or from HFZERO_* (which `hfzero run --zero_*` sets).
--plain runs the same loop with accelerate's own Accelerator (DDP), for comparison.
The loop uses accelerate's idioms: accumulate() for gradient accumulation, clip_grad_norm_ on sync
steps, a prepared LR scheduler, save_state/load_state checkpoints (every rank's optimizer shard).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup, set_seed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from clm_data import DATA, build_tokenizer, corpus_blocks  # noqa: E402

from hfzero import ZeroConfig  # noqa: E402
from hfzero.integrations.accelerate import ZeroAccelerator  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--stage", type=int, default=None, help="ZeRO stage (default: HFZERO_STAGE, else 2)")
    p.add_argument("--bf16", action="store_true", help="16-bit parameters/gradients + fp32 master shards")
    p.add_argument("--plain", action="store_true", help="accelerate's Accelerator (DDP) instead of ZeRO")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps")
    p.add_argument("--batch_size", type=int, default=8, help="per-rank micro-batch")
    p.add_argument("--grad_accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--block_size", type=int, default=64)
    p.add_argument("--n_embd", type=int, default=64)
    p.add_argument("--n_layer", type=int, default=2)
    p.add_argument("--save_at", type=int, default=None, help="save_state after this many steps")
    p.add_argument("--resume_from", default=None, help="a save_state directory to continue from")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def make_accelerator(args: argparse.Namespace) -> Accelerator:
    common = dict(gradient_accumulation_steps=args.grad_accum, mixed_precision="bf16" if args.bf16 else "no")
    if args.plain:
        return Accelerator(cpu=not torch.accelerator.is_available(), **common)
    config = ZeroConfig(stage=args.stage) if args.stage is not None else None  # None: HFZERO_* or defaults
    return ZeroAccelerator(zero_config=config, **common)


def main() -> None:
    args = parse_args()
    accelerator = make_accelerator(args)
    set_seed(args.seed)
    tokenizer = build_tokenizer(DATA / "corpus.txt")
    train_set, _ = corpus_blocks(tokenizer, DATA / "corpus.txt", args.block_size)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=args.block_size, n_embd=args.n_embd,
                        n_layer=args.n_layer, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = get_linear_schedule_with_warmup(optimizer, 4, args.steps * accelerator.num_processes)
    loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, shuffle=False)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    step, losses = 0, []
    out = Path(args.output_dir)
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        saved = json.loads((Path(args.resume_from) / "loop_state.json").read_text())
        step, losses = saved["step"], saved["losses"]
        loader = accelerator.skip_first_batches(loader, step * args.grad_accum)
    model.train()
    micro: list[torch.Tensor] = []
    while step < args.steps:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                micro.append(loss.detach().float())
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step_loss = accelerator.gather(torch.stack(micro).mean().reshape(1)).mean().item()
            micro.clear()
            losses.append(step_loss)
            step += 1
            accelerator.print(f"step {step:3d}  loss {step_loss:.6f}  lr {scheduler.get_last_lr()[0]:.2e}")
            if args.save_at == step:
                ckpt = out / f"state-{step}"
                accelerator.save_state(str(ckpt))
                if accelerator.is_main_process:
                    (ckpt / "loop_state.json").write_text(json.dumps({"step": step, "losses": losses}))
                accelerator.wait_for_everyone()
            if step >= args.steps:
                break
    state_dict = accelerator.get_state_dict(model)  # every rank: at stage 3 this gathers (a collective)
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(out / "model", state_dict=state_dict)
        tokenizer.save_pretrained(out / "model")
        (out / "losses.json").write_text(json.dumps(losses))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
