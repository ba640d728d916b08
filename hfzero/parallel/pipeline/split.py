"""Split a Hugging Face decoder into pipeline stages at decoder-block boundaries.

[Note: pipeline stage modules]
A stage module holds the HF model's own submodules under their HF qualified names (the stage of
blocks 2-3 of a Llama holds ``model.layers.2`` and ``model.layers.3``, the first stage also
``model.embed_tokens``, the last ``model.norm`` and ``lm_head``), so ``named_parameters()`` of a stage
lists the names the whole model has: checkpoints, the manifest and HF export need no renaming.
Stage 0 maps input ids (B, T) to hidden states (B, T, H); a middle stage maps hidden states to hidden
states; the last stage maps hidden states to logits (B, T, V); the loss is the schedule's loss_fn.
Tied input/output embeddings: the first and the last stage both hold the same weight (under the
embedding's name and under ``lm_head.weight``); the driver sums its gradient between those two
stages (as Megatron does). Attention masks are not carried: sequences must be unpadded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from hfzero.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Family:
    """Where a model family keeps its pieces (qualified module names).

    Attributes:
        blocks: the ModuleList of decoder blocks.
        first: modules of the first stage besides blocks (embeddings).
        last: modules of the last stage besides blocks (final norm, LM head).
        every: parameter-free modules every stage needs (rotary embeddings).
    """

    name: str
    blocks: str
    first: tuple[str, ...]
    last: tuple[str, ...]
    every: tuple[str, ...] = ()


LLAMA = Family("llama", "model.layers", ("model.embed_tokens",), ("model.norm", "lm_head"), ("model.rotary_emb",))
GPT2 = Family("gpt2", "transformer.h", ("transformer.wte", "transformer.wpe", "transformer.drop"),
              ("transformer.ln_f", "lm_head"))

FAMILIES: dict[str, Family] = {"LlamaForCausalLM": LLAMA, "GPT2LMHeadModel": GPT2}
"""Model classes that can be split (class name -> family). Tested: Llama (tied and untied) and GPT-2."""


def family_of(model: nn.Module) -> Family:
    """The family of ``model``; a clear error listing what is supported otherwise."""
    family = FAMILIES.get(type(model).__name__)
    if family is None:
        raise ConfigError(f"hfzero pipeline: cannot split {type(model).__name__} into pipeline stages; supported "
                          f"model classes: {', '.join(sorted(FAMILIES))}")
    return family


def _block_params(model: nn.Module, family: Family) -> list[int]:
    return [sum(p.numel() for p in block.parameters()) for block in model.get_submodule(family.blocks)]


def _edge_params(model: nn.Module, names: Sequence[str]) -> int:
    return sum(p.numel() for n in names for p in model.get_submodule(n).parameters())


def balance(weights: Sequence[int], stages: int, first_extra: int = 0, last_extra: int = 0) -> list[int]:
    """Blocks per stage (contiguous, at least one each) minimizing the largest stage's parameter count,
    the first stage carrying ``first_extra`` and the last ``last_extra`` more; ties favour earlier stages."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[s][i]: smallest max load placing blocks [0, i) on stages [0, s)
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                load = prefix[i] - prefix[j] + (first_extra if s == 1 else 0) + (last_extra if s == stages else 0)
                value = max(best[s - 1][j], load)
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    counts, i = [], n
    for s in range(stages, 0, -1):
        j = cut[s][i]
        counts.append(i - j)
        i = j
    return counts[::-1]


def plan_stages(model: nn.Module, num_stages: int, layers_per_stage: Sequence[int] | None = None) -> list[list[int]]:
    """Block indices of each stage: balanced by parameter count, or ``layers_per_stage`` blocks each."""
    family = family_of(model)
    weights = _block_params(model, family)
    n = len(weights)
    if num_stages > n:
        raise ConfigError(f"hfzero pipeline: {num_stages} stages but the model has only {n} decoder blocks; "
                          f"use at most {n} stages (each stage holds at least one block)")
    if layers_per_stage is None:
        counts = balance(weights, num_stages, _edge_params(model, family.first), _edge_params(model, family.last))
    else:
        counts = list(layers_per_stage)
        if len(counts) != num_stages or any(not isinstance(c, int) or c < 1 for c in counts) or sum(counts) != n:
            raise ConfigError(f"hfzero pipeline: layers_per_stage={counts} must list {num_stages} positive block "
                              f"counts summing to the model's {n} decoder blocks")
    starts = [sum(counts[:s]) for s in range(num_stages)]
    return [list(range(start, start + count)) for start, count in zip(starts, counts)]


