"""Stage-3 hooks: gather before a unit's forward and backward, release after, prefetch in recorded order.

[Note: stage-3 gather order]
Gathers are collectives, so every rank must gather the same units in the same order. They run on the
data-parallel group's one communicator, with the gradient reduce-scatters (See [Note: one communicator
per data-parallel group] in engine.py); the reductions are launched only at rank-independent points of
the backward pass (when it moves on to the next unit, and at its end), so the interleaving of the two
sequences is the same on every rank too (see [Note: collective order across ranks] in reducer.py).
Within a pass (one forward of the root, or one backward) a unit is gathered on demand by its forward
pre-hook (forward) or by a pre-hook on the autograd nodes of its forward outputs (backward), and the next units of
the order recorded in the previous pass of the same kind are prefetched: the next unit always, whatever its
size (a decoder block of a 1B-parameter model, ~61M elements, is larger than any budget, and gathering
it on demand would serialize every gather with compute), and the units after it within
``allgather_bucket_size`` elements of not-yet-used gathered units. So at most the root, the unit in use
and max(the next unit, the budget) are gathered at once: root + the two largest other units when every
unit is larger than the budget (the estimator's and the profile's transient).
A pass that departs from the recorded order stops prefetching (the rest is gathered on demand) and
becomes the new recorded order; prefetched units it did not use are released when the pass ends.
A submodule of a unit called on its own (``model.get_encoder()(...)``, ``lm_head(h)``, an embedding
called by ``generate``) gathers its unit around that call through the same path (same order check),
so a unit is gathered whenever any part of it runs, not only through the root's forward.
[Note: prefetch across micro-batches]
Under pipeline parallelism with per-micro-batch gathering (``stage3_gather="micro"``) a stage runs many
passes per step (one forward and one backward per micro-batch, in the schedule's order), and every pass
gathers its units anew. The driver brackets each step with ``begin_planned_step(plan)`` /
``end_planned_step()``, ``plan`` being the kinds of the passes the previous step with the same schedule
ran (forward, backward, ...). When a pass reaches the last unit of its recorded order, the scheduler
looks up the next pass's kind in the plan and starts gathering the first unit of that pass's recorded
order (after the root) that is sharded now, whatever its size (it is the next unit): that gather
overlaps the last unit's compute and whatever the schedule does between the passes (P2P waits, the
loss). The unit is carried across the pass end (not released) and used by the next pass; one carried
but unused (a schedule that departed from the plan) is released at the end of that next pass, and
``end_planned_step`` releases anything still carried before the optimizer step (the gathered values
must never outlive the step). A unit gathered now is never carried: it is released and gathered again
as usual, so each unit is gathered exactly as often as without the prefetch (the communication stays 2M
x Ψ_s elements per step, the cost model's). Decisions depend on the recorded orders and the plan only,
the same on every rank of the stage's group, so the gathers keep their order across ranks. The
first step (no plan yet) and passes outside a planned step never prefetch across passes.

With ``verify=True`` the order is checked: while an order is being recorded (the first pass of each
kind) every gather is preceded by a tiny all-gather of the unit's index (a host synchronization per
gather, in that first step only), so ranks that differ from the start raise GatherOrderError before
mixing shards. Afterwards a training pass (a forward with gradients enabled, a backward) only folds a
signature of the units it gathered into ``fingerprint``, which the optimizer step checks in its one
collective (See [Note: stage-3 step check] in step_check.py): a rank that departs from a recorded
order is caught there, on every rank, before anything is applied, unless a mismatched collective (of
another size or kind: with one communicator, a gather may meet another rank's reduction) failed first.
A forward without gradients (evaluation, ``generate``) ends with an all-gather of its signature, as
before (one host synchronization per such pass: no step follows it).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hfzero.comm.collectives import Communicator
from hfzero.logging import get_logger
from hfzero.runtime.compile import compilations, eager_hook, holds_compiled_region
from hfzero.runtime.lifetime import WeakHook
from hfzero.runtime.tensors import iter_tensors
from hfzero.runtime.reducer import FAILED_PASS_MESSAGE
from hfzero.runtime.stage3.entry_hooks import EntryHooks
from hfzero.runtime.stage3.unit import GatherUnit, UnitState
from hfzero.runtime.torch_api import graph_task_id, queue_backward_callback

logger = get_logger(__name__)

_END_FORWARD = -1
_END_BACKWARD = -2
_HISTORY = 256
"""Training passes per step whose gathers are kept for a GatherOrderError's message (the fingerprint covers all)."""


