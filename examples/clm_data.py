"""Offline tokenizer and causal-LM blocks for the examples (no hub, no `datasets`).

A byte-level BPE tokenizer is trained with the `tokenizers` library on the bundled corpus and
wrapped in `PreTrainedTokenizerFast` (transformers 5's `GPT2TokenizerFast(vocab_file=...)` would
silently build an empty tokenizer).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

DATA = Path(__file__).resolve().parent / "data"
EOS = "<|endoftext|>"


def build_tokenizer(text_file: str | Path, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``text_file`` (deterministic, about a second)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(text_file)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=EOS, pad_token=EOS)


class Blocks(torch.utils.data.Dataset):
    """Fixed-length blocks of token ids (``input_ids`` = ``labels``), the corpus joined by EOS."""

    def __init__(self, ids: list[int], block_size: int):
        usable = len(ids) // block_size * block_size
        self.blocks = torch.tensor(ids[:usable], dtype=torch.long).view(-1, block_size)  # (N, T)

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def corpus_blocks(tokenizer: PreTrainedTokenizerFast, text_file: str | Path, block_size: int,
                  eval_percent: int = 5) -> tuple[Blocks, Blocks]:
    """Tokenize ``text_file`` line by line and split it into train and eval blocks."""
    lines = [line for line in Path(text_file).read_text().splitlines() if line.strip()]
    ids: list[int] = []
    for encoded in tokenizer(lines)["input_ids"]:
        ids.extend(encoded + [tokenizer.eos_token_id])
    split = len(ids) * (100 - eval_percent) // 100
    return Blocks(ids[:split], block_size), Blocks(ids[split:], block_size)
