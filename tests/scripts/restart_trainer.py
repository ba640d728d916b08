"""A plain Trainer script (no hfzero import) whose rank ``--kill_rank`` SIGKILLs itself on the first start.

Used by tests/test_restart_launch.py: a tiny Llama from config trained on fixed random token blocks; with
``--kill_at_step N --kill_marker FILE`` the process of rank ``--kill_rank`` kills itself (``kill -9``) at
the end of step N unless FILE exists, creating it first, so the restarted workers run through. (Not
``TORCHELASTIC_RESTART_COUNT``: torchelastic counts restarts per node, and a node restarted only because
another node's worker failed keeps 0; rank 1 may land there after the restart.)
"""

import os
import signal
from dataclasses import dataclass, field

import torch
from transformers import (HfArgumentParser, LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback,
                          TrainingArguments, default_data_collator, set_seed)


@dataclass
class ScriptArguments:
    kill_at_step: int = field(default=0, metadata={"help": "0: never"})
    kill_rank: int = field(default=1, metadata={"help": "the global rank that kills itself"})
    kill_marker: str = field(default="", metadata={"help": "created before the kill; no kill once it exists"})
    examples: int = field(default=96, metadata={"help": "training sequences"})


class KillAt(TrainerCallback):
    def __init__(self, step: int, rank: int, marker: str):
        self.step, self.rank, self.marker = step, rank, marker

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and int(os.environ.get("RANK", "0")) == self.rank:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return  # killed once already
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    sargs, targs = HfArgumentParser((ScriptArguments, TrainingArguments)).parse_args_into_dataclasses()
    set_seed(targs.seed)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, use_cache=False)
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (sargs.examples, 16), generator=g)
    data = [{"input_ids": row, "labels": row.clone()} for row in ids]
    trainer = Trainer(model=model, args=targs, train_dataset=data, data_collator=default_data_collator,
                      callbacks=[KillAt(sargs.kill_at_step, sargs.kill_rank, sargs.kill_marker)]
                      if sargs.kill_at_step else None)
    trainer.train(resume_from_checkpoint=targs.resume_from_checkpoint)
    trainer.save_state()


if __name__ == "__main__":
    main()
