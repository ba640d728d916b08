"""HSDP inside a pipeline (issue 22): pp=2 x dp=4 on 8 gloo ranks, each stage's 4 dp ranks cut into 2 shard
groups of 2 (``shard_size=2``), at ZeRO stages 1-3 with both accumulation policies. Every rank's losses and
the merged final parameters match the single-process full-batch fp32 reference, and each stage's replicas
end with identical parameters. A stage-3 HSDP pipeline's checkpoint (written by replicate rank 0's shard group
of each stage) loads back into another HSDP pipeline and consolidates to exactly the trained weights. On simulated
nodes, every step's inter-node bytes equal the pipeline cost model's, with and without quantized collectives (qwZ,
qgZ inside each stage's dp group). One spawn runs every case (8 ranks on 2 cores: a tiny Llama, 4 steps)."""

from __future__ import annotations

import dataclasses
import functools
import tempfile
from pathlib import Path

import pytest
import torch

from hfzero.testing import run_distributed
from hfzero.testing.pipeline import PipeSpec, reference, stage_params, train_pipelines

WORLD = 8
STEPS = 4
ATOL = 2e-6
"""Losses (~4.8) and parameters against the fp32 reference. Measured on the development CPU: at most 4.8e-7
(one float32 ulp of the loss) and 4.4e-7 in every case, within the issue's 1e-6; the bound allows 4 ulps so that
another CPU's kernels (another summation order in the reference and in the ranks) cannot fail it by one ulp."""


def _spec(stage: int, accumulation: str) -> PipeSpec:
    extra = (("shard_size", 2),) + ((("param_persistence_threshold", 0),) if stage == 3 else ())
    return PipeSpec(model="llama", stage=stage, accumulation=accumulation, schedule="1F1B", steps=STEPS,
                    stage3_gather="micro" if stage == 3 and accumulation == "sharded" else "step",
                    extra_config=extra)


SPECS = [_spec(stage, accumulation) for stage in (1, 2, 3) for accumulation in ("local", "sharded")]
NODE_SPECS = [  # 2 simulated nodes of 4 ranks: each stage's dp group lies in one node, its replicas split 2 x 2
    dataclasses.replace(SPECS[5], extra_config=SPECS[5].extra_config + (("ranks_per_node", 4),)),
    # nodes of 2 ranks: the shard groups stay inside a node, the replicate all-reduce and the tied sum cross
    dataclasses.replace(SPECS[3], extra_config=SPECS[3].extra_config + (("ranks_per_node", 2),)),
    # flat stage 2 over the stage's 4 dp ranks on 2 nodes of 2: its ring crosses twice
    dataclasses.replace(SPECS[3], extra_config=(("ranks_per_node", 2),)),
    # hpZ: flat stage 3 gathering per micro-batch on nodes of 2, the backward gathers inside the node
    dataclasses.replace(SPECS[5], extra_config=(("param_persistence_threshold", 0), ("ranks_per_node", 2),
                                                ("secondary_partition", True))),
]
QWZ = dataclasses.replace(SPECS[5], extra_config=SPECS[5].extra_config + (("quantize_weights", "int8"),))
"""qwZ under a pipeline (HSDP stage 3, per-micro-batch gathers quantized to int8): losses near the reference."""
QGZ_SPECS = [  # qgZ under a pipeline on nodes of 2 (block 8: chunks are whole blocks, so the cost model is exact)
    # flat stage 2, "sharded": each of the M per-micro-batch reductions crosses nodes, quantized
    dataclasses.replace(NODE_SPECS[2], extra_config=NODE_SPECS[2].extra_config + (
        ("quantize_gradients", "int8"), ("quantize_block", 8))),
    # all of ZeRO++ inside the stages: stage 3 gathering per micro-batch, hpZ + qwZ int8 + qgZ int4
    dataclasses.replace(NODE_SPECS[3], extra_config=NODE_SPECS[3].extra_config + (
        ("quantize_weights", "int8"), ("quantize_gradients", "int4"), ("quantize_block", 8))),
    # HSDP stage 2 (shard groups inside the node): qgZ's intra-node hop only; the replicate all-reduce crosses
    dataclasses.replace(NODE_SPECS[1], extra_config=NODE_SPECS[1].extra_config + (
        ("quantize_gradients", "int8"), ("quantize_block", 8))),
]
QGZ_RTOL = 2e-4
"""Quantized losses against the reference's (4 steps at lr 1e-3, block 8): measured at most 1.7e-5 (int8), 2.5e-5
(qwZ int8 + qgZ int4) and 3.4e-6 (HSDP, intra-node hop only)."""
ALL_SPECS = SPECS + NODE_SPECS + [QWZ] + QGZ_SPECS


