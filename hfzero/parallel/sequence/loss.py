"""The loss of a split sequence: each rank's chunk, reported as the SP group's.

[Note: sequence-parallel gradients]
Rank r of an SP group computes l_r = (sum of its chunk's token losses) / N, N the group's target count
(data.py), so L = sum_r l_r is the token-weighted mean of the whole sequences, as the unsplit model
computes it. Each rank backpropagates its own l_r; the all-to-alls' backward carries the cotangents of
positions another rank attended to back to their owner, so rank r's parameter gradient is dL/d(theta as
used on rank r) and the gradient of L is the SUM over the group. The ZeRO engine reduces (sums) over all
dp x sp ranks and divides by ``average_over`` = dp: the mean over the dp replicas of each replica's L, which
is what DDP over dp ranks with the same global batch computes.
``group_loss`` makes the value every rank sees L (one all-reduce of a scalar over the SP group, no host
read) while its gradient stays l_r's, so logged losses equal the unsplit ones and backward stays local.
"""

from __future__ import annotations

from typing import Any

import torch

from hfzero.comm.collectives import Communicator


class _GroupValue(torch.autograd.Function):
    """Forward: the sum of ``loss`` over the group; backward: the gradient passes to the local ``loss``."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, comm: Communicator) -> torch.Tensor:
        total = loss.detach().clone()
        comm.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def group_loss(loss: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """``loss`` (this rank's share l_r) with the SP group's total as its value. See [Note: sequence-parallel
    gradients]. Every rank of the group calls it at the same point (each forward with labels)."""
    return _GroupValue.apply(loss, comm)
