"""Train a GPT-2 style causal LM with the Hugging Face Trainer on the bundled corpus.

A plain Trainer script: no hfzero import. `hfzero run` makes it train with ZeRO:

    hfzero run --nproc_per_node 2 examples/train_clm.py --config_name tiny --output_dir out/clm \
        --do_train --max_steps 60 --per_device_train_batch_size 8 --zero_stage 2

Without --zero_* options (or under plain torchrun) it trains with DDP.
--config_name: "tiny" (built in), or a path to a GPT-2 config.json / model directory.
--model_name_or_path: a locally saved checkpoint directory (e.g. the output of an earlier run).
"""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel,
                          HfArgumentParser, Trainer, TrainingArguments, default_data_collator, set_seed)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from clm_data import DATA, build_tokenizer, corpus_blocks  # noqa: E402

logger = logging.getLogger("train_clm")

BUILTIN = {"tiny": dict(n_embd=64, n_layer=2, n_head=4, n_positions=128)}


@dataclass
class ModelArguments:
    model_name_or_path: Optional[str] = field(default=None, metadata={"help": "local model directory"})
    config_name: Optional[str] = field(default=None, metadata={"help": '"tiny", or a config.json / directory'})
    config_overrides: Optional[str] = field(default=None, metadata={"help": 'e.g. "n_embd=32,resid_pdrop=0.0"'})


@dataclass
class DataArguments:
    train_file: str = field(default=str(DATA / "corpus.txt"), metadata={"help": "plain text, one paragraph per line"})
    block_size: int = field(default=64, metadata={"help": "tokens per training sequence"})
    vocab_size: int = field(default=512, metadata={"help": "BPE vocabulary size when a tokenizer is trained"})


def load_model_and_tokenizer(margs: ModelArguments, dargs: DataArguments):
    if margs.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(margs.model_name_or_path)
        return AutoModelForCausalLM.from_pretrained(margs.model_name_or_path), tokenizer
    if not margs.config_name:
        raise SystemExit("train_clm.py: pass --model_name_or_path (a local directory) or --config_name")
    tokenizer = build_tokenizer(dargs.train_file, dargs.vocab_size)
    if margs.config_name in BUILTIN:
        config = GPT2Config(**BUILTIN[margs.config_name])
    else:
        config = AutoConfig.from_pretrained(margs.config_name)
    if margs.config_overrides:
        config.update_from_string(margs.config_overrides)
    config.vocab_size = len(tokenizer)
    config.bos_token_id = config.eos_token_id = config.pad_token_id = tokenizer.eos_token_id
    return GPT2LMHeadModel(config), tokenizer


def main() -> None:
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    margs, dargs, targs = parser.parse_args_into_dataclasses()
    logging.basicConfig(level=logging.INFO if targs.process_index == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    set_seed(targs.seed)
    model, tokenizer = load_model_and_tokenizer(margs, dargs)
    train_set, eval_set = corpus_blocks(tokenizer, dargs.train_file, dargs.block_size)
    logger.info("%s: %.2fM parameters, %d train / %d eval blocks of %d tokens", type(model).__name__,
                model.num_parameters() / 1e6, len(train_set), len(eval_set), dargs.block_size)
    trainer = Trainer(model=model, args=targs, train_dataset=train_set, eval_dataset=eval_set,
                      processing_class=tokenizer, data_collator=default_data_collator)
    if targs.do_train:
        result = trainer.train(resume_from_checkpoint=targs.resume_from_checkpoint)
        trainer.save_model()
        trainer.log_metrics("train", result.metrics)
        trainer.save_state()
    if targs.do_eval:
        metrics = trainer.evaluate()
        metrics["perplexity"] = math.exp(min(metrics["eval_loss"], 50))
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    main()