def _checkpointed(root: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Train a stage-3 HSDP pipeline 2 steps, save, (rank 0) consolidate, and load into a freshly built one;
    this rank's stage parameters, trained and loaded."""
    import torch.distributed as dist

    import hfzero
    from hfzero.checkpoint import consolidate, load_checkpoint, save_checkpoint
    from hfzero.parallel.pipeline import PipelineConfig
    from hfzero.testing.models import tiny_causal_lm, token_batches

    def build(seed: int):
        model = tiny_causal_lm("llama", seed=seed)
        config = hfzero.ZeroConfig(stage=3, shard_size=2, param_persistence_threshold=0)
        return hfzero.pipeline(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config,
                               PipelineConfig(pp_size=2, n_microbatches=2))

    pipe = build(1)
    for batch in token_batches(2, 16, 16):
        pipe.train_step(batch.chunk(4)[pipe.mesh.dp_rank], max_grad_norm=1.0)
    save_checkpoint(Path(root) / "ckpt", pipe, pipe.optimizer)
    if dist.get_rank() == 0:
        consolidate(Path(root) / "ckpt", Path(root) / "export")
    dist.barrier()
    resumed = build(2)  # other initial weights: everything must come from the checkpoint
    load_checkpoint(Path(root) / "ckpt", resumed, resumed.optimizer)
    return stage_params(pipe), stage_params(resumed)


def _everything(rank: int, world: int, root: str) -> tuple[list[dict], tuple[dict, dict]]:
    return train_pipelines(rank, world, ALL_SPECS), _checkpointed(root)


@functools.lru_cache(maxsize=None)
def _run() -> tuple[list, Path]:
    root = Path(tempfile.mkdtemp(prefix="hfzero-hsdp-pp-"))
    return run_distributed(_everything, WORLD, str(root), timeout=900), root


def _results() -> dict[PipeSpec, list[dict]]:
    per_rank = [r[0] for r in _run()[0]]
    return {spec: [r[i] for r in per_rank] for i, spec in enumerate(ALL_SPECS)}


@functools.lru_cache(maxsize=None)
def _reference():
    return reference(PipeSpec(model="llama", steps=STEPS))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"stage{s.stage}-{s.accumulation}")
def test_hsdp_pipeline_matches_single_process_reference(spec):
    outs = _results()[spec]
    for out in outs:  # ZeRO ran over a shard group of 2 with 2 replicas: fp32 AdamW's two moments, 1/2 each
        assert (out["zero_world"], out["replicas"]) == (2, 2), out["coords"]
        half = 8 * out["num_params_padded"] // 2  # (AdamW's step counters: 4 bytes per parameter tensor on top)
        assert half <= out["roles"]["optim_state"] <= half + 4 * 64, (out["coords"], out["roles"])
    ref_losses, ref_params = _reference()
    for out in outs:
        torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref_losses), atol=ATOL, rtol=0,
                                   msg=lambda m: f"rank {out['coords']} losses: {m}")
    by_stage: dict[int, dict[str, torch.Tensor]] = {}
    for out in outs:  # every replica of a stage (4 dp ranks, 2 shard groups) ends with the same parameters
        held = by_stage.setdefault(out["coords"][0], out["params"])
        assert held.keys() == out["params"].keys()
        for name, value in out["params"].items():
            torch.testing.assert_close(value, held[name], atol=0, rtol=0, msg=lambda m: f"{out['coords']} {name}: {m}")
    merged = {name: value for params in by_stage.values() for name, value in params.items()}
    assert set(ref_params) <= set(merged)
    for name, ref in ref_params.items():
        torch.testing.assert_close(merged[name], ref, atol=ATOL, rtol=0, msg=lambda m: f"parameter {name}: {m}")


def test_hsdp_pipeline_gradient_norm_counts_each_element_once():
    """The clip norm sums over the shard group (and the pipeline), not over the stage's whole dp group, whose 2
    replicas hold the same elements: the HSDP stage-2 pipeline's norms equal flat stage 2's (the same training,
    other summation order). Summed over the dp group they were sqrt(2) times too large (the Trainer's logged
    grad_norm showed it, tests/test_hsdp_pipeline_trainer.py)."""
    hsdp, flat = _results()[SPECS[3]], _results()[NODE_SPECS[2]]
    assert "shard_size" in dict(SPECS[3].extra_config) and "shard_size" not in dict(NODE_SPECS[2].extra_config)
    for a, b in zip(hsdp, flat):
        assert len(a["norms"]) == STEPS and a["norms"][0] > 0
        torch.testing.assert_close(torch.tensor(a["norms"]), torch.tensor(b["norms"]), atol=0, rtol=1e-6)


