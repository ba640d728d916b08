"""A plain Trainer script (no hfzero import): a tiny Qwen3-MoE (8 experts, top-2) from config trained on fixed
random token blocks.

Used by tests/test_ep_trainer.py: under plain torchrun it trains with DDP; under `hfzero run --zero_ep_size 2`
with ZeRO and expert parallelism. Every rank builds the same model and data (fixed seeds).
"""

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM, Trainer, TrainingArguments, HfArgumentParser
from transformers import default_data_collator, set_seed


def main() -> None:
    (targs,) = HfArgumentParser((TrainingArguments,)).parse_args_into_dataclasses()
    set_seed(targs.seed)
    config = Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
                            tie_word_embeddings=False, use_cache=False)
    model = Qwen3MoeForCausalLM(config)
    model.set_experts_implementation("eager")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (64, 16), generator=g)
    data = [{"input_ids": row, "labels": row.clone()} for row in ids]
    trainer = Trainer(model=model, args=targs, train_dataset=data, data_collator=default_data_collator)
    trainer.train()
    trainer.save_model()
    trainer.save_state()


if __name__ == "__main__":
    main()
