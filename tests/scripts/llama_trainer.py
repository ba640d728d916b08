"""A plain Trainer script (no hfzero import): a tiny Llama from config trained on fixed random token blocks.

Used by tests/test_tp_trainer.py: under plain torchrun it trains with DDP; under `hfzero run --zero_*` with
ZeRO (and, with --zero_tp_size, tensor parallelism). Every rank builds the same model and data (fixed seeds).
"""

from dataclasses import dataclass, field

import torch
from transformers import (HfArgumentParser, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments,
                          default_data_collator, set_seed)


@dataclass
class ScriptArguments:
    examples: int = field(default=64, metadata={"help": "training sequences"})
    eval_examples: int = field(default=12, metadata={"help": "evaluation sequences"})
    seq_len: int = field(default=16, metadata={"help": "tokens per sequence"})


def main() -> None:
    sargs, targs = HfArgumentParser((ScriptArguments, TrainingArguments)).parse_args_into_dataclasses()
    set_seed(targs.seed)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, use_cache=False)
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (sargs.examples + sargs.eval_examples, sargs.seq_len), generator=g)
    data = [{"input_ids": row, "labels": row.clone()} for row in ids]
    trainer = Trainer(model=model, args=targs, train_dataset=data[:sargs.examples],
                      eval_dataset=data[sargs.examples:], data_collator=default_data_collator)
    trainer.train()
    trainer.save_model()
    trainer.save_state()


if __name__ == "__main__":
    main()
