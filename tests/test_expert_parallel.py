"""Expert parallelism x ZeRO: a tiny Qwen3-MoE (8 experts, top-2) on 4 gloo ranks, one spawn.

ep2 x edp2 and ep4 x edp1, each at stages 0-3, 10 steps (accumulation 2 in 7 of the 8 cases, under both
accumulation policies): every rank reads its own quarter of the global batch, experts are split over the EP group by the
model's ``base_model_ep_plan`` and reached by all-to-all, ZeRO shards the dense parameters over the world and the
experts over the expert-data-parallel group.
Losses, gradient norms (clipping acts at every step) and every parameter after the steps match a float64
single-process run on the whole global batch within hfzero.testing.parity's rounding bounds (see [Note:
parity against float64] in test_tensor_parallel.py). Also: the loss with the router's auxiliary loss equals
the unsplit model's on each rank's batch; the all-to-all bytes are counted under their own comm kind; a rank
whose tokens pick none of its experts in a layer (stage 3) neither hangs nor falls out of step; checkpoints
reshard ep2 -> ep1 -> ep4 and consolidate to a from_pretrained-loadable model; per-rank model states equal the
estimator's (at stage 3 + ep4, plain stage 3's 16 Psi / 4); bad input is refused before anything starts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hfzero.testing.models import tiny_moe_lm
from hfzero.testing.parity import ParityReference, float64_reference
from hfzero.testing.spawn import run_distributed

STEPS, BATCH, SEQ, WORLD, CLIP, LR = 10, 8, 8, 4, 0.5, 1e-3
CASES = {  # name: (stage, ep_size, micro-batches per step, accumulation policy)
    "ep2_s0_acc2": (0, 2, 2, "auto"),
    "ep2_s1_acc2": (1, 2, 2, "sharded"),
    "ep2_s2_acc2_local": (2, 2, 2, "local"),
    "ep2_s3_acc2": (3, 2, 2, "sharded"),
    "ep4_s0": (0, 4, 1, "auto"),
    "ep4_s1_acc2_local": (1, 4, 2, "local"),
    "ep4_s2_acc2": (2, 4, 2, "sharded"),
    "ep4_s3_acc2": (3, 4, 2, "sharded"),
}
EXPERTS = 8


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 128, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def _reference() -> ParityReference:
    """The float64 run, bounding the cases' fp32 runs: WORLD ranks x 1 or 2 accumulated micro-batches."""
    run_splits = sorted({WORLD * accumulation for _, _, accumulation, _ in CASES.values()})
    return float64_reference(tiny_moe_lm(), lambda model: torch.optim.AdamW(model.parameters(), lr=LR), _batches(),
                             CLIP, run_splits=run_splits)