class _Holder(nn.Module):
    """A plain container giving submodules their HF qualified names (``model``, ``transformer``)."""


class _Blocks(nn.ModuleDict):
    """This stage's decoder blocks keyed by their index in the whole model (``model.layers.5``)."""


def _attach(root: nn.Module, name: str, module: nn.Module) -> None:
    *path, leaf = name.split(".")
    holder = root
    for part in path:
        if not hasattr(holder, part):
            holder.add_module(part, _Holder())
        holder = getattr(holder, part)
    holder.add_module(leaf, module)


class DecoderStage(nn.Module):
    """One pipeline stage of a HF decoder; see [Note: pipeline stage modules].

    Attributes (besides the HF submodules): ``family``, ``config`` (the HF config), ``stage_index``,
    ``num_stages``, ``block_ids`` (indices of this stage's blocks in the whole model), ``is_first``,
    ``is_last``, ``tied_name`` (the tied embedding's name in this stage, or None).
    """

    def __init__(self, model: nn.Module, stage_index: int, num_stages: int, block_ids: Sequence[int]):
        super().__init__()
        self.family = family_of(model)
        self.config = model.config
        self.stage_index, self.num_stages = stage_index, num_stages
        self.block_ids = list(block_ids)
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        blocks = model.get_submodule(self.family.blocks)
        _attach(self, self.family.blocks, _Blocks({str(i): blocks[i] for i in self.block_ids}))
        names = list(self.family.every)
        names += list(self.family.first) if self.is_first else []
        names += list(self.family.last) if self.is_last else []
        for name in names:
            _attach(self, name, model.get_submodule(name))
        self.tied_name = None
        if tied_embeddings(model) and (self.is_first or self.is_last):
            self.tied_name = self.family.first[0] + ".weight" if self.is_first else "lm_head.weight"

    @property
    def block_names(self) -> list[str]:
        """Qualified names of this stage's blocks (the stage-3 units)."""
        return [f"{self.family.blocks}.{i}" for i in self.block_ids]

    @property
    def hfzero_block_names(self) -> list[str]:
        """The same names, under the attribute ``hfzero.compile_regions`` looks for (runtime/compile.py's
        ``BLOCKS_ATTR``): the blocks it compiles."""
        return self.block_names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T) ids on the first stage, else (B, T, H) hidden -> (B, T, H) hidden, or (B, T, V) logits last."""
        if self.is_first:
            x = self._embed(x)
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)  # (1, T)
        kwargs = self._block_kwargs(x, positions)
        for block in self.get_submodule(self.family.blocks).values():
            x = block(x, **kwargs)
            x = x[0] if isinstance(x, tuple) else x
        if self.is_last:
            return self._head(x)
        # A tensor of its own: at stage 3 the root (this module) and the last block hook their outputs'
        # gradients; on one shared tensor the root's hook would run second and finish (release) the
        # block before its backward ran. Not a view (zero-bubble schedules detach outputs in place);
        # the clone saves nothing for backward and the block's output is freed, so memory is unchanged.
        return x.clone()

    # ---- family specifics -----------------------------------------------------------------------
    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.family is GPT2:
            t = self.transformer
            positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
            return t.drop(t.wte(ids) + t.wpe(positions))
        return self.model.embed_tokens(ids)

    def _block_kwargs(self, x: torch.Tensor, positions: torch.Tensor) -> dict:
        from transformers.masking_utils import create_causal_mask

        mask = create_causal_mask(config=self.config, inputs_embeds=x, attention_mask=None, past_key_values=None,
                                  position_ids=positions)
        if self.family is GPT2:
            return {"attention_mask": mask, "position_ids": positions, "use_cache": False}
        return {"attention_mask": mask, "position_ids": positions, "use_cache": False,
                "position_embeddings": self.model.rotary_emb(x, position_ids=positions)}

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.transformer.ln_f if self.family is GPT2 else self.model.norm
        return self.lm_head(norm(x))


def tied_embeddings(model: nn.Module) -> bool:
    """True when the model's input and output embeddings are one parameter."""
    out = model.get_output_embeddings()
    return out is not None and out.weight is model.get_input_embeddings().weight


def split_model(model: nn.Module, stage_ids: Sequence[int], num_stages: int,
                layers_per_stage: Sequence[int] | None = None) -> list[DecoderStage]:
    """The stage modules ``stage_ids`` (of ``num_stages``) of ``model``; they share its submodules."""
    if getattr(model.config, "use_cache", False):
        model.config.use_cache = False
    plan = plan_stages(model, num_stages, layers_per_stage)
    return [DecoderStage(model, s, num_stages, plan[s]) for s in stage_ids]
