"""Parity tolerances derived from the arithmetic, for tests that compare an fp32 run against a reference.

Two fp32 runs of the same training differ only by rounding, and by how much depends on the reduction
order, which changes with the CPU (vector width, thread count, the BLAS kernel picked), the world size
and the bucket layout. A fixed ``atol=1e-5`` holds for one machine's order and not another's: Adam
divides each gradient element by its own running RMS, so an element whose gradient nearly cancels (a
token whose contributions sum to almost nothing) turns fp32 rounding noise of ~1e-9 into updates of up
to ``lr`` per step, whichever way the noise falls.

[Note: Adam rounding bound]
``AdamRoundingBound`` follows a float64 reference run step by step and, at each step, measures the fp32
gradient's rounding error at the same parameters (``sigma``, one sample of the noise a reduction order
leaves). It propagates ``K * sigma`` through Adam to first order: the perturbation enters the first moment
as ``(1 - beta1) * K * sigma``, decays by ``beta1`` per step, and moves the update by ``lr * dm / ((1 -
beta1^s) (sqrt(v_hat_s) + eps))``, capped at twice the largest update Adam can make at step s
(``max_update_ratio``: by Cauchy-Schwarz ``|m_hat_s| / sqrt(v_hat_s) <= (1 - beta1) / sqrt(1 - beta2) *
sqrt(sum_{j<s} (beta1^2 / beta2)^j) * sqrt(1 - beta2^s) / (1 - beta1^s)``, 1.0 at s = 1 and 1.04 at s = 10
for the default betas), whatever the gradients.
Each element's bound is the sum over steps plus the rounding of the parameter updates themselves
(``3 * u32 * |theta|`` per step: the decay, the update and the store). ``K = 8`` covers another order's
noise being larger than the one sampled (rounding errors of a sum of n terms vary by a small factor with
the order) and the second-order effect of the parameters' own deviations on later gradients. Elements
whose gradients are well above rounding level get bounds of ~1e-7; the few at rounding level get up to
``2 * lr * steps``, so a real bug (a wrong lr, a missing gradient reduction) still fails everywhere else.

Micro-batches (``float64_reference(splits=n, run_splits=...)``): a run that splits each batch over ranks and
accumulated micro-batches computes every micro-batch as one fp32 computation with its own rounding (the matmul
blocking, vector widths and reduction trees a CPU's kernels pick for that shape, the log-softmax and loss mean
over the micro-batch's tokens), then sums the micro-batch gradients in an order its buckets, accumulation and
collectives pick. A whole batch's or one row's computation does not sample that rounding: on an Intel Xeon the
world-1 matrix's accumulation-2 cases (2 rows of 16 tokens per micro-batch) used 1.00 of a bound sampled at 4 rows
and at 1 row, and on an AMD EPYC the 2-row gradient error of one element in six is above both at step 0, up to
6.6x (of K = 8; tests/test_parity_bounds.py makes such a shape's rounding large). So the reference samples, at its
parameters, every split ``m`` in ``run_splits`` (ranks x accumulation of each run it judges) and the finest split
``n`` (the chunks every run's micro-batches are unions of; one row per chunk samples the most computations): (a)
per element, the sum over the ``m`` micro-batches of |fp32 - float64| micro-batch gradient, / m, in absolute value
so no chance cancellation makes it small; the sampled gradient error is the element-wise largest of these and the
whole batch's; (b) the loss as a run reports it, the mean of its fp32 micro-batch losses (bounded by the sum of
|fp32 - float64| micro-batch losses, / m), and the gradient norm as a run clips with it, the fp32 norm of the
summed fp32 micro-batch gradients, parameter by parameter as ``clip_grad_norm_`` (it was sampled at the whole
batch only); each scalar's sampled error is the largest over the splits. Added, not scaled by ``K`` since it is
already a worst case: (c) the rounding of summing the finest chunks in any order and grouping, ``(n - 1) u32 sum_k
|g_k| / n`` per element (a grouping into fewer parts sums parts whose absolute values total at most ``sum_k
|g_k|``), the same for the loss, and for the norm its largest change when every element moves by that much. With
clipping active every element is also scaled by the run's clip coefficient, off by its gradient norm's relative
bound. Without (a) and (c) the world-2 llama stage-3 accumulation-4 case ended 1.5x over the bound; with them
(sampled then at the whole batch and the finest split only), measured on the engine parity workload (10 steps, n =
16) without the feedback term: fp32 single-process runs at 1 and 2 threads within 0.38 of the bound, distributed
runs (world 2 and 4, stages 0-3, accumulation 1 and 4, no_sync) within 0.59; lr x1.01 puts 99% of the elements
over it. The cost: 2 (n + the sum of the other run splits) more forward/backward passes per reference step, on 2
(1 + the number of other run splits) batches' rows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from torch import nn

U32 = 2.0 ** -24
"""fp32 unit roundoff."""


class AdamRoundingBound:
    """Per-element bound on |fp32 run - float64 reference| after AdamW steps; see [Note: Adam rounding bound].

    Holds, per parameter element: the second moment ``v`` of the reference gradients, the bounded first
    moment perturbation ``dm`` and the accumulated bound, all float64 (3 x the model's elements).
    """

    def __init__(self, numel: int, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 k: float = 8.0, k_feedback: float = 2.0, device: torch.device | str | None = None):
        self.lr, self.betas, self.eps, self.k, self.k_feedback = lr, betas, eps, k, k_feedback
        self.steps = 0
        self.v = torch.zeros(numel, dtype=torch.float64, device=device)
        self.dm = torch.zeros(numel, dtype=torch.float64, device=device)
        self.bound = torch.zeros(numel, dtype=torch.float64, device=device)

    def cpu(self) -> "AdamRoundingBound":
        """Move the per-element tensors to the host (a reference run on an accelerator, checked on CPU copies)."""
        self.v, self.dm, self.bound = self.v.cpu(), self.dm.cpu(), self.bound.cpu()
        return self

    def shift(self, generator: torch.Generator) -> torch.Tensor:
        """A parameter deviation as large as the bound so far, with random signs: the reference's gradient
        at ``params + shift`` measures how the deviations already allowed feed into this step's gradients."""
        signs = torch.randint(0, 2, self.bound.shape, generator=generator, dtype=torch.float64) * 2 - 1
        return self.bound * signs.to(self.bound.device)

    def observe(self, grad64: torch.Tensor, grad32: torch.Tensor, params: torch.Tensor,
                shifted64: torch.Tensor | None = None, lr: float | None = None,
                extra: torch.Tensor | None = None) -> None:
        """One optimizer step: the reference's (clipped) gradient, the fp32 gradient at the same parameters,
        the parameters before the step and (``shifted64``) the reference's gradient at ``params + shift()``,
        each flat over the model's elements; ``lr``: this step's learning rate (a schedule's), default the
        constructor's; ``extra``: a worst-case gradient error bound added as is (not sampled, so not scaled by
        ``k``)."""
        lr = self.lr if lr is None else lr
        beta1, beta2 = self.betas
        self.steps += 1
        sigma = self.k * (grad32.double() - grad64).abs()
        if shifted64 is not None:
            sigma += self.k_feedback * (shifted64 - grad64).abs()
        if extra is not None:
            sigma += extra
        self.v.mul_(beta2).add_((1 - beta2) * grad64.square())
        self.dm.mul_(beta1).add_((1 - beta1) * sigma)
        v_hat = self.v / (1 - beta2 ** self.steps)
        update = lr * self.dm / ((1 - beta1 ** self.steps) * (v_hat.sqrt() + self.eps))
        cap = 2 * lr * max_update_ratio(self.steps, self.betas)
        self.bound.add_(update.clamp(max=cap)).add_(3 * U32 * params.double().abs())

    def check(self, got: torch.Tensor, reference: torch.Tensor, what: str = "parameters") -> None:
        """Assert ``|got - reference| <= bound`` element-wise, naming the worst element on failure."""
        excess = (got.double() - reference.double()).abs() - self.bound
        worst = int(excess.argmax())
        assert excess[worst] <= 0, (
            f"{what}: element {worst} is {abs(float(got[worst]) - float(reference[worst])):.3g} from the float64 "
            f"reference, over its rounding bound {float(self.bound[worst]):.3g} "
            f"({int((excess > 0).sum())} element(s) over)")


def max_update_ratio(step: int, betas: tuple[float, float]) -> float:
    """The largest ``|m_hat| / sqrt(v_hat)`` Adam can reach at ``step`` (1-based), any gradients."""
    beta1, beta2 = betas
    decay = sum((beta1 ** 2 / beta2) ** j for j in range(step))
    return (1 - beta1) / (1 - beta2) ** 0.5 * decay ** 0.5 * (1 - beta2 ** step) ** 0.5 / (1 - beta1 ** step)


def scalar_bound(value64: float, value32: float, shifted64: float | None = None, *, k: float = 8.0,
                 k_feedback: float = 2.0) -> float:
    """The bound on |fp32 - float64| of a scalar the run reports (a loss, a gradient norm) at one step, as
    ``AdamRoundingBound`` bounds parameters: ``k`` x the fp32 rounding error sampled at the reference's
    parameters (at least one unit roundoff of the value: a sample can land on zero error by chance) plus
    ``k_feedback`` x its change when the parameters move by the bound so far."""
    bound = k * (abs(value32 - value64) + U32 * abs(value64))
    if shifted64 is not None:
        bound += k_feedback * abs(shifted64 - value64)
    return bound


def flat(model: nn.Module, attr: str | None = None) -> torch.Tensor:
    """The model's parameters (``attr="grad"``: their gradients) as one flat tensor, in parameters() order."""
    return torch.cat([(getattr(p, attr) if attr else p).detach().reshape(-1) for p in model.parameters()])


def step_gradients(model: nn.Module, ids: torch.Tensor, clip: float | None,
                   params: torch.Tensor | None = None) -> tuple[float, float, torch.Tensor]:
    """(loss, gradient norm, flat gradient clipped to ``clip``) of a causal LM on ``ids``, at ``params``
    (flat, loaded first) if given."""
    if params is not None:
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(params.to(next(model.parameters()).dtype), model.parameters())
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip is not None else float("inf"))
    return loss.item(), norm.item(), flat(model, "grad")


