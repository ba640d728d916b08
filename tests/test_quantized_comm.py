"""Quantized collectives (ZeRO++ qwZ / qgZ): the block codec's error bound, bad input, the estimator, and one spawn of
4 gloo ranks simulating 2 nodes of 2 (``ranks_per_node=2``) that checks:

1. the quantized gather (each other rank's chunk within the per-block bound, the own chunk exact) and the
   hierarchical quantized reduce-scatter (within the two hops' bound of the exact sum);
2. training a tiny GPT-2 on a learnable sequence task at stage 3 with hpZ, unquantized against hpZ + qwZ + qgZ
   int8 and int4 and against stage 2 with qwZ + qgZ int8: losses within 1% (relative) at every step after 5
   warm-up steps, and each step's inter-node bytes equal to the exact per-bucket model
   (``hfzero.planning.quantized.layout_*``), and the estimator's Ψ-level model (no block padding) below it by
   at most 15% on this tiny model (exact unquantized; within 2% on benchmarks/scale_out.py's 1.33M model);
3. stage 3's ``full_state_dict`` gathers exactly under qwZ;
4. fp16 with an inf loss on rank 1 at step 1 under qwZ + qgZ: the step is skipped on every rank;
5. qgZ error feedback: repeated reductions' mean converges to the exact sum; its residuals are model states of the
   estimator's size; the quantized collectives' buffers are kept across steps (no allocation after the first step);
6. qgZ under tensor parallelism (tp 2 x dp 2, the dp groups TP apart and crossing nodes), stages 2 and 3: losses
   within 2e-4 (relative) of the unquantized TP run, inter-node bytes equal to the models;
7. error-feedback residuals in checkpoints: a run resumed after 2 steps equals the uninterrupted one bit for bit
   (losses and parameters; without the residuals it does not), and a load into another layout drops them, warning once.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist

from hfzero import ZeroConfig, get_engine, prepare
from hfzero.comm.collectives import Communicator
from hfzero.config import ConfigError
from hfzero.planning.quantized import (layout_gather_bytes, layout_reduce_bytes, node_comm_bytes_per_step)
from hfzero.profiler.header import predict
from hfzero.comm.codec import dequantize_rows, levels, packed_row_bytes, quantize_rows
from hfzero.comm.quantized import QuantizedGather, build_quantized_reduce
from hfzero.roles import MODEL_STATE_ROLES
from hfzero.runtime.stage3 import full_state_dict
from hfzero.testing import run_distributed
from hfzero.testing.models import tiny_causal_lm
from hfzero.testing.workloads import TrainSpec, train_zero

WORLD, PER_NODE, STEPS, WARMUP, BATCH, SEQ, VOCAB = 4, 2, 16, 5, 16, 16, 128
EF_ROUNDS = 16
EF_EXTRA = (("param_persistence_threshold", 0), ("quantize_gradients", "int4"), ("quantize_block", 64),
            ("quantize_error_feedback", True))
EF_SAVE_AT, EF_STEPS = 2, 4
"""Error-feedback residuals in checkpoints: save after 2 steps, resume for 2 more."""
TP, TP_STEPS, TP_BLOCK, TP_RTOL = 2, 4, 8, 2e-4
"""qgZ under tensor parallelism: tp 2 x dp 2 on the same 4 ranks, 4 steps at lr 1e-3, block 8; losses within
``TP_RTOL`` (relative) of the unquantized TP run (as tests/test_hsdp_pipeline.py's QGZ_RTOL)."""
BASE = (("ranks_per_node", PER_NODE), ("param_persistence_threshold", 0))
HPZ = BASE + (("secondary_partition", True),)
CASES = {  # name -> (stage, extra config)
    "hpZ": (3, HPZ),
    "hpZ+qwZ+qgZ int8": (3, HPZ + (("quantize_weights", "int8"), ("quantize_gradients", "int8"))),
    "hpZ+qwZ+qgZ int4": (3, HPZ + (("quantize_weights", "int8"), ("quantize_gradients", "int4"),
                                   ("quantize_block", 64))),
    "stage 2 qwZ+qgZ int8": (2, BASE + (("quantize_weights", "int8"), ("quantize_gradients", "int8"))),
    "stage 2 qgZ int4 + error feedback": (2, BASE + (("quantize_gradients", "int4"), ("quantize_block", 64),
                                                     ("quantize_error_feedback", True))),
}
OVERFLOW = TrainSpec(stage=3, dtype="fp16", steps=3, overflow_step=1,
                     extra_config=HPZ + (("quantize_weights", "int8"), ("quantize_gradients", "int8")))


# ---- the codec -----------------------------------------------------------------------------------------
def _bound(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """scale / 2 per element (scale = max|x| of its block / L), with fp32 rounding slack."""
    n = x.numel()
    padded = torch.zeros(-(-n // block) * block)
    padded[:n] = x
    scale = padded.view(-1, block).abs().amax(1, keepdim=True) / levels(bits)
    return (scale / 2 * (1 + 1e-6) + 1e-30).expand(-1, block).reshape(-1)[:n]


@pytest.mark.parametrize("bits,block", [(8, 1), (8, 7), (8, 256), (4, 2), (4, 64), (4, 256)])
def test_block_error_bound(bits: int, block: int):
    g = torch.Generator().manual_seed(bits * 1000 + block)
    x = torch.randn(3, 1001, generator=g) * torch.logspace(-6, 3, 1001)  # magnitudes vary across blocks
    x[1, :300] = 0  # zero blocks decode exactly
    packed = quantize_rows(x, bits, block)
    assert packed.dtype == torch.uint8 and packed.shape == (3, packed_row_bytes(1001, bits, block))
    decoded = dequantize_rows(packed, 1001, bits, block, torch.empty(3, 1001))
    for row in range(3):
        assert torch.all((x[row] - decoded[row]).abs() <= _bound(x[row], bits, block))
    assert torch.equal(decoded[1, : 300 - 300 % block], x[1, : 300 - 300 % block])


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_nonfinite_block_decodes_to_nan(bad: float):
    x = torch.randn(1, 64)
    x[0, 20] = bad
    decoded = dequantize_rows(quantize_rows(x, 8, 16), 64, 8, 16, torch.empty(1, 64, dtype=torch.bfloat16))
    assert torch.isnan(decoded[0, 16:32]).all()  # the whole block: an overflow is never hidden
    assert torch.isfinite(decoded[0, :16]).all() and torch.isfinite(decoded[0, 32:]).all()


# ---- bad input and the estimator ------------------------------------------------------------------------
@pytest.mark.parametrize("options,words", [
    ({"stage": 3, "quantize_block": 0}, ">= 1"),
    ({"stage": 0, "quantize_weights": "int8"}, "stage 0"),
    ({"stage": 0, "quantize_gradients": "int4"}, "stage 0"),
    ({"stage": 3, "quantize_weights": "int4"}, '"int8"'),
    ({"stage": 2, "quantize_gradients": "fp8"}, '"int4"'),
    ({"stage": 2, "quantize_gradients": "int4", "quantize_block": 255}, "even"),
    ({"stage": 2, "quantize_gradients": "int8", "ep_size": 2}, "ep_size or sp_size"),
    ({"stage": 2, "quantize_error_feedback": True}, "set quantize_gradients"),
])
def test_config_rejects(options: dict, words: str):
    with pytest.raises(ConfigError, match=words):
        ZeroConfig(**options)


def test_config_strings():
    config = ZeroConfig.from_strings({"stage": "3", "quantize_weights": "INT8", "quantize_gradients": "none"})
    assert config.quantize_weights == "int8" and config.quantize_gradients is None


def test_estimator_bars_bf16():
    """ZeRO++'s acceptance in 16-bit on 2 nodes of 2: inter-node bytes vs flat stage 3."""
    psi = 1e8
    flat = node_comm_bytes_per_step(psi, 4, 3, nodes=2)[1]
    hpz = node_comm_bytes_per_step(psi, 4, 3, nodes=2, secondary_partition=True)[1]
    q8 = node_comm_bytes_per_step(psi, 4, 3, nodes=2, secondary_partition=True, quantize_weights="int8",
                                  quantize_gradients="int8")[1]
    q4 = node_comm_bytes_per_step(psi, 4, 3, nodes=2, secondary_partition=True, quantize_weights="int8",
                                  quantize_gradients="int4")[1]
    assert flat / hpz >= 1.45 and flat / q8 >= 2.8 and flat / q4 >= 3.5


# ---- one spawn -----------------------------------------------------------------------------------------
def _sequences(step: int) -> torch.Tensor:
    """A learnable task: each row counts up from a random start by a random stride, mod VOCAB. (BATCH, SEQ)"""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    stride = torch.randint(1, 5, (BATCH, 1), generator=g)
    return (start + stride * torch.arange(SEQ)) % VOCAB


def _layout_inter_bytes(engine, stage: int, extra: dict) -> int:
    """Exact inter-node bytes per step: per bucket, the forward (stage 3) or post-step (stages 1-2) gather crosses
    with half its bytes (2 of 4 ring hops), hpZ's backward gathers with none, qgZ's inter hop with all of it; plus the
    clip norm's all-reduce of one fp32 element."""
    block = extra.get("quantize_block", 256)
    total = 4  # the norm: 2 x 4 bytes, half crossing
    for bucket in engine.layout.buckets:
        chunk = bucket.padded // WORLD
        total += layout_gather_bytes(chunk, WORLD, extra.get("quantize_weights"), block, 4) // 2
        if extra.get("quantize_gradients"):
            total += layout_reduce_bytes(chunk, PER_NODE, WORLD // PER_NODE, extra["quantize_gradients"], block)[1]
        else:
            total += chunk * WORLD * 4 // 2
        if stage == 3 and not extra.get("secondary_partition"):
            total += layout_gather_bytes(chunk, WORLD, extra.get("quantize_weights"), block, 4) // 2
    return total


def _step(model, opt, engine, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, int]]:
    """One clipped training step on ``ids``: its loss and the inter-node bytes each comm kind moved in it."""
    before = engine.comm.stats()
    loss = model(input_ids=ids, labels=ids).loss
    opt.backward(loss)
    opt.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
    after = engine.comm.stats()
    return loss, {k: s.inter_node_bytes - (before[k].inter_node_bytes if k in before else 0) for k, s in after.items()}


def _train(stage: int, extra: dict) -> dict:
    model = tiny_causal_lm("gpt2", vocab=VOCAB, positions=SEQ)
    config = ZeroConfig(stage=stage, reduce_bucket_size=8192, **extra)
    model, opt = prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3), config)
    engine = get_engine(model)
    rank = dist.get_rank()
    losses, inter, allocations = [], [], []
    for step in range(STEPS):
        loss, crossed = _step(model, opt, engine, _sequences(step).chunk(WORLD)[rank])
        inter.append(sum(crossed.values()))
        value = loss.detach().reshape(1).clone()
        dist.all_reduce(value)
        losses.append(value.item() / WORLD)
        allocations.append(sum(part.allocations() for part in (engine.param_gather, engine.reducer.scatter)
                               if hasattr(part, "allocations")))
    exact_state_dict = None
    if stage == 3:  # full_state_dict gathers exactly even with qwZ
        state = full_state_dict(model, rank0_only=False)
        names = {p: n for n, p in model.named_parameters()}
        exact_state_dict = True
        for bucket in engine.layout.buckets:
            full = torch.empty(bucket.padded)
            engine.comm.all_gather(full, engine._shard_views[bucket.index])
            exact_state_dict &= all(torch.equal(full[s.offset: s.offset + s.numel].view(s.shape), state[names[s.param]])
                                    for s in bucket.slots)
    estimate = node_comm_bytes_per_step(
        engine.num_params_padded, WORLD, stage, nodes=WORLD // PER_NODE, param_bytes=4, grad_bytes=4,
        secondary_partition=extra.get("secondary_partition", False), quantize_weights=extra.get("quantize_weights"),
        quantize_gradients=extra.get("quantize_gradients"), quantize_block=extra.get("quantize_block", 256))[1]
    roles = {k.value: v for k, v in engine.memory_by_role().items()}
    return {"losses": losses, "inter": inter, "layout_inter": _layout_inter_bytes(engine, stage, extra),
            "estimate_inter": estimate + 4, "exact_state_dict": exact_state_dict, "allocations": allocations,
            "roles": roles, "model_state_bytes": engine.model_state_bytes(), "padded": engine.num_params_padded,
            "predicted_model_state_bytes": predict(engine, opt)["model_state_bytes"]}


def _collectives() -> dict:
    """The quantized gather and reduce-scatter on random data, against exact results."""
    rank = dist.get_rank()
    comm = Communicator(None, ranks_per_node=PER_NODE)
    g = torch.Generator().manual_seed(rank)
    chunk, block = 1000, 64
    shard = torch.randn(chunk, generator=g) * torch.logspace(-3, 2, chunk)
    full = torch.empty(WORLD * chunk)
    QuantizedGather(comm, "int8", block).all_gather(full, shard)
    exact = torch.empty(WORLD * chunk)
    comm.all_gather(exact, shard)
    rows, exact_rows = full.view(WORLD, chunk), exact.view(WORLD, chunk)
    gather_ok = torch.equal(rows[rank], shard) and all(
        torch.all((exact_rows[r] - rows[r]).abs() <= _bound(exact_rows[r], 8, block)) for r in range(WORLD))
    grads = torch.randn(WORLD * chunk, generator=g)
    reduce = build_quantized_reduce(comm, "int4", block, [list(range(WORLD))])
    out = torch.empty(chunk)
    reduce.reduce_scatter(out, grads.clone())
    total = grads.clone()
    comm.all_reduce(total)
    amax = torch.tensor([grads.abs().max().item()])
    comm.all_reduce(amax, op=dist.ReduceOp.MAX)
    # two hops, each within scale / 2 per value summed over the ranks it sums: <= W x max|x| / L overall
    err = (total.view(WORLD, chunk)[rank] - out).abs().max().item()
    # error feedback: the same gradient reduced again and again; the running mean of the results converges to the
    # exact sum with it (each reduction pays back the last one's error), stays off by one reduction's error without
    mean_err = {}
    for feedback in (False, True):
        reduce = build_quantized_reduce(comm, "int4", block, [list(range(WORLD))], error_feedback=feedback)
        running = torch.zeros(chunk)
        for _ in range(EF_ROUNDS):
            reduce.reduce_scatter(out, grads.clone(), key=0)
            running += out
        mean_err[feedback] = (total.view(WORLD, chunk)[rank] - running / EF_ROUNDS).abs().max().item()
    return {"gather_ok": bool(gather_ok), "reduce_err": err, "reduce_bound": WORLD * amax.item() / levels(4),
            "hops": reduce.hop_sizes(), "ef_mean_err": mean_err, "residual_bytes": reduce.residual_bytes(),
            "reduce_allocations": reduce.allocations(), "chunk": chunk}


def _tp_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.config.use_cache = False
    return model.float()


def _train_tp(stage: int, quantize: str | None) -> dict:
    """tp 2 x dp 2 (dp groups {0, 2} and {1, 3}: ranks TP apart, one per node), qgZ or not: losses (the mean over the
    dp ranks) and per collective kind the inter-node bytes of each step."""
    from hfzero.parallel.tensor import prepare_tensor_parallel

    extra = {"quantize_gradients": quantize, "quantize_block": TP_BLOCK} if quantize else {}
    config = ZeroConfig(stage=stage, tp_size=TP, reduce_bucket_size=4096, ranks_per_node=PER_NODE,
                        param_persistence_threshold=0, **extra)
    model, opt, _ = prepare_tensor_parallel(_tp_llama(), lambda params: torch.optim.AdamW(params, lr=1e-3), config)
    engine = get_engine(model)
    dp_rank = dist.get_rank() // TP
    losses, inter = [], []
    for step in range(TP_STEPS):
        loss, crossed = _step(model, opt, engine, _sequences(step).chunk(WORLD // TP)[dp_rank])
        inter.append(crossed)
        value = loss.detach().reshape(1).clone()
        dist.all_reduce(value)
        losses.append(value.item() / WORLD)
    layout = 0  # per bucket: the gathers (stage 3: forward and backward) and qgZ's inter hop, all crossing
    for bucket in engine.layout.buckets:
        chunk = bucket.padded // engine.world_size
        layout += layout_gather_bytes(chunk, engine.world_size, None, TP_BLOCK, 4) * (2 if stage == 3 else 1)
        layout += (layout_reduce_bytes(chunk, 1, WORLD // PER_NODE, quantize, TP_BLOCK)[1] if quantize
                   else chunk * engine.world_size * 4)
    estimate = node_comm_bytes_per_step(engine.num_params_padded, engine.world_size, stage, nodes=WORLD // PER_NODE,
                                        param_bytes=4, grad_bytes=4, quantize_gradients=quantize,
                                        quantize_block=TP_BLOCK)[1]
    hops = engine.reducer.scatter.hop_sizes() if quantize else None
    return {"losses": losses, "inter": inter, "layout_inter": layout, "estimate_inter": estimate, "hops": hops,
            "dp_ranks": engine.comm.global_ranks}


def _ef_build(per_node: int = PER_NODE, seed: int = 0):
    model = tiny_causal_lm("gpt2", vocab=VOCAB, positions=SEQ, seed=seed)
    config = ZeroConfig(stage=2, reduce_bucket_size=8192, **dict(EF_EXTRA), ranks_per_node=per_node)
    return prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3), config)


def _ef_steps(model, opt, steps: range) -> list[float]:
    rank, losses = dist.get_rank(), []
    for step in steps:
        mine = _sequences(step).chunk(WORLD)[rank]
        loss = model(input_ids=mine, labels=mine).loss
        opt.backward(loss)
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _resume_with_error_feedback(root: str) -> dict:
    """Train EF_SAVE_AT steps with qgZ int4 + error feedback, save (asynchronously), go on to EF_STEPS; a fresh run
    loads the checkpoint and trains the same steps (its residuals restored); a control drops them after the load;
    a load on other simulated nodes (one node of 4: another qgZ layout) drops them with a warning."""
    import logging

    from hfzero.checkpoint import load_checkpoint, save_checkpoint

    params = lambda m: [p.detach().clone() for p in m.parameters()]  # noqa: E731
    residuals = lambda m: {k: v.clone() for k, v in get_engine(m).reducer.scatter.residual_state().items()}  # noqa
    directory = f"{root}/ef"
    model, opt = _ef_build()
    _ef_steps(model, opt, range(EF_SAVE_AT))
    save_checkpoint(directory, model, opt, async_save=True)
    saved = residuals(model)
    uninterrupted = _ef_steps(model, opt, range(EF_SAVE_AT, EF_STEPS))
    final = params(model)
    out = {"saved_keys": sorted(saved), "uninterrupted": uninterrupted}
    for name, control in (("resumed", False), ("control", True)):
        model, opt = _ef_build(seed=1)
        load_checkpoint(directory, model, opt)
        if name == "resumed":
            loaded = residuals(model)
            out["restored"] = loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
        if control:
            get_engine(model).reducer.scatter.load_residual_state({}, torch.device("cpu"))
        out[name] = _ef_steps(model, opt, range(EF_SAVE_AT, EF_STEPS))
        out[name + "_params_equal"] = all(torch.equal(a, b) for a, b in zip(params(model), final))
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("hfzero.checkpoint.residuals").addHandler(handler)
    model, opt = _ef_build(per_node=WORLD)
    _ef_steps(model, opt, range(1))  # residuals of its own layout, which the load must drop too
    load_checkpoint(directory, model, opt)
    logging.getLogger("hfzero.checkpoint.residuals").removeHandler(handler)
    out["reshard_residual_bytes"] = get_engine(model).reducer.scatter.residual_bytes()
    out["reshard_warnings"] = warnings
    return out


def _all(rank: int, world: int, root: str) -> dict:
    return {"collectives": _collectives(), "resume": _resume_with_error_feedback(root),
            "train": {name: _train(stage, dict(extra)) for name, (stage, extra) in CASES.items()},
            "tp": {(stage, q): _train_tp(stage, q) for stage in (2, 3) for q in (None, "int8")},
            "overflow": train_zero(rank, world, OVERFLOW)["skipped"]}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_distributed(_all, WORLD, str(tmp_path_factory.mktemp("quantized")), timeout=900)


def test_quantized_collectives_within_bounds(results):
    for r in results:
        c = r["collectives"]
        assert c["gather_ok"]
        assert c["hops"] == (PER_NODE, WORLD // PER_NODE)
        assert c["reduce_err"] <= c["reduce_bound"], c


def test_error_feedback_pays_back_the_quantization_error(results):
    for r in results:
        c = r["collectives"]
        without, with_feedback = c["ef_mean_err"][False], c["ef_mean_err"][True]
        assert with_feedback < without / 4, c["ef_mean_err"]  # measured ~1/30 after 16 rounds
        assert c["residual_bytes"] == 4 * (WORLD * c["chunk"] + WORLD * c["chunk"] // PER_NODE)  # Ψ + Ψ / L, fp32
        assert c["reduce_allocations"] == 6  # the kept buffers, not one set per call


def test_error_feedback_residuals_are_model_states(results):
    """QUANT_RESIDUAL equals the estimator's formula on the padded count and is in model_state_bytes; the quantized
    collectives' kept buffers (COMM_BUFFER) stop allocating after the first step."""
    from hfzero.planning.quantized import error_feedback_bytes

    for r in results:
        run = r["train"]["stage 2 qgZ int4 + error feedback"]
        assert run["roles"]["quant_residual"] == error_feedback_bytes(run["padded"], WORLD, nodes=WORLD // PER_NODE)
        states = {role.value for role in MODEL_STATE_ROLES}
        assert run["model_state_bytes"] == sum(v for k, v in run["roles"].items() if k in states)
        assert "quant_residual" in states
        # the profile's prediction counts the residuals (bucket padding aside: within 1%)
        assert run["predicted_model_state_bytes"] == pytest.approx(run["model_state_bytes"], rel=1e-2)
        without = r["train"]["stage 2 qwZ+qgZ int8"]
        assert "quant_residual" not in without["roles"]
        for name, run in r["train"].items():
            if "q" in name:
                assert run["roles"]["comm_buffer"] > 0, name
                assert run["allocations"][1] == run["allocations"][-1], (name, run["allocations"])


def test_quantized_training_close_to_unquantized(results):
    base = results[0]["train"]["hpZ"]["losses"]
    assert base[-1] < 0.9 * base[0]  # the task is learnt, so closeness means something
    for name, run in results[0]["train"].items():
        for step in range(WARMUP, STEPS):
            assert math.isclose(run["losses"][step], base[step], rel_tol=0.01), (name, step, run["losses"], base)


def test_inter_node_bytes_equal_models(results):
    for r in results:
        for name, run in r["train"].items():
            assert set(run["inter"]) == {run["layout_inter"]}, (name, run["inter"], run["layout_inter"])
            # the estimator does not pad each chunk to whole blocks: on this tiny model (chunks of a few hundred
            # elements in the small units) that is up to ~11%; exact without quantization; benchmarks/scale_out.py
            # checks 2% on a 1.33M model
            slack = 0.15 if "q" in name else 0.0
            assert run["estimate_inter"] <= run["layout_inter"] <= (1 + slack) * run["estimate_inter"], name
    train = results[0]["train"]
    flat_hpz = train["hpZ"]["layout_inter"]
    assert flat_hpz / train["hpZ+qwZ+qgZ int8"]["layout_inter"] > 2.5  # fp32: qwZ ~4x, qgZ ~4x / 8x on its part


def test_state_dict_exact_under_qwz(results):
    for r in results:
        for name, run in r["train"].items():
            assert run["exact_state_dict"] in (True, None), name


def test_fp16_overflow_skips_on_every_rank(results):
    for r in results:
        assert r["overflow"] == [False, True, False]


def test_estimate_cli_quantized(capsys):
    from hfzero.cli import main

    argv = ["estimate", "--params", "1e8", "--dp", "4", "--nodes", "2", "--secondary-partition", "--json"]
    assert main(argv + ["--quantize-weights", "int8", "--quantize-gradients", "int4"]) == 0
    quantized = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert quantized["quantization"] == {"weights": "int8", "gradients": "int4", "block": 256}
    ratio = plain["comm_inter_node_bytes_per_step"]["3"] / quantized["comm_inter_node_bytes_per_step"]["3"]
    flat = node_comm_bytes_per_step(1e8, 4, 3, nodes=2)[1]  # both runs have hpZ (1/1.5 of flat): 3.92 / 1.5 apart
    assert ratio == pytest.approx(flat / quantized["comm_inter_node_bytes_per_step"]["3"] / 1.5)
    assert ratio == pytest.approx(3.918 / 1.5, rel=1e-3)
    assert main(argv[:-1] + ["--quantize-gradients", "int4", "--quantize-block", "255"]) == 2


def test_error_feedback_in_the_estimators(capsys):
    """The residuals' formula in ``hfzero estimate`` and the pipeline cost model: fp32 Ψ (intra hop) + Ψ / L (inter
    hop) per rank on nodes of L = 2; nothing when the group lies inside one node but its intra hop (Ψ)."""
    from hfzero.cli import main
    from hfzero.planning.quantized import error_feedback_bytes
    from hfzero.parallel.pipeline.cost import StageShape, estimate_pipeline

    assert error_feedback_bytes(1e8, 4, nodes=2) == 4 * 1.5e8
    assert error_feedback_bytes(1e8, 4, nodes=1) == 4 * 1e8
    assert error_feedback_bytes(1e8, 4, nodes=4) == 4 * 1e8  # one rank per node: the inter hop only
    argv = ["estimate", "--params", "1e8", "--dp", "4", "--nodes", "2", "--quantize-gradients", "int8", "--json"]
    assert main(argv + ["--quantize-error-feedback"]) == 0
    assert json.loads(capsys.readouterr().out)["error_feedback_bytes"] == 4 * 1.5e8
    assert main(argv[:-3] + ["--quantize-error-feedback"]) == 2  # without --quantize-gradients
    shapes = [StageShape(1000, 0, 2)] * 2
    ranks = estimate_pipeline(shapes, pp=2, dp=4, stage=2, n_micro=4, ranks_per_node=2, quantize_gradients="int8",
                              quantize_error_feedback=True)["ranks"]
    assert [r["model_states_by_role"]["quant_residual"] for r in ranks] == [4 * 1500.0] * 2


def test_gather_free_list_holds_no_more_than_was_in_flight():
    from hfzero.comm.quantized import _FreeList

    pool, cpu = _FreeList(), torch.device("cpu")
    first, second = pool.take(10, cpu), pool.take(20, cpu)  # two gathers in flight
    pool.give(first)
    pool.give(second)
    larger = pool.take(30, cpu)  # none fits: the smallest free one goes, one is allocated
    assert pool.allocations == 3 and pool.nbytes() == 20 + 30
    reused = pool.take(15, cpu)  # the 20-byte one fits
    assert reused is second and pool.allocations == 3
    pool.give(larger)
    pool.give(reused)
    assert pool.nbytes() == 50


def test_quantized_gradients_under_tensor_parallelism(results):
    """qgZ over TP's dp groups (ranks TP apart, one per node: the inter-node hop only), stages 2 and 3: losses within
    quantization error of the unquantized TP run (and not equal to it), each step's inter-node bytes equal to the
    per-bucket model (the clip norm's all-reduce aside) and to the estimator's (block 8: chunks are whole blocks)."""
    for rank, r in enumerate(results):
        for stage in (2, 3):
            plain, quantized = r["tp"][stage, None], r["tp"][stage, "int8"]
            assert quantized["dp_ranks"] == [rank % TP, rank % TP + TP] and quantized["hops"] == (1, WORLD // PER_NODE)
            assert plain["losses"] != quantized["losses"]
            for got, want in zip(quantized["losses"], plain["losses"]):
                assert math.isclose(got, want, rel_tol=TP_RTOL), (stage, quantized["losses"], plain["losses"])
            for run in (plain, quantized):
                moved = [sum(v for k, v in step.items() if k != "all_reduce") for step in run["inter"]]
                assert set(moved) == {run["layout_inter"]}, (stage, moved, run["layout_inter"])
                assert run["layout_inter"] == pytest.approx(run["estimate_inter"], rel=1e-3)  # measured: equal
            assert quantized["inter"][0].get("all_to_all", 0) > 0 and "reduce_scatter" not in {
                k for k, v in quantized["inter"][0].items() if v}


def test_error_feedback_residuals_resume_bitwise(results):
    for rank, r in enumerate(results):
        out = r["resume"]
        buckets = {key.split("/")[0] for key in out["saved_keys"]}  # each bucket's two hops (nodes of 2 of 4 ranks)
        assert out["saved_keys"] == sorted(f"{b}/{hop}" for b in buckets for hop in ("inter", "intra")), out
        assert out["restored"], rank
        assert out["resumed"] == out["uninterrupted"] and out["resumed_params_equal"], (rank, out)
        assert not out["control_params_equal"], rank  # the residuals matter: without them the run differs
        assert out["reshard_residual_bytes"] == 0, rank
        expected = 1 if rank == 0 else 0  # one warning, on rank 0
        assert len(out["reshard_warnings"]) == expected and all(
            "layout differs" in w and "dropped" in w for w in out["reshard_warnings"]), (rank, out["reshard_warnings"])