def test_hsdp_pipeline_checkpoint_resumes_and_consolidates_to_the_trained_weights():
    from transformers import AutoModelForCausalLM

    per_rank, root = _run()
    for _, (trained, loaded) in per_rank:  # loading it into another HSDP pipeline gives each rank its stage back
        assert trained.keys() == loaded.keys()
        for name, value in trained.items():
            torch.testing.assert_close(loaded[name], value, atol=0, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
    trained = {name: value for _, (params, _) in per_rank for name, value in params.items()}
    exported = AutoModelForCausalLM.from_pretrained(root / "export").state_dict()
    assert set(trained) <= set(exported)
    for name, value in trained.items():
        torch.testing.assert_close(exported[name], value, atol=0, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


def _expected(spec: PipeSpec) -> dict:
    from hfzero.parallel.pipeline.cost import estimate_pipeline, stage_shapes
    from hfzero.testing.models import tiny_causal_lm

    config = dict(spec.extra_config)
    shapes = stage_shapes(tiny_causal_lm("llama", layers=spec.layers, hidden=spec.hidden), spec.pp)
    return estimate_pipeline(shapes, pp=spec.pp, dp=4, stage=spec.stage, n_micro=spec.n_micro,
                             accumulation=spec.accumulation, stage3_gather=spec.stage3_gather, dtype="fp32",
                             shard_size=config.get("shard_size", 0), ranks_per_node=config["ranks_per_node"],
                             secondary_partition=config.get("secondary_partition", False),
                             quantize_weights=config.get("quantize_weights"),
                             quantize_gradients=config.get("quantize_gradients"),
                             quantize_block=config.get("quantize_block", 256))


def _check_inter_node_bytes(spec: PipeSpec) -> list[dict]:
    """Measured inter-node bytes of every step equal ``estimate_pipeline``'s ``inter_node_bytes_per_step`` for dp
    rank 0 of each stage (the clip norm's scalars travel on a ledger of their own; the model counts unpadded
    parameters, hence 1e-3). Unquantized, that is 4 x ``inter_node_elements_per_step`` (fp32)."""
    expected = _expected(spec)
    outs = _results()[spec]
    for out in outs:
        pp_rank, dp_rank = out["coords"]
        rank = expected["ranks"][pp_rank]
        if not dict(spec.extra_config).get("quantize_gradients"):
            assert rank["inter_node_bytes_per_step"] == 4 * rank["inter_node_elements_per_step"]
        if dp_rank == 0:
            want = rank["inter_node_bytes_per_step"]
            assert out["inter_node_bytes_per_step"] == [pytest.approx(want, rel=1e-3)] * STEPS, (out["coords"], want)
    assert sum(o["inter_node_bytes_per_step"][0] for o in outs) > 0
    return outs


@pytest.mark.parametrize("spec", NODE_SPECS, ids=["hsdp-stage3-nodes-of-4", "hsdp-stage2-nodes-of-2",
                                                  "flat-stage2-nodes-of-2", "hpz-stage3-nodes-of-2"])
def test_inter_node_bytes_match_the_pipeline_cost_model(spec):
    """The cost model's inter-node bytes, measured; the losses still match the reference."""
    ref_losses, _ = _reference()
    for out in _check_inter_node_bytes(spec):
        torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref_losses), atol=ATOL, rtol=0)


@pytest.mark.parametrize("spec", QGZ_SPECS, ids=["flat-stage2-qgz-int8", "hpz-qwz-qgz-int4-stage3",
                                                 "hsdp-stage2-qgz-int8"])
def test_quantized_gradients_under_a_pipeline(spec):
    """qgZ inside each stage's dp group (its node groups built world-wide by prepare): losses within quantization
    error of the reference (and not equal to it), every stage's replicas equal, inter-node bytes equal to the cost
    model; the per-micro-batch ("sharded") reductions cross nodes quantized, so flat stage 2's M-fold traffic shrinks
    by the closed-form ratio (fp32 4 bytes vs int8's 1 + 4 / 8 per element, on the reductions' share)."""
    ref_losses, _ = _reference()
    outs = _check_inter_node_bytes(spec)
    for out in outs:
        torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref_losses), atol=0, rtol=QGZ_RTOL,
                                   msg=lambda m: f"rank {out['coords']} losses: {m}")
        assert out["losses"] != ref_losses
    by_stage: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for out in outs:  # the replicas of a stage (every dp rank sums the same decoded values) end bitwise equal
        held = by_stage.setdefault(out["coords"][0], out["params"])
        for name, value in out["params"].items():
            torch.testing.assert_close(value, held[name], atol=0, rtol=0, msg=lambda m: f"{out['coords']} {name}: {m}")
    if spec is QGZ_SPECS[0]:  # against the same run unquantized: only the reductions' crossing share changes
        plain = _expected(NODE_SPECS[2])["ranks"][0]
        quantized = _expected(spec)["ranks"][0]
        reduced = plain["comm_elements_per_step"]["reduce_scatter"]  # M x Ψ_s
        assert reduced == spec.n_micro * plain["params"]
        saved = plain["inter_node_bytes_per_step"] - quantized["inter_node_bytes_per_step"]
        assert saved == pytest.approx(reduced * (4 / 2 - 1.5 / 2))  # ring: half of 4 bytes; qgZ: Ψ/L of 1.5


def test_quantized_weight_gathers_under_a_pipeline_stay_near_the_reference():
    """int8 block quantization (block 256, error <= max|x| / 254 per element) of every gathered weight moves the
    losses by far less than the training does."""
    ref_losses, _ = _reference()
    for out in _results()[QWZ]:
        torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref_losses), atol=0, rtol=2e-3)
        assert out["losses"] != ref_losses  # quantized: not the exact run
