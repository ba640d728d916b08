"""Hierarchical sharding (HSDP / MiCS, ``ZeroConfig.shard_size``) on 4 gloo ranks simulating 2 nodes of 2
(``ranks_per_node=2``), against flat ZeRO and the float64 single-process reference.

One spawn of 4 ranks runs everything:
1. training cases at stages 1-3 with shard groups of 2 (ranks 0-1 and 2-3, each replicated on the other
   "node"), 2 accumulation micro-batches, both accumulation policies, clipping, an LR schedule, plus flat
   stage 3 for comparison, and ZeRO-Offload (forced on) at stages 2-3: losses and final parameters within the
   float64 rounding bounds (hfzero/testing/parity.py), and each step's intra-/inter-node bytes equal to the
   closed form of [Note: node traffic] (hfzero/comm/collectives.py);
2. checkpoints resharded along G=2 (stage 2) -> flat (stage 3) -> G=4, the whole 4-rank world (stage 1) ->
   G=2 (stage 2): each load saved again at once, every saved master and optimizer-state element equal bit
   for bit to the first save's; back at the saved configuration, training resumes bit for bit as the
   uninterrupted run;
3. bad input every rank meets the same way (a shard size or ranks per node that does not divide the world).
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hfzero import ZeroConfig, prepare
from hfzero.checkpoint import load_checkpoint, save_checkpoint
from hfzero.checkpoint import format as fmt
from hfzero.config import ConfigError
from hfzero.parallel.mesh import check_shard_size
from hfzero.runtime.offload import FORCE_ENV
from hfzero.runtime.stage3 import full_state_dict
from hfzero.testing import run_distributed
from hfzero.testing.models import micro_batches, tiny_causal_lm, token_batches
from hfzero.testing.parity import ParityReference
from hfzero.testing.workloads import TrainSpec, train_many, train_reference64
from hfzero.comm.topology import ranks_per_node, ring_crossings

WORLD, G, PER_NODE, STEPS, ACCUM = 4, 2, 2, 3, 2
NODES = (("ranks_per_node", PER_NODE),)
HSDP = (("shard_size", G),) + NODES
PERSIST0 = (("param_persistence_threshold", 0),)  # the tiny model is below the default: partition it all at stage 3


def _case(stage: int, policy: str, extra=HSDP) -> TrainSpec:
    local = policy == "local"
    return TrainSpec(stage=stage, steps=STEPS, accumulation=ACCUM, no_sync=local,
                     extra_config=extra + (("accumulation", policy),) + (PERSIST0 if stage == 3 else ()))


CASES = [_case(s, p) for s in (1, 2, 3) for p in ("sharded", "local")]
FLAT3 = _case(3, "sharded", NODES)
HPZ = _case(3, "sharded", NODES + (("secondary_partition", True),))
ALL = CASES + [FLAT3, HPZ]
# ZeRO-Offload under HSDP: the offload path forced on (hfzero.runtime.offload.FORCE_ENV; host placement, copies
# and host accumulation as on a GPU): the replicate all-reduce runs on the host copy of the gradient shard
OFFLOAD = [_case(2, "sharded", HSDP + (("offload_optimizer", True),)),
           _case(3, "local", HSDP + (("offload_optimizer", True),))]
# fp16 with an overflow on rank 1 only (shard group 0) at step 1: every rank of both groups skips that step
OVERFLOW = [TrainSpec(stage=s, dtype="fp16", steps=3, overflow_step=1, extra_config=HSDP + (PERSIST0 if s == 3 else ()))
            for s in (2, 3)]

# ---- checkpoints -------------------------------------------------------------------------------------
CK_STEPS, K, CK_BATCH, SEQ = 4, 2, 4, 16
CHAIN = ((2, G), (3, 0), (1, WORLD), (2, G))  # (stage, shard_size) of each link: saved, then loaded by the next


def _optimizer(model) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=3e-3)


def _build(stage: int, shard_size: int, seed: int, secondary: bool = False, offload: bool = False):
    config = ZeroConfig(stage=stage, shard_size=shard_size, ranks_per_node=PER_NODE, reduce_bucket_size=3000,
                        param_persistence_threshold=0, secondary_partition=secondary, offload_optimizer=offload)
    model = tiny_causal_lm("gpt2", seed=seed)
    return prepare(model, _optimizer(model), config)


def _train(model, opt, batches) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for batch in batches:
        (mb,) = micro_batches(batch, rank, world, 1)
        loss = model(input_ids=mb, labels=mb).loss
        opt.backward(loss)
        opt.clip_grad_norm_(1.0)
        opt.step()
        for group in opt.param_groups:
            group["lr"] *= 0.8
        value = loss.detach().reshape(1).clone()
        dist.all_reduce(value)
        losses.append(value.item() / world)
    return losses


def _checkpoints(root: Path) -> dict:
    batches = token_batches(CK_STEPS, CK_BATCH, SEQ)
    stage, shard = CHAIN[0]
    model, opt = _build(stage, shard, seed=0)
    _train(model, opt, batches[:K])
    at_save = full_state_dict(model, rank0_only=False)
    save_checkpoint(root / "link0", model, opt, extra={"step": K})
    uninterrupted = _train(model, opt, batches[K:])
    final_ref = full_state_dict(model, rank0_only=False)
    loaded_equal = []
    for index, (stage, shard) in enumerate(CHAIN[1:], start=1):
        saved = full_state_dict(model, rank0_only=False) if index > 1 else at_save
        model, opt = _build(stage, shard, seed=index)  # another initialization: the load must overwrite it
        extra = load_checkpoint(root / f"link{index - 1}", model, opt)
        now = full_state_dict(model, rank0_only=False)
        loaded_equal.append(all(torch.equal(saved[n].float(), now[n].float()) for n in saved))
        save_checkpoint(root / f"link{index}", model, opt, extra=extra)
    resumed = _train(model, opt, batches[extra["step"]:])
    final = full_state_dict(model, rank0_only=False)  # a collective
    return {"loaded_equal": loaded_equal, "resumed": resumed, "uninterrupted": uninterrupted,
            "final_equal": all(torch.equal(final[n], final_ref[n]) for n in final)}


# ---- bad input ---------------------------------------------------------------------------------------
def _refused(**options) -> str:
    model = tiny_causal_lm("gpt2")
    try:
        prepare(model, torch.optim.AdamW(model.parameters()), ZeroConfig(stage=2, **options))
    except ConfigError as exc:
        return str(exc)
    return "accepted"


def _secondary_memory() -> dict:
    """hpZ's PARAM_SECONDARY after a training forward, after its backward and after the step (flat stage 3),
    the elements it should be, and whether HSDP with the shard group inside a node left it off."""
    from hfzero import get_engine
    from hfzero.roles import MemoryRole

    model, opt = _build(3, 0, seed=0, secondary=True)
    engine = get_engine(model)
    (ids,) = micro_batches(token_batches(1, CK_BATCH, SEQ)[0], dist.get_rank(), WORLD, 1)
    loss = model(input_ids=ids, labels=ids).loss
    after_forward = engine.memory_by_role().get(MemoryRole.PARAM_SECONDARY, 0)
    opt.backward(loss)
    after_backward = engine.memory_by_role().get(MemoryRole.PARAM_SECONDARY, 0)
    opt.step()
    hsdp, _ = _build(3, G, seed=0, secondary=True)
    return {"after_forward": after_forward, "after_backward": after_backward,
            "after_step": engine.memory_by_role().get(MemoryRole.PARAM_SECONDARY, 0),
            "expected": 4 * sum(u.numel for u in engine.units) // PER_NODE,
            "params": engine.num_params, "hsdp_secondary": get_engine(hsdp).secondary is not None}


def _offloaded() -> bool:
    """Whether HSDP with offload_optimizer (forced on) placed the optimizer side on the host."""
    from hfzero import get_engine

    engine = get_engine(_build(2, G, seed=0, offload=True)[0])
    return engine.offload is not None and engine.replicate is not None


def _everything(rank: int, world: int, root: str) -> dict:
    out = {"train": train_many(rank, world, ALL), "overflow": train_many(rank, world, OVERFLOW)}
    os.environ[FORCE_ENV] = "1"
    out["offload"] = train_many(rank, world, OFFLOAD)
    out["offloaded"] = _offloaded()
    del os.environ[FORCE_ENV]
    out["checkpoints"] = _checkpoints(Path(root))
    out["secondary"] = _secondary_memory()
    out["bad"] = {"shard_size=3": _refused(shard_size=3), "ranks_per_node=3": _refused(ranks_per_node=3)}
    return out


@functools.lru_cache(maxsize=None)
def results() -> tuple[list[dict], str]:
    root = tempfile.mkdtemp(prefix="hfzero-hsdp-")
    return run_distributed(_everything, WORLD, root, timeout=600), root


@functools.lru_cache(maxsize=None)
def _reference64() -> ParityReference:
    return train_reference64(TrainSpec(steps=STEPS), (WORLD * ACCUM,))


def _id(spec: TrainSpec) -> str:
    extra = dict(spec.extra_config)
    return f"stage{spec.stage}-{extra['accumulation']}-{'G%d' % extra['shard_size'] if 'shard_size' in extra else 'flat'}"


# ---- 1. parity and bytes -----------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ALL, ids=_id)
def test_fp32_matches_float64_reference(spec):
    """Sharding over 2 and replicating over 2 trains the same model as flat ZeRO: every rank's losses and
    final parameters within the float64 run's fp32 rounding bounds (micro-batch split 4 ranks x 2)."""
    ref = _reference64()
    outs = [r["train"][ALL.index(spec)] for r in results()[0]]
    for rank, out in enumerate(outs):
        ref.check_losses(out["losses"], f"rank {rank} loss")
        ref.check_params(out["params"], f"rank {rank} ")
    for out in outs[1:]:  # replicas and shard groups agree on every element
        for name, value in out["params"].items():
            assert torch.equal(value, outs[0]["params"][name]), name