def _train(rank: int, world: int, stage: int, ep: int, accumulation: int, policy: str) -> dict:
    import torch.distributed as dist

    import hfzero
    from hfzero.parallel.expert import prepare_expert_parallel
    from hfzero.profiler.header import predict

    config = hfzero.ZeroConfig(stage=stage, ep_size=ep, accumulation=policy, reduce_bucket_size=3000,
                               param_persistence_threshold=0)
    model, optimizer, mesh = prepare_expert_parallel(tiny_moe_lm(), lambda p: torch.optim.AdamW(p, lr=LR), config)
    engine = hfzero.get_engine(model)
    losses, norms = [], []
    for ids in _batches():
        mine = ids.chunk(world)[rank].chunk(accumulation)  # A x (B / (W A), T): every rank its own rows
        total = torch.zeros(())
        for index, micro in enumerate(mine):
            loss = model(input_ids=micro, labels=micro).loss / accumulation
            total += loss.detach()
            if index < accumulation - 1:
                with optimizer.no_sync():
                    loss.backward()
            else:
                loss.backward()
        norms.append(optimizer.clip_grad_norm_(CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    prediction = predict(engine, optimizer, accumulation)  # the profiler header's, per partition
    whole = hfzero.full_state_dict(model, rank0_only=False)  # gathers (dense: world, experts: edp); experts over ep
    params = torch.cat([whole[n].reshape(-1) for n, _ in model.named_parameters()])
    experts = model.model.layers[0].mlp.experts
    return {"losses": losses, "norms": norms, "params": params, "edp": mesh.edp_size,
            "local_experts": experts.gate_up_proj.to_local().shape[0] if stage < 3 else experts.num_experts,
            "num_params": engine.num_params, "engine_world": engine.world_size, "average_over": engine.average_over,
            "expert_world": engine.expert_comm.world_size,
            "partitions": sorted({(b.partition, b.shard_world) for b in engine.layout.buckets}),
            "predicted": prediction["model_state_bytes"],
            "predicted_dp": [part["dp"] for part in prediction["partition_inputs"]],
            "model_states": engine.model_state_bytes(), "padded": engine.num_params_padded}


def _aux_loss(rank: int, world: int) -> dict:
    """The first forward's loss with the router's auxiliary loss, on this rank's rows; the all-to-all bytes the
    engine's statistics counted."""
    import hfzero
    from hfzero.parallel.expert import prepare_expert_parallel

    config = hfzero.ZeroConfig(stage=2, ep_size=2)
    model, _, _ = prepare_expert_parallel(tiny_moe_lm(router_logits=True), lambda p: torch.optim.AdamW(p, lr=LR),
                                          config)
    mine = _batches()[0].chunk(world)[rank]
    out = model(input_ids=mine, labels=mine)
    a2a = hfzero.get_engine(model).comm.stats()["all_to_all"]
    return {"loss": out.loss.item(), "aux": out.aux_loss.item(), "a2a_calls": a2a.calls, "a2a_bytes": a2a.bytes}


def _starved(rank: int, world: int) -> dict:
    """Stage 3, ep2: on the ranks of EP group 0 layer 0 routes every token to experts 0 and 1 (EP rank 0's),
    so EP rank 1 of that group receives no token in layer 0 while its edp peer (rank 3) does."""
    import hfzero
    from hfzero.parallel.expert import prepare_expert_parallel

    config = hfzero.ZeroConfig(stage=3, ep_size=2, param_persistence_threshold=0)
    model, optimizer, mesh = prepare_expert_parallel(tiny_moe_lm(), lambda p: torch.optim.AdamW(p, lr=LR), config)
    gate = model.model.layers[0].mlp.gate
    if rank in (0, 1):
        route = gate.forward

        def only_first_two(hidden):
            logits, scores, indices = route(hidden)
            return logits, scores, torch.tensor([0, 1]).expand_as(indices).contiguous()

        gate.forward = only_first_two
    from transformers.distributed.expert_parallel import AllToAllEP

    received = []  # rows each MoE layer's local experts got from the all-to-all, layers in order
    dispatch = AllToAllEP._dispatch_tokens

    def counted(self, *args):
        out = dispatch(self, *args)
        received.append(int(out[0].shape[0]))
        return out

    AllToAllEP._dispatch_tokens = counted  # this spawned process only, until the steps below are done
    try:
        for ids in _batches()[:2]:
            mine = ids.chunk(world)[rank]
            model(input_ids=mine, labels=mine).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        AllToAllEP._dispatch_tokens = dispatch
    whole = hfzero.full_state_dict(model, rank0_only=False)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    return {"received": received, "experts": whole[name], "ep_rank": mesh.ep_rank}


def _checkpoints(rank: int, world: int, root: str) -> dict:
    """ep2 (stage 2) trains 2 steps and saves; ep1 (plain ZeRO over the world, stage 1) loads it and saves again;
    ep4 (stage 3) loads that. Each load starts from another init (seed 1); then every run takes the same step."""
    import hfzero
    from hfzero.checkpoint import load_checkpoint, save_checkpoint
    from hfzero.parallel.expert import prepare_expert_parallel

    def build(stage: int, ep: int, seed: int):
        factory = lambda params: torch.optim.AdamW(params, lr=LR)  # noqa: E731
        config = hfzero.ZeroConfig(stage=stage, ep_size=ep, param_persistence_threshold=0)
        if ep == 1:
            model = tiny_moe_lm(seed=seed)
            return hfzero.prepare(model, factory(model.parameters()), config)
        model, optimizer, _ = prepare_expert_parallel(tiny_moe_lm(seed=seed), factory, config)
        return model, optimizer

    def step(model, optimizer, ids: torch.Tensor) -> None:
        mine = ids.chunk(world)[rank]
        model(input_ids=mine, labels=mine).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def whole(model) -> torch.Tensor:
        state = hfzero.full_state_dict(model, rank0_only=False)
        return torch.cat([state[n].reshape(-1) for n, _ in model.named_parameters()])

    batches = _batches()
    model, optimizer = build(2, 2, seed=0)
    for ids in batches[:2]:
        step(model, optimizer, ids)
    save_checkpoint(f"{root}/ep2", model, optimizer)
    out = {"saved": whole(model), "loaded": {}, "after": {}}
    step(model, optimizer, batches[2])
    out["after"]["ep2"] = whole(model)
    for name, (stage, ep, source) in {"ep1": (1, 1, "ep2"), "ep4": (3, 4, "ep1")}.items():
        model, optimizer = build(stage, ep, seed=1)
        load_checkpoint(f"{root}/{source}", model, optimizer)
        out["loaded"][name] = whole(model)
        save_checkpoint(f"{root}/{name}", model, optimizer)
        step(model, optimizer, batches[2])
        out["after"][name] = whole(model)
    return out


def _worker(rank: int, world: int, root: str) -> dict:
    out = {name: _train(rank, world, *case) for name, case in CASES.items()}
    out["aux"] = _aux_loss(rank, world)
    out["starved"] = _starved(rank, world)
    out["checkpoints"] = _checkpoints(rank, world, root)
    return out


@pytest.fixture(scope="module")
def checkpoints_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ep_checkpoints")


@pytest.fixture(scope="module")
def results(checkpoints_root: Path) -> tuple[list[dict], ParityReference]:
    return run_distributed(_worker, WORLD, str(checkpoints_root), timeout=900), _reference()


@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_zero_matches_single_process(results, case: str) -> None:
    ranks, ref = results
    assert min(ref.norms) > CLIP  # clipping acts at every step
    for rank in ranks:
        got = rank[case]
        ref.check_losses(got["losses"])
        # the acceptance, literally: every step's loss within 1e-5 of the single-process run's
        assert max(abs(a - b) for a, b in zip(got["losses"], ref.losses, strict=True)) <= 1e-5
        ref.check_norms(got["norms"])
        ref.bound.check(got["params"], ref.params)


def test_experts_are_split_dense_sharded_over_the_world_experts_over_edp(results) -> None:
    from hfzero.planning.estimate import expert_parallel_bytes, model_states_bytes

    ranks, _ = results
    model = tiny_moe_lm()
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    dense = sum(p.numel() for p in model.parameters()) - experts
    for rank in ranks:
        for name, (stage, ep, _, _) in CASES.items():
            got = rank[name]
            assert got["local_experts"] == EXPERTS // ep
            assert got["edp"] == got["expert_world"] == WORLD // ep
            assert got["engine_world"] == WORLD  # the dense parameters' group
            # dense buckets (partition 0) split over the world, expert buckets (1) over edp; stage 0 splits none
            assert got["partitions"] == ([(0, 1), (1, 1)] if stage == 0 else [(0, WORLD), (1, WORLD // ep)])
            assert got["average_over"] == WORLD  # summed over the world (experts: over edp of the EP exchange's)
            assert got["num_params"] == dense + experts // ep  # each rank lays out its E / ep experts
            # fp32 AdamW after a step: parameters 4, gradients 4 (zeroed, kept), K = 8 bytes per element,
            # laid out with padding (num_params_padded); the estimator's formula on the padded count
            estimate = expert_parallel_bytes(dense * got["padded"] / got["num_params"],
                                             experts * got["padded"] / got["num_params"], WORLD, ep, stage,
                                             param_bytes=4, grad_bytes=4, optimizer_k=8).total
            assert got["model_states"] == pytest.approx(estimate, rel=0.01)
            assert got["predicted_dp"] == [WORLD, WORLD // ep]  # the profiler's prediction: dense / expert groups
            if stage == 3:  # sharded accumulation: nothing held beyond the step's model states
                assert got["model_states"] == pytest.approx(got["predicted"], rel=0.01)
            if (stage, ep) == (3, WORLD):  # 16 Psi_d / 4 + 16 Psi_e / 4: plain stage 3's bytes over the world
                ratio = got["padded"] / got["num_params"]
                assert estimate == pytest.approx(16 * (dense + experts) * ratio / WORLD)
                plain = model_states_bytes((dense + experts) * ratio, WORLD, 3, param_bytes=4, grad_bytes=4,
                                           optimizer_k=8)
                assert got["model_states"] == pytest.approx(plain, rel=0.01)
                assert got["model_states"] == pytest.approx(16 * (dense + experts) / WORLD, rel=0.01)


def test_router_aux_loss_is_the_models_own(results) -> None:
    """The EP model's loss with the router auxiliary loss, on each rank's rows, equals the unsplit model's."""
    ranks, _ = results
    model = tiny_moe_lm(router_logits=True)
    for rank, got in enumerate(ranks):
        rows = _batches()[0].chunk(WORLD)[rank]
        out = model(input_ids=rows, labels=rows)
        assert out.aux_loss.item() > 0
        assert got["aux"]["aux"] == pytest.approx(out.aux_loss.item(), abs=1e-6)
        assert got["aux"]["loss"] == pytest.approx(out.loss.item(), abs=1e-5)


def test_all_to_all_bytes_are_counted(results) -> None:
    """Each MoE layer's exchange is counted under its own comm kind (one dispatch per layer per forward; a
    rank sends at least one row: 16 rows x top-2 over 2 EP ranks)."""
    for got in results[0]:
        assert got["aux"]["a2a_calls"] == 2
        assert got["aux"]["a2a_bytes"] >= 2 * 32 * 4  # both ways (forward + backward counted), 32 fp32 per row


def test_checkpoints_reshard_across_ep_sizes_and_consolidate(results, checkpoints_root: Path, tmp_path: Path) -> None:
    """ep2 -> ep1 (no EP) -> ep4: every load gives exactly the saved parameters (from another init), and the
    next step agrees (the optimizer states moved too: a lost Adam state would move elements by ~lr); the
    consolidated ep2 checkpoint loads with from_pretrained, every expert whole."""
    import json

    from transformers import AutoModelForCausalLM

    from hfzero.checkpoint import consolidate

    ranks, _ = results
    for got in ranks:
        ckpt = got["checkpoints"]
        for name in ("ep1", "ep4"):
            assert torch.equal(ckpt["loaded"][name], ranks[0]["checkpoints"]["saved"]), name
            torch.testing.assert_close(ckpt["after"][name], ckpt["after"]["ep2"], rtol=0, atol=LR / 100)
        assert not torch.equal(ckpt["after"]["ep2"], ckpt["saved"])
    root = checkpoints_root
    manifest = json.loads((root / "ep2" / "manifest.json").read_text())
    assert manifest["world_size"] == WORLD and manifest["expert_parallel"] == {"ep_size": 2, "edp_size": 2}
    consolidate(root / "ep2", tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == EXPERTS
    got = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(got, ranks[0]["checkpoints"]["saved"])


def test_a_rank_without_tokens_for_its_experts_keeps_step(results) -> None:
    """Stage 3: EP rank 1 of group 0 received no token in layer 0 yet took part in every collective; its
    experts, updated from its edp peer's tokens, stay equal to that peer's."""
    ranks, _ = results
    starved = ranks[1]["starved"]
    assert starved["ep_rank"] == 1
    layers = 2
    assert starved["received"][::layers] == [0, 0]  # layer 0, both steps: no token for its experts
    assert all(n > 0 for n in starved["received"][1::layers])  # layer 1 routes as the model does
    assert all(n > 0 for n in ranks[3]["starved"]["received"])
    for rank in ranks:
        torch.testing.assert_close(rank["starved"]["experts"], ranks[0]["starved"]["experts"], rtol=0, atol=0)
    assert not torch.equal(ranks[0]["starved"]["experts"], tiny_moe_lm().model.layers[0].mlp.experts.gate_up_proj)


def test_bad_expert_parallel_input_is_a_clear_error() -> None:
    import hfzero
    from hfzero.config import ConfigError
    from hfzero.integrations.launch import plan
    from hfzero.parallel.expert import check_ep_size, check_expert_parallel
    from hfzero.testing.models import tiny_causal_lm

    with pytest.raises(ConfigError, match="ep_size=3 does not divide the world size 4"):
        check_ep_size(4, 3)
    with pytest.raises(ConfigError, match="ep_size=4 does not divide the 6 experts of model.layers.0.mlp.experts"):
        check_expert_parallel(tiny_moe_lm(experts=6), hfzero.ZeroConfig(ep_size=4), 4)
    with pytest.raises(ConfigError, match="no expert-parallel plan .*base_model_ep_plan"):
        check_expert_parallel(tiny_causal_lm("llama"), hfzero.ZeroConfig(ep_size=2), 4)
    with pytest.raises(ConfigError, match="ep_size cannot be combined with tp_size"):
        hfzero.ZeroConfig(ep_size=2, tp_size=2)
    with pytest.raises(ConfigError, match='ep_size cannot be combined with dtype="fp16"'):
        hfzero.ZeroConfig(ep_size=2, dtype="fp16")
    with pytest.raises(ConfigError, match="--zero_ep_size and --zero_pp_size cannot be combined yet"):
        plan(["--nproc_per_node", "4", __file__, "--zero_ep_size", "2", "--zero_pp_size", "2"], environ={})
    with pytest.raises(ConfigError, match="ep_size=3 does not divide the world size 4"):
        plan(["--nproc_per_node", "4", __file__, "--zero_ep_size", "3"], environ={})
    with pytest.raises(ConfigError, match="config.ep_size=2 but the expert-parallel group has 1"):
        model = tiny_moe_lm()
        hfzero.prepare(model, torch.optim.AdamW(model.parameters()), hfzero.ZeroConfig(ep_size=2))


@pytest.mark.parametrize("sharded", [True, False])
def test_layout_partitions_never_mix_and_each_element_is_written_once(sharded: bool) -> None:
    """In process, 4 simulated ranks of ep2 x edp2: dense parameters (partition 0, the world) and expert ones
    (partition 1, edp) never share a bucket; each bucket's chunk follows its partition's size; stages 1-3
    (``sharded``) and stage 0 alike, the ranks holding the same experts write each of their elements once, and
    the world writes each dense element once (checkpoint/ranges.py)."""
    from torch import nn

    from hfzero.checkpoint.ranges import written_ranges
    from hfzero.runtime.layout import FlatLayout, Partition

    params = [nn.Parameter(torch.zeros(n)) for n in (37, 50, 13, 64, 9, 100)]
    expert = {id(p) for p in params[1::2]}  # every other parameter an expert
    named = [(i, f"p{i}", p) for i, p in enumerate(params)]
    covered: dict[tuple[str, int], list[int]] = {}  # (name, ep rank of an expert / -1 dense) -> element counts
    for rank in range(WORLD):
        ep_rank, edp_rank = rank % 2, rank // 2
        layout = FlatLayout([named], 60, WORLD if sharded else 1, rank,
                            partitions=[Partition(WORLD, rank, sharded), Partition(2, edp_rank, sharded)],
                            partition_of=lambda p: 1 if id(p) in expert else 0)
        for bucket in layout.buckets:
            assert len({id(s.param) in expert for s in bucket.slots}) == 1
            assert bucket.partition == (1 if id(bucket.slots[0].param) in expert else 0)
            shards = (WORLD if bucket.partition == 0 else 2) if sharded else 1
            assert bucket.shard_world == shards and bucket.chunk * shards == bucket.padded
        for r in written_ranges(layout, rank, WORLD):
            key = (r.name, ep_rank if id(params[int(r.name[1:])]) in expert else -1)
            counts = covered.setdefault(key, [0] * params[int(r.name[1:])].numel())
            for element in range(r.start, r.end):
                counts[element] += 1
    for (name, ep_rank), counts in covered.items():
        assert counts == [1] * len(counts), (name, ep_rank)
    assert len(covered) == 3 + 3 * 2  # every dense parameter once, every expert on both EP ranks
