"""Ulysses attention through transformers' attention interface: decoders run unmodified.

[Note: sequence-parallel attention]
``apply_sequence_attention`` registers ``hfzero_sequence`` in ``AttentionInterface`` and switches the model
to it; every attention module gets ``hfzero_sequence`` (the SP communicator and the attention it wraps). The
decoder computes q, k, v of its own T/S positions with all heads and RoPE at the global positions (the
batch carries ``position_ids`` of the whole sequence, see data.py), then calls us:
1. k, v with fewer key/value heads than can be split over S are replicated first (each head r times,
   r = S / gcd(Hkv, S), so each rank's query heads find their own key/value heads); refused when H is not a
   multiple of Hkv * r or of S;
2. q, k, v go sequence-sharded -> head-sharded (all-to-all, alltoall.py): every position of H/S heads;
3. the wrapped attention (the model's previous implementation when it is a registered one such as sdpa or a
   flash kernel, else sdpa) runs causal over the whole sequence: exact causal masking, as no mask is built
   (the name has no mask function, so transformers builds none; padding masks are refused in data.py);
4. the output goes head-sharded -> sequence-sharded back to (B, T/S, H, D), what the decoder expects.
Memory: the head-sharded q, k, v and output of one layer (the size of the local ones: T x H/S = T/S x H)
while the layer runs; attention's own saved tensors are of T positions and H/S heads. Sliding windows
shorter than the sequence and soft-capping are refused (they would need the mask we do not build).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hfzero.comm.collectives import Communicator
from hfzero.config import ConfigError
from hfzero.parallel.sequence.alltoall import heads_to_seq, seq_to_heads
from hfzero.runtime.lifetime import Installed

NAME = "hfzero_sequence"
"""The attention implementation name registered in transformers' AttentionInterface."""

_ATTR = "hfzero_sequence"
_DROPPED = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""Keyword arguments of the local chunk that mean nothing after the all-to-all (packed-sequence metadata)."""


@dataclasses.dataclass(frozen=True)
class SequenceAttention:
    """What one model's attention modules need: the SP group and the attention run on the whole sequence.

    Attributes:
        comm: the SP group's communicator (the all-to-alls).
        inner: the attention function run on head-sharded, whole-sequence q, k, v.
        inner_name: its name (for messages and docs).
    """

    comm: Communicator
    inner: Callable[..., Any]
    inner_name: str


class _LocalHeads:
    """The attention module as the wrapped attention sees it after key/value heads were replicated: the same
    module with ``num_key_value_groups`` of the local heads."""

    def __init__(self, module: nn.Module, groups: int) -> None:
        self._module = module
        self.num_key_value_groups = groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def kv_replication(heads: int, kv_heads: int, sp_size: int) -> int:
    """How many times each key/value head is repeated so that heads split over ``sp_size`` ranks with every
    query head's key/value head on its rank; a clear error when no repetition can."""
    if heads % sp_size:
        raise ConfigError(f"hfzero: sp_size={sp_size} does not divide the {heads} attention heads; Ulysses "
                          "attention splits heads over the SP group: choose an sp_size that divides them")
    repeat = sp_size // math.gcd(kv_heads, sp_size)
    if heads % (kv_heads * repeat):
        raise ConfigError(f"hfzero: {kv_heads} key/value heads cannot be replicated to split over sp_size={sp_size} "
                          f"ranks with {heads} query heads; choose an sp_size that divides {kv_heads} or whose "
                          f"replicated key/value heads divide {heads}")
    return repeat


def _repeat_heads(x: torch.Tensor, repeat: int) -> torch.Tensor:
    if repeat == 1:
        return x
    b, h, t, d = x.shape  # (B, Hkv, T/S, D)
    return x[:, :, None].expand(b, h, repeat, t, d).reshape(b, h * repeat, t, d)  # (B, Hkv * r, T/S, D)