@dataclasses.dataclass
class ParityReference:
    """A float64 run's per-step losses and gradient norms with their fp32 bounds, its final parameters (flat
    and by name) and the per-parameter bound."""

    losses: list[float]
    norms: list[float]
    loss_bounds: list[float]
    norm_bounds: list[float]
    params: torch.Tensor
    bound: AdamRoundingBound
    names: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)
    """(name, start, end) of each parameter in the flat tensors."""

    def param(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(float64 value, bound) of parameter ``name``, in its shape."""
        for n, start, end in self.names:
            if n == name:
                return self.params[start:end], self.bound.bound[start:end]
        raise KeyError(name)

    def worst(self, losses: list[float], params: dict[str, torch.Tensor] | None = None,
              first: int = 0) -> tuple[float, str]:
        """The largest |got - float64| / bound over the losses (from step ``first``) and parameter elements, and
        where it is ("loss step 0", "name[index]"): how much of the bound a run used and by what (the margin
        evidence a tolerance change records)."""
        worst, where = 0.0, "nothing"
        for step, (got, want, tol) in enumerate(zip(losses, self.losses[first:], self.loss_bounds[first:]),
                                                start=first):
            if abs(got - want) / tol > worst:
                worst, where = abs(got - want) / tol, f"loss step {step}"
        for name, start, end in self.names if params is not None else ():
            diff = (params[name].reshape(-1).double() - self.params[start:end]).abs()
            ratio = torch.where(diff == 0, 0.0, diff / self.bound.bound[start:end])  # 0 / 0: exact, 0
            index = int(ratio.argmax())
            if float(ratio[index]) > worst:
                worst, where = float(ratio[index]), f"{name}[{index}]"
        return worst, where

    def check_losses(self, losses: list[float], what: str = "loss", first: int = 0) -> None:
        """Each loss within its bound of the float64 one; ``first``: the step ``losses`` start at (a resumed run)."""
        for step, (got, want, tol) in enumerate(zip(losses, self.losses[first:], self.loss_bounds[first:], strict=True),
                                                start=first):
            assert abs(got - want) <= tol, f"step {step}: {what} {got} vs float64 {want}, bound {tol:.3g}"

    def check_norms(self, norms: list[float]) -> None:
        for step, (got, want, tol) in enumerate(zip(norms, self.norms, self.norm_bounds, strict=True)):
            assert abs(got - want) <= tol, f"step {step}: gradient norm {got} vs float64 {want}, bound {tol:.3g}"

    def check_params(self, params: dict[str, torch.Tensor], what: str = "") -> None:
        """Each named parameter within its bound of the float64 value."""
        for name, start, end in self.names:
            got = params[name].reshape(-1).double()
            excess = (got - self.params[start:end]).abs() - self.bound.bound[start:end]
            worst = int(excess.argmax())
            assert excess[worst] <= 0, (
                f"{what}{name}[{worst}] is {float((got[worst] - self.params[start + worst]).abs()):.3g} from the "
                f"float64 reference, over its rounding bound {float(self.bound.bound[start + worst]):.3g} "
                f"({int((excess > 0).sum())} element(s) over)")


def float64_reference(model: nn.Module, optimizer_factory, batches: list[torch.Tensor], clip: float | None,
                      scheduler_factory=None, seed: int = 0, splits: int | None = None,
                      run_splits: Sequence[int] = (1,)) -> ParityReference:
    """Train ``model`` (fp32 weights, cast to float64 here) on the whole ``batches`` with the optimizer
    ``optimizer_factory(model)`` (AdamW with default betas and eps; ``scheduler_factory(optimizer)`` an LR
    schedule), and bound the fp32 runs of the same training that compute each step's gradient as the mean of
    ``m`` micro-batch gradients (contiguous rows, equal sizes: data parallel ranks x accumulated micro-batches)
    for each ``m`` in ``run_splits``, summed in any order and grouping; ``splits``: the finest split, whose
    chunks every run's micro-batches are unions of (default: the least common multiple of ``run_splits``; one
    row per chunk is the most conservative). See [Note: Adam rounding bound]. Runs on the model's device (the
    batches' too); the reference's parameters and bounds come back on the host."""
    import copy

    splits = splits if splits is not None else math.lcm(*run_splits)
    if any(ids.shape[0] % splits for ids in batches):
        raise ValueError(f"splits={splits} must divide every batch's rows (the finest micro-batch split of the runs)")
    if any(splits % m for m in run_splits):
        raise ValueError(f"run_splits={tuple(run_splits)}: every run's micro-batches must be unions of the "
                         f"splits={splits} finest chunks (each run split divides it)")
    sampled = sorted((set(run_splits) | {splits}) - {1})  # the whole batch (1): the probe's own sample
    model = model.double()
    probe, shifted = copy.deepcopy(model).float(), copy.deepcopy(model)
    optimizer = optimizer_factory(model)
    scheduler = scheduler_factory(optimizer) if scheduler_factory is not None else None
    lr = optimizer.param_groups[0]["lr"]
    bound = AdamRoundingBound(sum(p.numel() for p in model.parameters()), lr,
                              device=next(model.parameters()).device)
    names, start = [], 0
    for name, p in model.named_parameters():
        names.append((name, start, start + p.numel()))
        start += p.numel()
    signs = torch.Generator().manual_seed(seed)
    ref = ParityReference([], [], [], [], torch.empty(0), bound, names)
    for ids in batches:
        params = flat(model).clone()
        loss, norm, grad = step_gradients(model, ids, clip)
        loss32, norm32, grad32 = step_gradients(probe, ids, clip, params)
        loss_shifted, norm_shifted, grad_shifted = step_gradients(shifted, ids, clip, params + bound.shift(signs))
        coef = min(1.0, clip / (norm + 1e-6)) if clip is not None else 1.0  # the clip coefficient, as torch's
        error, loss_error, norm_error = (grad32.double() - grad).abs(), abs(loss32 - loss), abs(norm32 - norm)
        grad_sum = torch.zeros_like(grad)
        loss_sum = norm_sum = 0.0
        for m in sampled:
            sample = _split_sample(shifted, probe, ids, m, params)
            error = torch.maximum(error, coef * sample.grad_error)
            loss_error, norm_error = max(loss_error, sample.loss_error), max(norm_error, sample.norm_error)
            if m == splits:
                grad_sum, loss_sum = (splits - 1) * U32 * sample.grad_abs, (splits - 1) * U32 * sample.loss_abs
                unclipped = grad.abs() / coef
                norm_sum = float(torch.linalg.vector_norm(unclipped + grad_sum) - torch.linalg.vector_norm(unclipped))
        norm_bound = scalar_bound(norm, norm + norm_error, norm_shifted) + norm_sum
        loss_bound = scalar_bound(loss, loss + loss_error, loss_shifted) + loss_sum
        extra = coef * grad_sum
        if clip is not None and norm > clip:
            # the run's clip coefficient clip / norm is off by the relative error of its norm
            extra += norm_bound / norm * grad.abs()
        bound.observe(grad, grad + error, params, grad_shifted, lr=optimizer.param_groups[0]["lr"], extra=extra)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        ref.losses.append(loss)
        ref.norms.append(norm)
        ref.loss_bounds.append(loss_bound)
        ref.norm_bounds.append(norm_bound)
    ref.params = flat(model).cpu()
    bound.cpu()
    return ref


@dataclasses.dataclass
class _SplitSample:
    """The fp32 rounding of one micro-batch split of a batch, at the reference's parameters: what a run that
    computes each micro-batch as one fp32 computation carries, in the absolute values that a chance
    cancellation cannot make small."""

    grad_error: torch.Tensor
    """Sum over micro-batches of |fp32 - float64| micro-batch gradient (unclipped), / splits."""
    grad_abs: torch.Tensor
    """Sum over micro-batches of |float64 micro-batch gradient|, / splits."""
    loss_error: float
    """Sum over micro-batches of |fp32 - float64| micro-batch loss, / splits: at least the error of the mean of
    the fp32 micro-batch losses a run reports."""
    loss_abs: float
    """Sum over micro-batches of |float64 micro-batch loss|, / splits."""
    norm_error: float
    """|fp32 - float64| norm of the mean micro-batch gradient, the fp32 one as a run clips with it: of its summed
    fp32 micro-batch gradients, parameter by parameter (``clip_grad_norm_``)."""


def _split_sample(model64: nn.Module, probe32: nn.Module, ids: torch.Tensor, splits: int,
                  params: torch.Tensor) -> _SplitSample:
    """The micro-batch gradients and losses of ``ids`` split in ``splits`` at ``params``, float64 and fp32; uses
    ``model64`` and ``probe32`` as scratch (their parameters are overwritten)."""
    grad_error = torch.zeros_like(params)
    grad_abs = torch.zeros_like(params)
    sum64 = torch.zeros_like(params)
    sum32 = torch.zeros_like(params, dtype=torch.float32)
    loss_error = loss_abs = 0.0
    for index, rows in enumerate(ids.chunk(splits)):
        loss64, _, g64 = step_gradients(model64, rows, None, params if index == 0 else None)
        loss32, _, g32 = step_gradients(probe32, rows, None, params if index == 0 else None)
        grad_error += (g32.double() - g64).abs()
        grad_abs += g64.abs()
        sum64 += g64
        sum32 += g32
        loss_error += abs(loss32 - loss64)
        loss_abs += abs(loss64)
    # the norm as clip_grad_norm_ computes it, parameter by parameter (one fp32 norm of all ~3e4 elements at once
    # rounds ~10x worse, and no run computes it so)
    sizes = [p.numel() for p in probe32.parameters()]
    norm32 = torch.nn.utils.get_total_norm(list((sum32 / splits).split(sizes)))
    norm_error = abs(float(norm32) - float(torch.linalg.vector_norm(sum64 / splits)))
    return _SplitSample(grad_error / splits, grad_abs / splits, loss_error / splits, loss_abs / splits, norm_error)