@pytest.mark.parametrize("spec", OFFLOAD, ids=_id)
def test_offloaded_hsdp_matches_float64_reference(spec):
    """ZeRO-Offload x HSDP: the gradient shard's replicate all-reduce on the host's fp32 copy trains the same model
    (the float64 run's bounds, every rank equal), with the optimizer side on the host."""
    ref = _reference64()
    outs = [r["offload"][OFFLOAD.index(spec)] for r in results()[0]]
    for rank, out in enumerate(outs):
        ref.check_losses(out["losses"], f"rank {rank} loss")
        ref.check_params(out["params"], f"rank {rank} ")
        for name, value in out["params"].items():
            assert torch.equal(value, outs[0]["params"][name]), (rank, name)
    assert all(r["offloaded"] for r in results()[0])


def _expected_node_bytes(spec: TrainSpec, out: dict) -> dict[str, list[int]]:
    """Bytes per rank per step by kind, [intra, inter], from [Note: node traffic]: the shard groups (ranks 0-1,
    2-3) sit inside a node, the replicate groups (0-2, 1-3) have one rank per node; a flat group of 4 over 2
    nodes has 2 of its 4 ring hops crossing. fp32: 4 bytes per element."""
    padded = out["num_params_padded"]  # the layout over the shard group (all 4 ranks when flat)
    reductions = 1 if dict(spec.extra_config)["accumulation"] == "local" else ACCUM
    gathers = 2 * padded * ACCUM if spec.stage == 3 else padded
    volume = {"reduce_scatter": 4 * padded * reductions, "all_gather": 4 * gathers}
    if "shard_size" not in dict(spec.extra_config):
        volume["all_reduce"] = 4 * 2  # the clip norm's one element, counted 2
        split = {kind: [v - v // 2, v // 2] for kind, v in volume.items()}
        if dict(spec.extra_config).get("secondary_partition"):  # hpZ: backward gathers (half of them) in the node
            split["all_gather"] = [4 * gathers - 4 * gathers // 4, 4 * gathers // 4]
        return split
    # + the shard's per-step all-reduce over the replicate group (2 x shard elements, all inter-node)
    return {**{kind: [v, 0] for kind, v in volume.items()}, "all_reduce": [4 * 2, 4 * 2 * out["shard_numel"]]}


@pytest.mark.parametrize("spec", ALL, ids=_id)
def test_node_bytes_per_step_match_closed_form(spec):
    for rank, r in enumerate(results()[0]):
        out = r["train"][ALL.index(spec)]
        for step, moved in enumerate(out["node_bytes_per_step"]):
            assert moved == _expected_node_bytes(spec, out), (rank, step, moved)


@pytest.mark.parametrize("index", range(len(OVERFLOW)), ids=lambda i: f"stage{OVERFLOW[i].stage}")
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(index):
    outs = [r["overflow"][index] for r in results()[0]]
    for rank, out in enumerate(outs):
        assert out["skipped"] == [step == 1 for step in range(3)], (rank, out["skipped"])
        for name, value in out["params"].items():
            assert torch.equal(value, outs[0]["params"][name]), (rank, name)


def test_hpz_crosses_nodes_with_two_thirds_of_flat_stage3():
    """ZeRO++'s hpZ: the backward gathers stay in the node, so flat stage 3 crosses nodes with (Ψ + Ψ)/2 per
    micro-batch instead of 3Ψ/2: 1/1.5 (<= 1/1.45, the issue's bound), and trains the same (parity above)."""
    per_rank = results()[0][0]["train"]
    flat = sum(v[1] for v in per_rank[ALL.index(FLAT3)]["node_bytes_per_step"][0].values())
    hpz = sum(v[1] for v in per_rank[ALL.index(HPZ)]["node_bytes_per_step"][0].values())
    assert hpz <= flat / 1.45 and hpz == pytest.approx(flat / 1.5, rel=1e-4), (hpz, flat)


def test_hpz_secondary_partition_memory():
    """PARAM_SECONDARY holds 1/ranks_per_node of every gathered unit from a training forward to its backward,
    the estimator's (Ψ - P)/ranks_per_node within bucket padding; nothing after the backward or the step; off
    when the group lies inside a node (HSDP G=2 with 2 ranks per node)."""
    from hfzero.planning import estimate as est

    for rank, r in enumerate(results()[0]):
        out = r["secondary"]
        assert out["after_forward"] == out["expected"] > 0, (rank, out)
        assert out["after_backward"] == 0 and out["after_step"] == 0, (rank, out)
        formula = est.secondary_partition_bytes(out["params"], PER_NODE, param_bytes=4)
        assert 0 <= out["after_forward"] - formula <= 4 * 3000, (rank, out, formula)  # padding: < a bucket per unit
        assert not out["hsdp_secondary"]


def test_hsdp_stage3_crosses_nodes_less_than_flat():
    """The replicate all-reduce of a half-size shard (2 x Ψ/2) replaces flat stage 3's half of 3Ψ per
    micro-batch: 2/3 of flat's inter-node bytes here (accumulation 2: 1/3)."""
    per_rank = results()[0][0]["train"]
    flat = sum(v[1] for v in per_rank[ALL.index(FLAT3)]["node_bytes_per_step"][0].values())
    hsdp = sum(v[1] for v in per_rank[ALL.index(_case(3, "sharded"))]["node_bytes_per_step"][0].values())
    assert 0 < hsdp < flat / 2.5, (hsdp, flat)


# ---- 2. checkpoints ----------------------------------------------------------------------------------
def _saved_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every master and optimizer-state tensor of a checkpoint, assembled whole from its pieces."""
    from safetensors import safe_open

    manifest = json.loads((directory / fmt.MANIFEST).read_text())
    keys = manifest["optimizer"]["state_keys"]
    out = {}
    for name, meta in manifest["params"].items():
        numel = int(torch.Size(meta["shape"]).numel())
        for key in [fmt.master_key(name)] + [fmt.state_key(k, name) for k in keys]:
            whole = torch.full((numel,), float("nan"))
            for piece in meta["pieces"]:
                with safe_open(str(directory / piece["file"]), framework="pt") as f:
                    whole[piece["start"]: piece["end"]] = f.get_tensor(key)
            out[key] = whole
    return out


def test_checkpoint_reshards_exactly_between_shard_sizes():
    outs, root = results()
    first = _saved_tensors(Path(root) / "link0")
    assert not any(t.isnan().any() for t in first.values()), "some element was saved by no rank"
    for index in range(1, len(CHAIN)):
        assert all(r["checkpoints"]["loaded_equal"][index - 1] for r in outs), f"link {index}: loaded parameters differ"
        again = _saved_tensors(Path(root) / f"link{index}")
        assert again.keys() == first.keys()
        for key, value in first.items():
            assert torch.equal(again[key], value), f"link {index} {CHAIN[index]}: {key} differs after the reshard"


def test_hsdp_checkpoint_written_by_one_replica():
    """G=2: only replicate rank 0's shard group (ranks 0-1) writes slices; every rank writes its RNG file."""
    _, root = results()
    manifest = json.loads((Path(root) / "link0" / fmt.MANIFEST).read_text())
    writers = {p["file"] for meta in manifest["params"].values() for p in meta["pieces"]}
    assert writers == {fmt.rank_file(0, WORLD), fmt.rank_file(1, WORLD)}
    assert len(manifest["ranks"]) == WORLD
    assert manifest["config"]["shard_size"] == G


def test_resume_at_the_saved_shard_size_is_exact():
    """After the round trip through other shard sizes and stages, G=2 stage 2 again resumes as if never stopped."""
    for rank, r in enumerate(results()[0]):
        out = r["checkpoints"]
        assert out["resumed"] == out["uninterrupted"], (rank, out["resumed"], out["uninterrupted"])
        assert out["final_equal"], f"rank {rank}: final parameters differ from the uninterrupted run"


# ---- 3. bad input ------------------------------------------------------------------------------------
def test_bad_sizes_refused_on_every_rank():
    for r in results()[0]:
        assert "does not divide the data-parallel world of 4" in r["bad"]["shard_size=3"]
        assert "does not divide the world size 4" in r["bad"]["ranks_per_node=3"]


def test_config_rejects_secondary_partition_below_stage3():
    with pytest.raises(ConfigError, match="set stage=3"):
        ZeroConfig(stage=2, secondary_partition=True)
    with pytest.raises(ConfigError, match="set stage=3"):
        ZeroConfig(stage="auto", secondary_partition=True)


def test_config_rejects_shard_size_one_and_stage0():
    with pytest.raises(ConfigError, match="at least 2"):
        ZeroConfig(shard_size=1)
    with pytest.raises(ConfigError, match="stage 0 does not"):
        ZeroConfig(stage=0, shard_size=2)
    with pytest.raises(ConfigError, match="integer >= 0"):
        ZeroConfig(ranks_per_node=-1)
    with pytest.raises(ConfigError, match="use one of \\[2, 4\\]"):
        check_shard_size(4, 3)


def test_topology_from_environment(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert ranks_per_node(0, 4) == 2
    assert ranks_per_node(4, 4) == 4  # the config wins
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE=3"):
        ranks_per_node(0, 4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert ranks_per_node(0, 4) == 4  # one node
    assert ring_crossings([0, 1, 2, 3], 2) == 2
    assert ring_crossings([0, 2], 2) == 2
    assert ring_crossings([0, 1], 2) == 0
    assert ring_crossings([0, 1, 2, 3], 4) == 0


def test_profile_records_and_summarizes_the_node_split():
    """The recorder's comm deltas carry the split; the reader averages it, and old records without it read as
    before (no split fields, ``comm_inter_node_bytes_per_step`` None)."""
    from hfzero.comm.collectives import CommStats
    from hfzero.profiler.reader import _comm_per_step
    from hfzero.profiler.recorder import _comm_delta

    before = {"all_reduce": CommStats(calls=1, elements=10, bytes=40, intra_node_bytes=40)}
    now = {"all_reduce": CommStats(calls=3, elements=30, bytes=120, intra_node_bytes=60, inter_node_bytes=20)}
    delta = _comm_delta(now, before)["all_reduce"]
    assert (delta["bytes"], delta["intra_node_bytes"], delta["inter_node_bytes"]) == (80, 20, 20)
    assert _comm_per_step([{"comm": {"all_reduce": delta}}])["all_reduce"]["inter_node_bytes"] == 20
    old = {"calls": 1, "elements": 2, "bytes": 8, "seconds": 0.0}
    assert "inter_node_bytes" not in _comm_per_step([{"comm": {"all_reduce": old}}])["all_reduce"]


@pytest.mark.parametrize("option, value", [("shard_size", "3"), ("ranks_per_node", "3")])
def test_launcher_refuses_sizes_that_do_not_divide_the_world(option, value):
    from hfzero.integrations.launch import plan

    script = str(Path(__file__).resolve().parent / "scripts" / "llama_trainer.py")
    with pytest.raises(ConfigError, match=f"--zero_{option} 3 does not divide the world of 4"):
        plan(["--nnodes", "2", "--nproc_per_node", "2", script, f"--zero_{option}", value])
    assert plan(["--nnodes", "2", "--nproc_per_node", "2", script, f"--zero_{option}", "2"]).env


def test_estimator_node_split_matches_the_measured_closed_form(capsys):
    """``hfzero estimate --nodes/--shard-size``: the cost model this file measures, without padding and clipping."""
    from hfzero.planning import estimate as est
    from hfzero.cli import main as cli_main

    psi = 1e6
    assert est.node_comm_elements_per_step(psi, 4, 3, nodes=2) == (3 * psi, 1.5 * psi)  # flat: 2 of 4 hops cross
    assert est.node_comm_elements_per_step(psi, 4, 3, nodes=2, shard_size=2) == (4 * psi, psi)  # the shard's all-reduce
    assert est.node_comm_elements_per_step(psi, 4, 2, nodes=1, shard_size=2) == (3 * psi, 0)
    with pytest.raises(est.EstimateError, match="stage 0"):
        est.node_comm_elements_per_step(psi, 4, 0, nodes=2, shard_size=2)
    assert cli_main(["estimate", "--params", "1e6", "--dp", "4", "--nodes", "2", "--shard-size", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["comm_inter_node_elements_per_step"]["3"] == psi and result["comm_elements_per_step"]["3"] == 4 * psi
    assert result["model_states_bytes"]["3"] == pytest.approx(16 * psi / 2)  # sharded over G = 2
    assert cli_main(["estimate", "--params", "1e6", "--dp", "4", "--nodes", "3"]) == 2
    # hpZ: the backward gathers (Ψ) stay in the node: flat stage 3 crosses with (Ψ + Ψ)/2
    assert est.node_comm_elements_per_step(psi, 4, 3, nodes=2, secondary_partition=True) == (3 * psi, psi)
    assert cli_main(["estimate", "--params", "1e6", "--dp", "4", "--nodes", "2", "--secondary-partition", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["comm_inter_node_elements_per_step"]["3"] == psi
    assert result["secondary_partition_bytes"] == 2 * psi / 2  # bf16, 2 ranks per node


def test_accelerate_parallelism_config_maps_onto_hsdp():
    from accelerate import ParallelismConfig

    from hfzero.integrations.parallelism import zero_config_from_parallelism

    flat = ZeroConfig(stage=3)
    hsdp = zero_config_from_parallelism(ParallelismConfig(dp_replicate_size=2, dp_shard_size=2), flat, 4)
    assert hsdp.shard_size == 2 and hsdp.stage == 3
    assert zero_config_from_parallelism(ParallelismConfig(dp_shard_size=4), flat, 4).shard_size == 0
    assert zero_config_from_parallelism(None, flat, 4) is flat
    with_tp = zero_config_from_parallelism(ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2), flat,
                                           8)
    assert (with_tp.shard_size, with_tp.tp_size) == (2, 2)  # HSDP x TP (tests/test_hsdp_tp.py)
    for bad, world, message in ((ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, sp_size=2), None, "sp_size=2"),
                                (ParallelismConfig(dp_replicate_size=4, dp_shard_size=1), 4, "replicates everything"),
                                (ParallelismConfig(dp_replicate_size=2, dp_shard_size=4), 4, "the world has 4")):
        with pytest.raises(ConfigError, match=message):
            zero_config_from_parallelism(bad, flat, world)
    with pytest.raises(ConfigError, match="disagrees"):
        zero_config_from_parallelism(ParallelismConfig(dp_replicate_size=2, dp_shard_size=2),
                                     ZeroConfig(stage=3, shard_size=4), 4)
