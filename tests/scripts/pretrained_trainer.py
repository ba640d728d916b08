"""A plain Trainer script (no hfzero import) that fine-tunes a saved model: ``from_pretrained`` then Trainer.

Used by tests/test_loading_launch.py: under plain torchrun it trains with DDP; under `hfzero run --zero_stage 3`
the loading hook leaves the weights in the checkpoint until the Trainer prepares the model. Right after
``from_pretrained`` each rank writes ``param_bytes-rank<r>.json`` into the output directory: the bytes of its
parameters that hold values (those not on the meta device), the figure the test checks.
"""

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import (AutoModelForCausalLM, HfArgumentParser, Trainer, TrainingArguments, default_data_collator,
                          set_seed)


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(metadata={"help": "a saved model directory"})
    examples: int = field(default=48, metadata={"help": "training sequences"})
    seq_len: int = field(default=16, metadata={"help": "tokens per sequence"})


def main() -> None:
    sargs, targs = HfArgumentParser((ScriptArguments, TrainingArguments)).parse_args_into_dataclasses()
    set_seed(targs.seed)
    model = AutoModelForCausalLM.from_pretrained(sargs.model_name_or_path)
    held = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != "meta")
    Path(targs.output_dir).mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    (Path(targs.output_dir) / f"param_bytes-rank{rank}.json").write_text(json.dumps(
        {"held": held, "whole": sum(p.numel() * p.element_size() for p in model.parameters())}))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (sargs.examples, sargs.seq_len), generator=g)
    data = [{"input_ids": row, "labels": row.clone()} for row in ids]
    trainer = Trainer(model=model, args=targs, train_dataset=data, data_collator=default_data_collator)
    trainer.train()
    trainer.save_state()


if __name__ == "__main__":
    main()
