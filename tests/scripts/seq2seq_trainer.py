"""A Seq2SeqTrainer script (no hfzero API used): tiny BART from a config learns to copy reversed token
sequences for 4 steps, then ``predict`` with ``--predict_with_generate``. Writes ``result.json`` on the
main process: the trainer's class hierarchy, training losses, the prediction loss and generated ids."""

import json
from pathlib import Path

import torch
from transformers import HfArgumentParser, Seq2SeqTrainer, Seq2SeqTrainingArguments

from hfzero.testing.models import tiny_seq2seq  # a model built from a config, nothing else

(args,) = HfArgumentParser((Seq2SeqTrainingArguments,)).parse_args_into_dataclasses()
g = torch.Generator().manual_seed(0)
sources = torch.randint(3, 100, (48, 8), generator=g)


class Pairs(torch.utils.data.Dataset):
    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "attention_mask": torch.ones_like(self.rows[i]),
                "labels": self.rows[i].flip(0)[:6]}


model = tiny_seq2seq()
trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=Pairs(sources[:32]))
trainer.train()
prediction = trainer.predict(Pairs(sources[32:]))
if trainer.is_world_process_zero():
    history = trainer.state.log_history
    result = {"mro": [c.__name__ for c in type(trainer).__mro__],
              "losses": {h["step"]: h["loss"] for h in history if "loss" in h},
              "test_loss": prediction.metrics["test_loss"], "ids": prediction.predictions.tolist()}
    (Path(args.output_dir) / "result.json").write_text(json.dumps(result))
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()  # gloo can abort in interpreter teardown otherwise
