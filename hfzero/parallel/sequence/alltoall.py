"""The differentiable all-to-all of Ulysses attention: sequence-sharded <-> head-sharded.

Each of the S ranks of an SP group holds a chunk of T / S positions with all H heads; attention needs
every position of a subset of heads. ``seq_to_heads`` turns (B, H, T/S, D) into (B, H/S, T, D) (rank j
keeps head group j of every rank's chunk, chunks in SP-rank order = sequence order); ``heads_to_seq`` is
its inverse. Each is the other's backward, so gradients flow back to the rank that owns the positions.
Transient memory: one (send, receive) pair of the tensor's size per call, freed when it returns.
"""

from __future__ import annotations

from typing import Any

import torch

from hfzero.comm.collectives import Communicator


def _seq_to_heads(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    s = comm.world_size
    b, h, t, d = x.shape  # (B, H, T/S, D)
    send = x.reshape(b, s, h // s, t, d).transpose(0, 1).contiguous()  # (S, B, H/S, T/S, D): group j to rank j
    received = torch.empty_like(send)  # (S, B, H/S, T/S, D): chunk i from rank i
    comm.all_to_all(received, send)
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // s, s * t, d)  # (B, H/S, T, D)


def _heads_to_seq(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    s = comm.world_size
    b, h, t, d = x.shape  # (B, H/S, T, D)
    send = x.reshape(b, h, s, t // s, d).permute(2, 0, 1, 3, 4).contiguous()  # (S, B, H/S, T/S, D): chunk j to rank j
    received = torch.empty_like(send)  # (S, B, H/S, T/S, D): head group i from rank i
    comm.all_to_all(received, send)
    return received.transpose(0, 1).reshape(b, s * h, t // s, d)  # (B, H, T/S, D)


class _AllToAll(torch.autograd.Function):
    """One all-to-all re-sharding, its inverse in backward (``_seq_to_heads`` and ``_heads_to_seq`` undo each
    other)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, to_heads: bool) -> torch.Tensor:
        ctx.comm, ctx.to_heads = comm, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return (_heads_to_seq if ctx.to_heads else _seq_to_heads)(grad, ctx.comm), None, None


def seq_to_heads(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """(B, H, T/S, D) sequence-sharded -> (B, H/S, T, D) head-sharded over ``comm``'s S ranks (differentiable)."""
    if x.shape[1] % comm.world_size:
        raise ValueError(f"seq_to_heads: {x.shape[1]} heads do not split over {comm.world_size} ranks")
    return _AllToAll.apply(x, comm, True)


def heads_to_seq(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """(B, H/S, T, D) head-sharded -> (B, H, T/S, D) sequence-sharded (differentiable)."""
    if x.shape[2] % comm.world_size:
        raise ValueError(f"heads_to_seq: {x.shape[2]} positions do not split over {comm.world_size} ranks")
    return _AllToAll.apply(x, comm, False)