class GatherOrderError(RuntimeError):
    """Ranks asked for different stage-3 units at the same point (their forward or backward differed)."""


class Phase(enum.Enum):
    """IDLE: no pass running. FORWARD: inside the root's forward. BACKWARD: inside a backward pass."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class _Pass:
    """Bookkeeping of one forward or backward pass: the units it used and gathered, in order."""

    def __init__(self, recorded: list[int], training: bool):
        self.recorded = recorded
        self.training = training
        """A forward with gradients enabled, or a backward: checked at the step (See [Note: stage-3 step check])."""
        self.seen: list[int] = []
        self.seen_set: set[int] = set()
        self.issued: list[int] = []
        """Units whose gather this pass launched (prefetched ones included): what must match across ranks."""
        self.diverged = False


class UnitScheduler:
    """Registers the hooks of every unit and decides when each is gathered and released."""

    def __init__(self, units: list[GatherUnit], verify_comm: Communicator | None, prefetch_numel: int):
        self.units = units
        self.root = units[0]
        self.verify_comm = verify_comm
        self.prefetch_numel = prefetch_numel
        self.phase = Phase.IDLE
        self._secondary_window = False
        """From a training forward's start until its backward begins: releases keep hpZ's secondary partition
        (See [Note: secondary partition] in unit.py)."""
        self.orders: dict[Phase, list[int]] = {Phase.FORWARD: [], Phase.BACKWARD: []}
        self._pass: _Pass | None = None
        self._in_use: list[int] = []  # units between their pre- and post-forward (a stack)
        self._backward_seen: set[int] = set()
        self._finished: set[int] = set()
        self._finish_from = 0  # units of the backward pass's ``seen`` before this index are finished
        self._gathered: dict[int, GatherUnit] = {}
        """Units gathered through ``_issue`` and maybe not released yet (a superset of the gathered ones:
        entries are dropped when found sharded), so per-use work scans what is gathered, not every unit."""
        self._backward_hooks: dict[int, Callable[[torch.Tensor], None]] = {}  # per unit, made once
        self._graph_task = -1
        self.on_unit_done: Callable[[GatherUnit], None] | None = None
        """Called when the backward pass is done with a unit (engine: launch its buckets' reductions)."""
        self.on_unit_backward: Callable[[GatherUnit], None] | None = None
        """Called when the backward pass reaches a unit, once it is gathered (engine: point its parameters' gradients
        at their staging slots: See [Note: gradients in place] in reducer.py)."""
        self.on_backward_begin: Callable[[], None] | None = None
        """Called when a backward pass starts, before any unit's ``on_unit_backward``."""
        self.on_backward_end: Callable[[], None] | None = None
        """Called when a backward pass ends, after the last ``on_unit_done`` (engine: take the gradients left)."""
        self.keep_gathered = False
        """When True, units stay gathered after use until ``release_all()`` (called by the step's
        ``publish_params``): gather once per step for all micro-batches (the pipeline's "step" policy)."""
        self.pass_plan: list[Phase] = []
        """The kinds of the passes of the previous planned step; see [Note: prefetch across micro-batches]."""
        self._step_passes: list[Phase] | None = None  # kinds of this planned step's passes so far (None: no step)
        self._carry: set[int] = set()  # units gathered for the next pass: kept across this pass's end
        self.fingerprint = 0
        """Signatures of the training passes since the last step check, folded (See [Note: stage-3 step check])."""
        self._history: list[list[int]] = []  # those passes' [marker, *issued units], for the error message
        self.cross_prefetches = 0
        """Units gathered ahead for the next pass so far (a count, for tests and benchmarks)."""
        self.events: list[tuple[str, str]] | None = None
        """When a list (``trace(True)``), ("gather"|"wait"|"release"|"forward"|"forward_end"|
        "backward", unit name) events are appended in the order they happen."""
        self._entered: list[nn.Module] = []  # submodules that gathered their unit on demand (a stack)
        self._handles = []
        self._compiled_seen = -1  # ``compilations()`` when ``_compiled_units`` was made
        self._compiled_units: set[int] = set()
        """Units a compiled region runs the body of (``_runs_compiled``)."""
        self.entry_hooks = EntryHooks()
        """The submodules' pre-hooks that gather a unit called outside its forward, off while it is in use (See
        [Note: entry hooks off inside the unit] in entry_hooks.py)."""
        # weak: a hook never keeps the scheduler (and its engine) alive (See [Note: engine lifetime]); eager: a graph
        # boundary under torch.compile (See [Note: compiled regions] in runtime/compile.py)
        for unit in units:
            self._handles.append(unit.module.register_forward_pre_hook(
                eager_hook(WeakHook(self._hook_pre_forward, unit.index)), with_kwargs=True))
            self._handles.append(unit.module.register_forward_hook(
                eager_hook(WeakHook(self._hook_post_forward, unit.index))))
            for module in _entry_modules(unit, units):
                probe = next(p for p in module.parameters() if any(p is q for q in unit.params))
                self.entry_hooks.register(unit.index, module, self._hook_pre_submodule(unit, probe))

    # ---- public ---------------------------------------------------------------------------------
    def trace(self, enabled: bool) -> None:
        """Start (or stop) recording events in ``self.events``."""
        self.events = [] if enabled else None

    def gathered_numel(self) -> int:
        return sum(u.numel for u in self.units if u.state is not UnitState.SHARDED)

    def release_all(self) -> None:
        """Release every unit and drop hpZ's secondary partitions (the parameters are about to change)."""
        self._carry.clear()
        self._secondary_window = False
        for unit in self.units:
            unit.release()
            unit.drop_secondary()

    def _release(self, unit: GatherUnit) -> None:
        """Release ``unit``, keeping its secondary partition inside a training forward (hpZ; See [Note:
        secondary partition] in unit.py)."""
        unit.release(keep_secondary=self._secondary_window)

    def begin_planned_step(self, plan: list[Phase] | None) -> None:
        """Start a step whose passes follow ``plan`` (the kinds of the previous such step's passes, or None
        for the first); see [Note: prefetch across micro-batches]."""
        self.pass_plan = list(plan or [])
        self._step_passes = []

    def end_planned_step(self) -> list[Phase]:
        """End the planned step: release units still carried for a pass that did not come, and return the
        kinds of the passes the step ran (the next step's plan)."""
        passes, self._step_passes, self.pass_plan = self._step_passes or [], None, []
        for index in sorted(self._carry):
            self._log("release", self.units[index])
            self._release(self.units[index])
        self._carry.clear()
        return passes

    def gather_now(self, unit: GatherUnit) -> None:
        """Gather ``unit`` synchronously outside any pass (collective: every rank must call it), exactly even with
        qwZ: state dicts and frozen copies read it (See [Note: quantized collectives] in hfzero/comm/quantized.py)."""
        self._issue(unit, exact=True)
        unit.wait()

    def abort_pass(self) -> None:
        """Forget a forward or backward pass that raised before its end: release every gathered unit
        (waiting for gathers in flight) and go back to IDLE; recorded orders stay."""
        self._pass = None
        self.phase = Phase.IDLE
        self._in_use.clear()
        self.entry_hooks.put_back_all()
        self._backward_seen = set()
        self._finished = set()
        self._finish_from = 0
        self._step_passes = None if self._step_passes is None else []  # no plan after a failed pass
        self.pass_plan = []
        self.release_all()

    # ---- hooks ----------------------------------------------------------------------------------
    def _hook_pre_forward(self, index: int, module: nn.Module, args: Any, kwargs: Any) -> None:
        """Unit ``index``'s forward pre-hook: gather it (the root's starts a forward pass)."""
        unit = self.units[index]
        if unit is self.root and self.phase is Phase.FORWARD and self.root.index in self._in_use:
            logger.warning("stage 3: the previous forward pass raised before its end; its gathered units "
                           "are released and this forward starts afresh")
            self.abort_pass()
        if self._recomputing(index):
            return
        if unit is self.root and self.phase is Phase.IDLE:
            self.phase = Phase.FORWARD
            self._pass = _Pass(self.orders[Phase.FORWARD], torch.is_grad_enabled())
            self._secondary_window = torch.is_grad_enabled()  # the same on every rank
            self._carry = set()  # units carried into this pass are its own now
        self._enter(unit)

    def _hook_post_forward(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        """Unit ``index``'s forward hook: release it (the root's ends the forward pass)."""
        unit = self.units[index]
        self._leave(unit, output)
        if unit is self.root and self.phase is Phase.FORWARD:
            self._end_pass(Phase.FORWARD, _END_FORWARD)

    def _hook_pre_submodule(self, unit: GatherUnit, probe: nn.Parameter) -> Callable[..., None]:
        """A submodule of ``unit`` called on its own (``get_encoder()(...)``, ``lm_head(h)``): gather the
        unit around it, as the unit's own forward would; nothing to do inside the unit's forward.

        The hook stays traceable so that it breaks no graph inside a compiled block: under torch.compile
        it reads only ``probe`` (one of the submodule's parameters of ``unit``, a graph input whose size
        dynamo guards anyway): gathered, the unit is held by the forward running it and nothing is
        traced; empty, the eager path below gathers it (a graph break, on this rare path only). See
        [Note: compiled regions] in runtime/compile.py."""
        enter = WeakHook(self._enter_submodule, unit.index)  # See [Note: engine lifetime]
        eager_enter = eager_hook(enter)
        # the scheduler's stack of units in use (one list object for its lifetime; ints only, so the hook holds
        # nothing of the engine): inside the unit's own forward, the common case, the hook returns at once
        in_use, index = self._in_use, unit.index

        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if not torch.compiler.is_compiling():
                if index not in in_use:
                    enter(module)
            elif probe.numel() == 0:
                eager_enter(module)
        return hook

    def _enter_submodule(self, index: int, module: nn.Module) -> None:
        """A submodule of unit ``index`` runs on its own: gather the unit around its call."""
        unit = self.units[index]
        if unit.index in self._in_use:
            return
        if self._recomputing(index):
            return
        self._enter(unit)
        self._entered.append(module)
        handles = []  # a one-shot post-forward hook: none sits inside a unit's forward otherwise

        def leave(module: nn.Module, args: Any, output: Any) -> None:
            handles.pop().remove()
            if self._entered and self._entered[-1] is module:
                self._entered.pop()
                self._leave(unit, output)
        handles.append(module.register_forward_hook(eager_hook(leave), always_call=True))

    def _enter(self, unit: GatherUnit) -> None:
        if self.events is not None:
            self._log("forward", unit)
        self._use(unit, forward=True)
        self._in_use.append(unit.index)
        self.entry_hooks.take_off(unit.index)  # See [Note: entry hooks off inside the unit] in entry_hooks.py

    def _leave(self, unit: GatherUnit, output: Any) -> None:
        if self._in_use and self._in_use[-1] == unit.index:
            self._in_use.pop()
        if self.phase is Phase.BACKWARD:  # activation-checkpoint recomputation: the backward pass owns the unit, its
            return  # hooks stay off until the pass is done with it (See [Note: entry hooks in the backward window])
        if unit.index not in self._in_use:
            self.entry_hooks.put_back(unit.index)
        if torch.is_grad_enabled():
            hook = self._backward_hooks.get(unit.index)
            if hook is None:
                # See [Note: engine lifetime]: the hook reaches the scheduler weakly
                hook = self._backward_hooks[unit.index] = WeakHook(self._hook_pre_backward, unit.index)
            # on the node that made each output, the root's on the tensors (See [Note: backward reached on the
            # output's node])
            root = unit is self.root
            for t in (output,) if isinstance(output, torch.Tensor) else iter_tensors(output):
                if t.requires_grad:
                    node = t.grad_fn
                    if node is not None and not root:
                        node.register_prehook(hook)
                    else:  # the model's outputs, or an input passed through unchanged (a leaf)
                        t.register_hook(hook)
        if self.events is not None:
            self._log("forward_end", unit)
        if unit.index not in self._in_use and not self.keep_gathered:
            self._release(unit)

    def _hook_pre_backward(self, index: int, grads: Any) -> None:
        """A pre-hook on the nodes that made unit ``index``'s forward outputs: the backward pass reached the unit,
        gather it.

        [Note: backward reached on the output's node]
        The backward pass reaches a unit when autograd is about to run a node that made one of its forward outputs:
        the hook sits on that node (``grad_fn.register_prehook``) rather than on the output tensor
        (``Tensor.register_hook``), which fires at the same moment (a tensor's hooks are its node's pre-hooks for that
        output) but goes through a Python wrapper per registration (checks, a handle, the tensor's hook dict): some
        25 registrations per training forward of a 24-layer model. Several outputs made by one node register the hook
        on it several times; it fires once per registration, like tensor hooks once per output, and a unit already
        reached returns at once. An output without a node (an input passed through, a leaf) keeps the tensor hook,
        and so do the root's outputs: they are the model's outputs, on which a user or hfzero's profiler hangs tensor
        hooks of its own, and autograd runs a node's tensor hooks before its pre-hooks. On the tensor, the root's
        hook keeps its place among them (registered in the root's forward hook, it runs before those registered
        later: the profiler's "backward begin" record sees the units the backward gathers first, and a user's hook
        sees the root gathered). ``grads``: the node's incoming gradients, or the tensor's gradient; unused."""
        unit = self.units[index]
        if self.phase is Phase.BACKWARD and graph_task_id() != self._graph_task:
            raise RuntimeError(FAILED_PASS_MESSAGE)
        if self.phase is not Phase.BACKWARD:
            self._begin_backward()
        if unit.index in self._backward_seen:
            if unit.state is UnitState.SHARDED:  # used again after it was finished (a shared block)
                self._issue(unit)
                unit.wait()
                self.entry_hooks.take_off(unit.index)  # back on at the pass's end
            return
        if unit is not self.root:  # the root's output hooks may sit on a block's output node too
            self._finish_earlier_units()
        self._backward_seen.add(unit.index)
        if self.events is not None:
            self._log("backward", unit)
        self._use(unit, forward=False)
        if self._runs_compiled(unit):  # See [Note: entry hooks in the backward window] in entry_hooks.py
            self.entry_hooks.take_off(unit.index)
        if self.on_unit_backward is not None:
            self.on_unit_backward(unit)

    def _recomputing(self, index: int) -> bool:
        """Whether a forward of unit ``index`` now (through its ``__call__`` or one of its submodules) is a
        recomputation inside the backward pass that holds it gathered (reached, not yet done): then its entry hooks
        are taken off and nothing else happens, no new use (See [Note: entry hooks in the backward window] in
        entry_hooks.py)."""
        if self.phase is Phase.BACKWARD and index in self._backward_seen and index not in self._finished:
            self.entry_hooks.take_off(index)
            return True
        return False

    def _runs_compiled(self, unit: GatherUnit) -> bool:
        """Whether a region compiled by ``compile_regions`` runs the unit's body: the unit's module or a submodule
        carrying its entry hooks. Cached until ``compile_regions`` compiles again: reading a missing attribute of a
        module goes through ``nn.Module.__getattr__`` and its AttributeError, some 2.5% of the host proxy's stage-3
        step when read per unit and backward (measured: trees alternated)."""
        if self._compiled_seen != compilations():
            self._compiled_seen = compilations()
            self._compiled_units = {u.index for u in self.units if any(
                holds_compiled_region(m) for m in (u.module, *self.entry_hooks.modules(u.index)))}
        return unit.index in self._compiled_units

    def _finish_earlier_units(self) -> None:
        """The backward pass reached a new unit: the units it used before are done on every rank (their
        gradients are accumulated: autograd runs AccumulateGrad nodes first). Launch their reductions
        and release them, at this rank-independent point. See [Note: stage-3 gather order]."""
        current = self._pass
        if current is None:
            return
        start, self._finish_from = self._finish_from, len(current.seen)
        for index in current.seen[start:]:
            if index in self._finished or index == self.root.index:
                continue
            self._finished.add(index)
            unit = self.units[index]
            self.entry_hooks.put_back(index)
            if self.on_unit_done is not None:
                self.on_unit_done(unit)
            if not self.keep_gathered:
                if self.events is not None:
                    self._log("release", unit)
                self._release(unit)

    # ---- passes ---------------------------------------------------------------------------------
    def _begin_backward(self) -> None:
        if self.phase is Phase.FORWARD:  # backward inside the root's forward: end that pass first
            self._end_pass(Phase.FORWARD, _END_FORWARD)
        self._secondary_window = False  # backward releases drop the secondary partitions
        self.phase = Phase.BACKWARD
        self._graph_task = graph_task_id()
        self._pass = _Pass(self.orders[Phase.BACKWARD], True)
        self._carry = set()  # units carried into this pass are its own now
        self._backward_seen = set()
        self._finished = set()
        self._finish_from = 0
        queue_backward_callback(self._end_backward)
        if self.on_backward_begin is not None:
            self.on_backward_begin()

    def _end_backward(self) -> None:
        self._finish_earlier_units()
        if self.on_backward_end is not None:
            self.on_backward_end()
        self._end_pass(Phase.BACKWARD, _END_BACKWARD)  # a training pass: checked at the step

    def _end_pass(self, phase: Phase, marker: int | None) -> None:
        current, self._pass = self._pass, None
        self.phase = Phase.IDLE
        self._in_use.clear()
        self.entry_hooks.put_back_all()
        if self._step_passes is not None:
            self._step_passes.append(phase)
        if not self.keep_gathered:
            for index, unit in list(self._gathered.items()):
                if unit.state is not UnitState.SHARDED and index not in self._carry:
                    self._log("release", unit)
                    self._release(unit)
                if unit.state is UnitState.SHARDED:
                    del self._gathered[index]
        issued = current.issued if current is not None else []
        if current is not None and current.seen != current.recorded:
            if current.recorded:
                logger.debug("stage 3: %s order changed; recording the new one", phase.value)
            self.orders[phase] = current.seen
        if marker is None:
            return
        if current is not None and current.training:  # See [Note: stage-3 step check] in step_check.py
            self._fold(marker, issued)
        else:
            self._verify_pass(marker, issued)

    # ---- gathering ------------------------------------------------------------------------------
    def _use(self, unit: GatherUnit, forward: bool) -> None:
        """Make ``unit`` gathered now, then prefetch what the recorded order says comes next."""
        self._issue(unit)
        unit.wait()
        if self.events is not None:
            self._log("wait", unit)
        current = self._pass
        if current is None:
            return
        position = len(current.seen)
        current.seen.append(unit.index)
        current.seen_set.add(unit.index)
        recorded = current.recorded
        if current.diverged or position >= len(recorded) or recorded[position] != unit.index:
            current.diverged = True
            return
        budget = self.prefetch_numel  # less the gathered units this pass has not used yet
        released = None  # entries found sharded: dropped after the scan (no copy of the dict per use)
        for index, other in self._gathered.items():
            if other.state is UnitState.SHARDED:
                released = [index] if released is None else released + [index]
            elif index not in current.seen_set:
                budget -= other.numel
        if released is not None:
            for index in released:
                del self._gathered[index]
        units = self.units
        for ahead in range(len(recorded) - position - 1):
            nxt = units[recorded[position + 1 + ahead]]
            if nxt.state is not UnitState.SHARDED:
                continue
            if ahead > 0 and nxt.numel > budget:  # the next unit always goes: See [Note: stage-3 gather order]
                break
            budget -= nxt.numel
            self._issue(nxt)
        if position == len(recorded) - 1:
            self._prefetch_next_pass()

    def _prefetch_next_pass(self) -> None:
        """At the last unit of a pass: start gathering the next pass's first sharded unit (whatever its
        size: it is the next unit) and carry it across the pass end. See [Note: prefetch across
        micro-batches]."""
        if self._step_passes is None or self.keep_gathered:
            return
        following = len(self._step_passes) + 1  # the pass after this one, in the plan
        if following >= len(self.pass_plan):
            return
        for index in self.orders[self.pass_plan[following]]:
            unit = self.units[index]
            if unit is self.root or unit.state is not UnitState.SHARDED:
                continue
            self._issue(unit)  # the next unit, whatever its size (as within a pass)
            self._carry.add(index)
            self.cross_prefetches += 1
            return

    def _issue(self, unit: GatherUnit, exact: bool = False) -> None:
        if unit.state is not UnitState.SHARDED:
            return
        if self._pass is None or not self._pass.recorded:  # recording an order (or outside a pass)
            self._verify(unit.index)
        if self._pass is not None:
            self._pass.issued.append(unit.index)
        if self.events is not None:
            self._log("gather", unit)
        self._gathered[unit.index] = unit
        unit.start_gather(exact=exact)

    def _fold(self, marker: int, issued: list[int]) -> None:
        """Add a training pass to the fingerprint checked at the step (host only: no collective)."""
        if self.verify_comm is None or self.verify_comm.world_size == 1:
            return
        self.fingerprint = hash((self.fingerprint, marker, tuple(issued))) & (2**62 - 1)  # ints hash alike everywhere
        if len(self._history) < _HISTORY:
            self._history.append([marker, *issued])

    def end_step_check(self, agreed: bool) -> None:
        """After the step check (every rank calls it with the same ``agreed``): start a new fingerprint,
        or raise GatherOrderError on every rank, naming the first training pass where ranks differ
        (one more collective, on the error path only)."""
        history, self._history, self.fingerprint = self._history, [], 0
        if agreed:
            return
        histories = [json.loads(payload) for payload in self.verify_comm.all_gather_bytes(json.dumps(history).encode())]
        first = next((i for i in range(max(map(len, histories))) if len({json.dumps(h[i:i + 1]) for h in histories}) > 1),
                     None)
        if first is None:
            what = f"passes beyond the first {_HISTORY} of the step, whose details were not kept"
        else:
            kinds = {_END_FORWARD: "forward", _END_BACKWARD: "backward"}
            what = f"training pass {first + 1} since the last step: " + ", ".join(
                f"rank {r}: " + (f"{kinds[h[first][0]]} gathering {[self._describe(i) for i in h[first][1:]]}"
                                 if first < len(h) else "no such pass") for r, h in enumerate(histories))
        raise GatherOrderError(
            f"hfzero stage 3: ranks gathered different units ({what}); found at the optimizer step, before "
            "anything was applied. Every rank must run the same stage-3 units (decoder blocks, the root) in the "
            "same order in each forward and backward; a branch that skips a unit on some ranks only must be "
            "taken on all ranks, or the module must belong to a unit every rank runs (prepare(units=...)).")

    def _verify(self, code: int) -> None:
        """All ranks must be at the same gather (or pass end); see [Note: stage-3 gather order]."""
        comm = self.verify_comm
        if comm is None or comm.world_size == 1:
            return
        mine = torch.tensor([code], dtype=torch.int64, device=self.root.full.device)
        everyone = torch.empty(comm.world_size, dtype=torch.int64, device=mine.device)
        comm.all_gather(everyone, mine)
        codes = everyone.tolist()
        if len(set(codes)) > 1:
            what = ", ".join(f"rank {r}: {self._describe(c)}" for r, c in enumerate(codes))
            raise GatherOrderError(
                f"hfzero stage 3: ranks reached different parameter gathers ({what}). Every rank must run "
                "the same stage-3 units (decoder blocks, the root) in the same order in each forward and "
                "backward; a branch that skips a unit on some ranks only must be taken on all ranks, or "
                "the module must belong to a unit every rank runs (prepare(units=...)).")

    def _verify_pass(self, marker: int, issued: list[int]) -> None:
        """All ranks must end the pass having gathered the same units in the same order: one tiny
        all-gather of a signature (and one host synchronization) per pass."""
        comm = self.verify_comm
        if comm is None or comm.world_size == 1:
            return
        signature = hash((marker, tuple(issued))) & (2**62 - 1)  # ints hash the same in every process
        mine = torch.tensor([signature], dtype=torch.int64, device=self.root.full.device)
        everyone = torch.empty(comm.world_size, dtype=torch.int64, device=mine.device)
        comm.all_gather(everyone, mine)
        if len(set(everyone.tolist())) == 1:
            return
        what = ", ".join(f"rank {r}: {[self._describe(i) for i in json.loads(payload)]}" for r, payload in
                         enumerate(comm.all_gather_bytes(json.dumps(issued).encode())))
        raise GatherOrderError(
            f"hfzero stage 3: ranks gathered different units in one {'forward' if marker == _END_FORWARD else 'backward'} "
            f"pass ({what}). "
            "Every rank must run the same stage-3 units (decoder blocks, the root) in the same order in each "
            "forward and backward; a branch that skips a unit on some ranks only must be taken on all ranks, "
            "or the module must belong to a unit every rank runs (prepare(units=...)).")

    def _describe(self, code: int) -> str:
        if code == _END_FORWARD:
            return "end of forward"
        if code == _END_BACKWARD:
            return "end of backward"
        return f"gather of unit {self.units[code].name or '<root>'!r}"

    def _log(self, event: str, unit: GatherUnit) -> None:
        if self.events is not None:
            self.events.append((event, unit.name or "<root>"))

    def remove_hooks(self) -> None:
        """Remove the hooks on the units' modules (``unprepare``); gradient hooks on outputs still in a graph
        reach the scheduler weakly."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.entry_hooks.remove()


def _entry_modules(unit: GatherUnit, units: list[GatherUnit]) -> list[nn.Module]:
    """Submodules of ``unit`` (not inside another unit) holding some of its gathered parameters: any of
    them may be called on its own, so each gathers the unit when it runs outside the unit's forward."""
    others = {id(u.module) for u in units if u is not unit}
    owned = set(unit.params)
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if id(child) in others:
                continue
            if any(p in owned for p in child.parameters()):
                found.append(child)
                visit(child)

    if owned:
        visit(unit.module)
    return found
