"""Host synchronizations per optimizer step (issue 19, item 3; issue 33, item 6): at most one of hfzero's
own, none per micro-batch.

Counted on CPU by the census of ``hfzero.testing.sync_census`` (the proxy: the calls that synchronize on an
accelerator, including those inside the torch helpers hfzero calls, each charged to the Python frame that
made it; see [Note: host-sync attribution] and [Note: host-sync budget]), world 2, stages 0-3, 1 and 4
micro-batches per step, fp32 and fp16 (whose overflow flag is read with the step's checks), in one spawn.
The census itself is tested on known calls (no spawn): each kind of synchronization counted once and
charged to its owner, the optimizer's host counters left out, a backward kernel charged to autograd.
The checks whose reads moved to the step still raise there: a rank whose stage-3 gathers departed from the
others' raises GatherOrderError at ``optimizer.step()``, on every rank, before anything is applied.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hfzero
from hfzero.runtime.stage3.scheduler import GatherOrderError, Phase
from hfzero.testing.host_syncs import budget, measure, measure_cases
from hfzero.testing.spawn import run_distributed
from hfzero.testing.sync_census import SyncCensus

CASES = [(stage, accumulation, dtype) for dtype in ("fp32", "fp16") for stage in (0, 1, 2, 3)
         for accumulation in (1, 4)]
"""fp16 reads its overflow flag with the step's checks (the agreement counts at stages 0-2, the packed
stage-3 check): no read of its own."""
STEPS = 2


def _worker(rank: int, world: int) -> list[dict]:
    return [measure(rank, world, stage, accumulation, steps=STEPS, warmup=1, dtype=dtype)
            for stage, accumulation, dtype in CASES]


@pytest.fixture(scope="module")
def counts() -> list[list[dict]]:
    return run_distributed(_worker, 2, timeout=900)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{d}-stage{s}-acc{a}" for s, a, d in CASES])
def test_at_most_one_host_sync_per_step(counts, case: int) -> None:
    for rank_counts in counts:
        ok, detail = budget(rank_counts[case]["proxy"], STEPS)
        assert ok, (CASES[case], detail)


def test_more_micro_batches_add_no_host_sync(counts) -> None:
    per_step = {CASES[i]: r["proxy"]["hfzero_per_step"] for i, r in enumerate(counts[0])}
    for stage, accumulation, dtype in CASES:
        if accumulation == 4:
            assert per_step[(stage, 4, dtype)] == per_step[(stage, 1, dtype)], (stage, dtype, per_step)
    # the model's own read (transformers' masking_utils, once per forward) is reported, not charged
    assert counts[0][0]["proxy"]["per_step_by_owner"].get("transformers", 0) >= 1


# ---- the census on known calls --------------------------------------------------------------------

_FAKE_HFZERO = """
import torch
def run(x, mask, params):
    x[0].item(); x.tolist(); bool(x.sum() > 0); x.cpu()
    x.to("cpu")
    torch.nonzero(x); x[mask]; torch.equal(x, x); x.masked_select(mask)
    torch.tensor([1.0], device=x.device)
    torch.nn.utils.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
def quiet(x, device):
    y = (x[:, None] @ x[None, :]).relu_() + 1; y.to(torch.float64); y.to(device); x.to(device=device)
    torch.where(x > 0, x, 0); x.masked_fill(x > 0, 0.0); x[1:3].sum()
