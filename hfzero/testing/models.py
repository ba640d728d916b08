"""Small Hugging Face models and data built from configs (no hub), for tests, examples and benchmarks."""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 128


def tiny_causal_lm(kind: str = "gpt2", *, seed: int = 0, hidden: int = 32, layers: int = 2,
                   vocab: int = VOCAB, positions: int = 64) -> nn.Module:
    """A deterministic, dropout-free causal LM: "gpt2" (tied wte/lm_head) or "llama" (tied embeddings)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if kind == "gpt2":
        config = GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=hidden, n_layer=layers, n_head=4,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(config)
    elif kind == "llama":
        config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=positions, tie_word_embeddings=True)
        model = LlamaForCausalLM(config)
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}; use 'gpt2' or 'llama'")
    model.config.use_cache = False
    # GPT2LMHeadModel's class name maps to no loss type: transformers then warns (a graph break under
    # torch.compile) on every forward before falling back to this same loss
    model.loss_type = "ForCausalLM"
    return model.float()


def tiny_moe_lm(*, seed: int = 0, hidden: int = 32, layers: int = 2, experts: int = 8, top_k: int = 2,
                expert_hidden: int = 16, vocab: int = VOCAB, positions: int = 64,
                router_logits: bool = False, implementation: str = "eager") -> nn.Module:
    """A deterministic Qwen3-MoE causal LM (``experts`` experts per layer, ``top_k`` per token, fused 3-D expert
    parameters, the config's ``base_model_ep_plan``); ``router_logits``: the loss includes the router's
    auxiliary load-balancing loss (``output_router_logits``); ``implementation``: transformers' experts
    implementation ("eager" runs in float64 too, for parity references; "grouped_mm" is faster)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                            moe_intermediate_size=expert_hidden, num_hidden_layers=layers, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=hidden // 4, num_experts=experts,
                            num_experts_per_tok=top_k, max_position_embeddings=positions, tie_word_embeddings=False,
                            output_router_logits=router_logits)
    model = Qwen3MoeForCausalLM(config)
    model.set_experts_implementation(implementation)
    model.config.use_cache = False
    return model.float()


def tiny_seq2seq(*, seed: int = 0, hidden: int = 32, layers: int = 2, vocab: int = VOCAB,
                 positions: int = 64) -> nn.Module:
    """A deterministic, dropout-free BART encoder-decoder (shared embeddings tied to lm_head)."""
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(seed)
    config = BartConfig(vocab_size=vocab, d_model=hidden, encoder_layers=layers, decoder_layers=layers,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=2 * hidden,
                        decoder_ffn_dim=2 * hidden, max_position_embeddings=positions, dropout=0.0,
                        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
                        eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)
    return BartForConditionalGeneration(config).float()


def token_batches(steps: int, global_batch: int, seq_len: int, *, vocab: int = VOCAB,
                  seed: int = 1234) -> list[torch.Tensor]:
    """``steps`` batches of token ids, each (global_batch, seq_len), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (global_batch, seq_len), generator=g) for _ in range(steps)]


def micro_batches(batch: torch.Tensor, rank: int, world_size: int, accumulation: int) -> list[torch.Tensor]:
    """This rank's ``accumulation`` micro-batches of a global batch (contiguous rows per rank)."""
    rows = batch.shape[0]
    if rows % (world_size * accumulation):
        raise ValueError(f"global batch {rows} is not divisible by world {world_size} x accumulation {accumulation}")
    mine = batch.chunk(world_size)[rank]  # (B / W, T)
    return list(mine.chunk(accumulation))  # A x (B / (W * A), T)


def train_causal_lm(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, world_size: int,
                    steps: int, seq_len: int) -> list[float]:
    """``steps`` plain steps of a causal LM on ``token_batches`` (2 rows per rank, labels = inputs, no
    accumulation) on the device of the model's first parameter; this rank's losses."""
    device = next(model.parameters()).device
    losses = []
    for batch in token_batches(steps, 2 * world_size, seq_len):
        (ids,) = micro_batches(batch.to(device), rank, world_size, 1)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses
