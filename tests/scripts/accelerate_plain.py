"""An accelerate training loop that knows nothing of hfzero (tests/test_integration_launch_accelerate.py).

Tiny dropout-free GPT-2 from a config on fixed random tokens; accumulation 2, clipping, 4 steps.
Writes ``losses.json`` (rank-averaged loss per optimizer step) and ``rank<R>.json`` (the classes
the script ended up with and, if its optimizer exposes an engine, that engine's memory by role).
"""

import argparse
import json
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel, set_seed

p = argparse.ArgumentParser()
p.add_argument("--output_dir", required=True)
p.add_argument("--steps", type=int, default=4)
args = p.parse_args()

set_seed(0)
accelerator = Accelerator(gradient_accumulation_steps=2)
config = GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=32, vocab_size=128,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
model = GPT2LMHeadModel(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.randint(0, 128, (args.steps * 2 * accelerator.num_processes * 2, 16),
                     generator=torch.Generator().manual_seed(0))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=2, shuffle=False)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
losses, running = [], 0.0
for (batch,) in loader:
    with accelerator.accumulate(model):
        loss = model(input_ids=batch, labels=batch).loss
        running += accelerator.reduce(loss.detach(), "mean").item() / 2
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
    if accelerator.sync_gradients:
        losses.append(running)
        running = 0.0
out = Path(args.output_dir)
out.mkdir(parents=True, exist_ok=True)
inner = getattr(optimizer, "optimizer", optimizer)
engine = getattr(inner, "engine", None)
info = {"accelerator": type(accelerator).__name__, "optimizer": type(inner).__name__,
        "num_params": sum(p.numel() for p in model.parameters()), "stage": getattr(engine, "stage", None),
        "memory": {str(getattr(k, "value", k)): v for k, v in engine.memory_by_role().items()} if engine else None}
(out / f"rank{accelerator.process_index}.json").write_text(json.dumps(info))
if accelerator.is_main_process:
    (out / "losses.json").write_text(json.dumps(losses))
accelerator.end_training()  # destroys the process group (gloo can abort in interpreter teardown otherwise)