"""


def _module(name: str) -> dict:
    scope = {"__name__": name}
    exec(compile(_FAKE_HFZERO, f"<{name}>", "exec"), scope)  # frames whose module is ``name``
    return scope


def test_census_counts_each_kind_of_sync_once_and_charges_its_caller() -> None:
    fake = _module("hfzero.runtime.fake")
    x, mask = torch.randn(4), torch.tensor([True, False, True, False])
    params = [nn.Parameter(torch.randn(3))]
    params[0].grad = torch.ones(3)
    census = SyncCensus("cpu")
    with census.phase("step"):
        fake["run"](x, mask, params)
        fake["quiet"](x, torch.device("cpu"))
    sites = census.counts.sites()
    apis = sorted(s["api"] for s in sites if s["via"] == "")
    assert apis == sorted(["Tensor.item", "Tensor.tolist", "bool(tensor)", "Tensor.cpu", "Tensor.to(cpu)",
                           "aten.nonzero", "aten.index (boolean mask)", "aten.equal", "aten.masked_select",
                           "torch.tensor(device=)"]), sites
    assert all(s["count"] == 1 and s["owner"] == "hfzero" and s["where"].startswith("hfzero.runtime.fake:")
               for s in sites), sites
    inside = [s for s in sites if s["via"]]  # error_if_nonfinite reads the norm on the host, inside torch
    assert inside and all(s["via"].startswith("torch.nn.utils") and s["owner"] == "hfzero" for s in inside), sites

    other = SyncCensus("cpu")
    with other.phase("forward"):
        _module("transformers.fake")["run"](x, mask, params)
    assert set(other.counts.by_owner()) == {"transformers"}


def test_census_leaves_out_host_counters_and_charges_backward_kernels_to_autograd() -> None:
    fake = _module("hfzero.runtime.fake")
    param = nn.Parameter(torch.randn(8))
    optimizer = torch.optim.AdamW([param], lr=1e-3, foreach=False)
    param.grad = torch.ones(8)
    optimizer.step()  # creates the host ``step`` counter
    census = SyncCensus("cpu")
    with census.phase("step"):
        exec("optimizer.step()", {"__name__": "hfzero.runtime.fake", "optimizer": optimizer})
    assert census.counts.total("hfzero") == 1  # AdamW's ``step.item()``, charged to the caller via torch.optim
    census = SyncCensus("cpu")
    census.host([optimizer.state[param]["step"]])
    with census.phase("step"):
        exec("optimizer.step()", {"__name__": "hfzero.runtime.fake", "optimizer": optimizer})
    assert census.counts.total() == 0, census.counts.sites()

    mask = torch.arange(8) % 2 == 0
    census = SyncCensus("cpu")
    with census.phase("backward"):
        loss = param[mask].square().sum()  # this frame: the caller's
        fake["quiet"](param.detach(), torch.device("cpu"))
        loss.backward()  # the mask's index_put in the backward: no Python caller
    owners = sorted((s["owner"], s["api"]) for s in census.counts.sites())
    assert owners == [("autograd", "aten.index_put (boolean mask)"), ("caller", "aten.index (boolean mask)")], owners


class _Blocks(nn.Module):
    """Four identical blocks (so mismatched gathers still pair up) and a head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


def _order_worker(rank: int, world: int) -> dict:
    model = _Blocks()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = hfzero.prepare(model, optimizer, hfzero.ZeroConfig(stage=3, param_persistence_threshold=0))
    engine = hfzero.get_engine(model)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    for step in range(3):
        if step == 2 and rank == 1:  # this rank's recorded forward order departs: it prefetches another block
            order = engine.scheduler.orders[Phase.FORWARD]
            order[2], order[3] = order[3], order[2]
        optimizer.backward(model(x))  # no error at the pass ends: the check waits for the step
        before = [p.detach().clone() for p in engine.master_views]
        try:
            optimizer.step()
        except GatherOrderError as error:
            unchanged = all(torch.equal(a, b) for a, b in zip(before, engine.master_views))
            optimizer.zero_grad()
            return {"step": step, "error": str(error), "unchanged": unchanged}
        optimizer.zero_grad()
    return {"step": None}


def test_gather_order_error_is_raised_at_the_step_on_every_rank() -> None:
    for result in run_distributed(_order_worker, 2, timeout=300):
        assert result["step"] == 2, result
        assert "found at the optimizer step" in result["error"] and "training pass 1 since the last step" in result["error"]
        assert result["unchanged"]  # nothing applied


def _cuda_worker(rank: int, world: int) -> list[dict]:
    cases = [(stage, accumulation) for stage in (0, 1, 2, 3) for accumulation in (1, 4)]
    return measure_cases(rank, world, cases, STEPS, 1, "cuda", {})


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: counts hfzero's host syncs as torch "
                    "reports them (torch.cuda.set_sync_debug_mode), by owner; the CPU proxy runs above")
def test_at_most_one_host_sync_per_step_on_cuda() -> None:
    worlds = [1] + ([2] if torch.cuda.device_count() >= 2 else [])  # NCCL: one rank per GPU
    for world in worlds:
        for rank_results in run_distributed(_cuda_worker, world, backend="nccl", timeout=600):
            for result in rank_results:
                assert result["cuda"] is not None
                for counted in ("cuda", "proxy"):  # torch's reports decide; the proxy must agree on the budget
                    ok, detail = budget(result[counted], STEPS)
                    assert ok, (world, counted, detail)
            by_case = [r["cuda"]["hfzero_per_step"] for r in rank_results]
            assert by_case[0::2] == by_case[1::2], by_case  # 4 micro-batches add none over 1