def sequence_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The registered attention function. See [Note: sequence-parallel attention]."""
    state: SequenceAttention | None = getattr(module, _ATTR, None)
    if state is None:
        raise ConfigError(f"hfzero: {type(module).__name__} uses attn_implementation={NAME!r} but was not set up "
                          "for sequence parallelism; call hfzero.parallel.sequence.apply_sequence_attention(model, "
                          "comm) (prepare_sequence_parallel does it)")
    if attention_mask is not None:
        raise ConfigError("hfzero sequence parallelism: an attention mask reached the attention; masks of a split "
                          "sequence are not built. Pad on the right and ignore padded labels (-100) instead: "
                          "split_batch / SequenceCollator do it")
    if kwargs.get("softcap") is not None:
        raise ConfigError("hfzero sequence parallelism: attention soft-capping is not supported")
    comm = state.comm
    seq = query.shape[2] * comm.world_size
    window = kwargs.pop("sliding_window", None)
    if window is not None and window < seq:
        raise ConfigError(f"hfzero sequence parallelism: a sliding window of {window} shorter than the sequence "
                          f"({seq}) needs a mask, which is not built; use sequences of at most {window} tokens")
    for name in _DROPPED:
        kwargs.pop(name, None)
    heads, kv_heads = query.shape[1], key.shape[1]
    repeat = kv_replication(heads, kv_heads, comm.world_size)
    q = seq_to_heads(query, comm)  # (B, H/S, T, D)
    k = seq_to_heads(_repeat_heads(key, repeat), comm)  # (B, Hkv*r/S, T, D)
    v = seq_to_heads(_repeat_heads(value, repeat), comm)
    local = module if repeat == 1 else _LocalHeads(module, heads // (kv_heads * repeat))
    out, _ = state.inner(local, q, k, v, None, dropout=dropout, scaling=scaling, **kwargs)  # causal: module.is_causal
    out = out.transpose(1, 2)  # (B, T, H/S, D) -> (B, H/S, T, D)
    return heads_to_seq(out, comm).transpose(1, 2), None  # (B, H, T/S, D) -> (B, T/S, H, D)


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    """The modules that call the attention interface: those with the attention's head bookkeeping."""
    return [m for m in model.modules() if hasattr(m, "num_key_value_groups") or
            (hasattr(m, "is_causal") and hasattr(m, "scaling"))]


def apply_sequence_attention(model: nn.Module, comm: Communicator,
                             installed: Installed | None = None) -> SequenceAttention:
    """Switch ``model`` (a transformers decoder) to Ulysses attention over ``comm``'s SP group (in place).
    ``installed``: where the switch is recorded, to be undone by ``hfzero.unprepare`` (the model's previous
    attention implementation back, the modules' ``hfzero_sequence`` removed)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise ConfigError(f"hfzero sequence parallelism: {type(model).__name__} is not a transformers model; the "
                          "attention is replaced through transformers' attention interface")
    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError("hfzero sequence parallelism: encoder-decoder models are not supported (decoders only)")
    modules = _attention_modules(model)
    if not modules:
        raise ConfigError(f"hfzero sequence parallelism: found no attention module in {type(model).__name__}")
    heads = getattr(config, "num_attention_heads", None)
    if isinstance(heads, int):
        kv_replication(heads, getattr(config, "num_key_value_heads", None) or heads, comm.world_size)
    previous = config._attn_implementation
    if previous == NAME:
        raise ConfigError("hfzero sequence parallelism: this model already uses sequence-parallel attention")
    if previous in ALL_ATTENTION_FUNCTIONS and previous != "sdpa":
        inner, inner_name = ALL_ATTENTION_FUNCTIONS[previous], previous
    else:
        inner, inner_name = sdpa_attention_forward, "sdpa"
    AttentionInterface.register(NAME, sequence_attention)
    state = SequenceAttention(comm, inner, inner_name)
    for module in modules:
        if getattr(module, "is_causal", True) is False:
            raise ConfigError(f"hfzero sequence parallelism: {type(module).__name__} is not causal; only causal "
                              "decoders are supported")
    installed = installed or Installed()
    for module in modules:
        installed.set_attr(module, _ATTR, state)
    model.set_attn_implementation(NAME)
    installed.on_undo(lambda: model.set_attn_implementation(previous))
    if model.config._attn_implementation != NAME:
        raise ConfigError(f"hfzero sequence parallelism: {type(model).__name__} did not take the attention "
                          f"implementation {NAME!r}; it does not dispatch through transformers' AttentionInterface")
    return state
