"""A plain Trainer script (no hfzero import) with models beside the trained one: a causal-LM teacher and a
sequence-classification reward model, both ``from_pretrained``, only ever run in inference (never given to the
Trainer), and optionally the trained model run once before its Trainer is built.

Used by tests/test_loading_scripts.py: under `hfzero run --zero_stage N` every ``from_pretrained`` here loads
under sharded loading; the models hfzero never prepares must compute what they compute under plain torchrun.
The loss is the student's language-model loss plus a distillation term towards the teacher; the reward model
scores each batch. Per rank it writes ``outputs-rank<r>.json`` into the output directory: ``sample`` (with
``--sample_first``: the trained model's greedy continuation of a fixed prompt and the sum of its logits, before
the Trainer exists, inputs put on ``model.device`` as inference scripts do), ``teacher`` and ``reward`` (per
training step, the sums of the teacher's logits and of the reward scores, in float64).
"""

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, HfArgumentParser, Trainer,
                          TrainingArguments, default_data_collator, set_seed)


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(metadata={"help": "the trained model (a saved directory)"})
    teacher_name_or_path: str = field(metadata={"help": "the teacher, a causal LM of the same vocabulary"})
    reward_name_or_path: str = field(metadata={"help": "the reward model, a sequence classifier"})
    sample_first: bool = field(default=False, metadata={"help": "run the trained model before the Trainer"})
    examples: int = field(default=32, metadata={"help": "training sequences"})
    seq_len: int = field(default=12, metadata={"help": "tokens per sequence"})


class DistillTrainer(Trainer):
    def __init__(self, *args, teacher, reward, record, **kwargs):
        super().__init__(*args, **kwargs)
        self.teacher, self.reward, self.record = teacher, reward, record

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(**inputs)
        with torch.no_grad():
            teacher_logits = self.teacher(input_ids=inputs["input_ids"]).logits
            scores = self.reward(input_ids=inputs["input_ids"]).logits
        self.record["teacher"].append(teacher_logits.double().sum().item())
        self.record["reward"].append(scores.double().sum().item())
        distill = F.kl_div(out.logits.log_softmax(-1), teacher_logits.log_softmax(-1), log_target=True,
                           reduction="batchmean")
        loss = out.loss + 0.1 * distill
        return (loss, out) if return_outputs else loss


def main() -> None:
    sargs, targs = HfArgumentParser((ScriptArguments, TrainingArguments)).parse_args_into_dataclasses()
    set_seed(targs.seed)
    record = {"sample": None, "teacher": [], "reward": []}
    model = AutoModelForCausalLM.from_pretrained(sargs.model_name_or_path)
    if sargs.sample_first:  # e.g. a look at the model before fine-tuning it
        prompt = torch.tensor([[1, 2, 3, 4]]).to(model.device)
        with torch.no_grad():
            logits = model(input_ids=prompt).logits
            tokens = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
        record["sample"] = {"tokens": tokens.tolist(), "logits": logits.double().sum().item()}
    teacher = AutoModelForCausalLM.from_pretrained(sargs.teacher_name_or_path)
    reward = AutoModelForSequenceClassification.from_pretrained(sargs.reward_name_or_path, num_labels=1)
    teacher.to(targs.device).eval()
    reward.to(targs.device).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, model.config.vocab_size, (sargs.examples, sargs.seq_len), generator=g)
    data = [{"input_ids": row, "labels": row.clone()} for row in ids]
    trainer = DistillTrainer(model=model, args=targs, train_dataset=data, data_collator=default_data_collator,
                             teacher=teacher, reward=reward, record=record)
    trainer.train()
    trainer.save_state()
    rank = int(os.environ.get("RANK", "0"))
    (Path(targs.output_dir) / f"outputs-rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
