"""Sequence parallelism (Ulysses attention) x ZeRO: sp2 x dp2 on 4 gloo ranks, fp32, against a single-process
reference of DDP on 2 ranks with the same global batch (each dp replica's mean loss, gradients averaged over
the 2 replicas). Losses and parameters after SGD(lr=1) steps (so parameter differences are gradient
differences) within 1e-5, stages 0-3, with activation checkpointing, with key/value heads replicated
(1 kv head over 2 ranks), with tiled logits + loss (3 tiles of each rank's 8 positions, stage 3) and with a
sequence length not divisible by sp (padded, loss unchanged); each rank's
measured activations against the estimator's sp model. One spawn; the bad-input cases run in this process.
"""

from __future__ import annotations

import os

import pytest
import torch

import hfzero
from hfzero.config import ConfigError
from hfzero.roles import MemoryRole
from hfzero.runtime.activations.checkpoint import FORCE_ENV
from hfzero.parallel.sequence import kv_replication, prepare_sequence_parallel, shift_labels, split_batch
from hfzero.testing import run_distributed
from hfzero.testing.workloads import _full_params

STEPS, ROWS, VOCAB = 3, 2, 128  # ROWS: samples per dp replica
CASES = {  # name: (stage, checkpointing, kv heads, sequence length, loss tiles, mlp tiles, checkpoints via host)
    "stage0": (0, False, 2, 16, 1, 1, False),
    "stage1": (1, False, 2, 16, 1, 1, False),
    "stage2": (2, False, 2, 16, 1, 1, False),
    "stage3": (3, False, 2, 16, 1, 1, False),
    "stage3_checkpointing_tiled_loss": (3, True, 2, 16, 3, 1, False),
    "stage3_cpu_checkpoints_tiled_mlp_and_loss": (3, True, 2, 16, 2, 3, True),
    "stage2_kv1_odd_length": (2, False, 1, 15, 1, 1, False),
}


def _llama(kv_heads: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                         tie_word_embeddings=True, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).float().train()
    model.config.use_cache = False
    return model


def _batches(seq: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (2 * ROWS, seq), generator=g) for _ in range(STEPS)]


def _reference(kv_heads: int, seq: int) -> tuple[list[list[float]], list[dict[str, torch.Tensor]]]:
    """DDP on 2 ranks, in one process: per replica losses, parameters after each step."""
    model = _llama(kv_heads)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    losses, params = [], []
    for batch in _batches(seq):
        step = []
        for replica in batch.chunk(2):
            loss = model(input_ids=replica, labels=replica).loss
            (loss / 2).backward()
            step.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step)
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return losses, params


def _sequence_parallel(rank: int, stage: int, checkpointing: bool, kv_heads: int, seq: int, tiles: int,
                       mlp_tiles: int, host: bool):
    os.environ[FORCE_ENV] = "1" if host else "0"  # host: the checkpoints take the offload path (a CPU device)
    model = _llama(kv_heads)
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    config = hfzero.ZeroConfig(stage=stage, sp_size=2, param_persistence_threshold=0, loss_tiles=tiles,
                               mlp_tiles=mlp_tiles, cpu_checkpointing=host)
    model, optimizer, mesh = prepare_sequence_parallel(model, torch.optim.SGD(model.parameters(), lr=1.0), config)
    assert (mesh.dp_rank, mesh.sp_rank) == divmod(rank, 2)
    engine = hfzero.get_engine(model)
    losses, params, held = [], [], []
    for batch in _batches(seq):
        replica = batch.chunk(mesh.dp_size)[mesh.dp_rank]
        loss = model(**split_batch({"input_ids": replica}, mesh.sp_rank, mesh.sp_size)).loss
        held.append(model.hfzero_checkpoint.stored.live)  # the checkpoints held after the forward
        optimizer.backward(loss)
        staging = engine.memory_by_role().get(MemoryRole.GRAD_BUCKET, 0)  # stage 3's gradient staging pool
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        params.append(_full_params(model, engine))
    attention = next(m.hfzero_sequence for m in model.modules() if hasattr(m, "hfzero_sequence"))
    os.environ.pop(FORCE_ENV)
    return {"losses": losses, "params": params, "average_over": engine.average_over,
            "all_to_alls": attention.comm.stats()["all_to_all"].calls, "held": held,
            "hosted": len(model.hfzero_checkpoint._host_buffers), "prefetches": model.hfzero_checkpoint.prefetches,
            "config": model.config.to_dict(), "staging": staging}


def _measured_activations(rank: int, root: str) -> dict:
    """One profiled step of a Llama (h=128, 2 kv heads) at seq 15 (padded to 16), without and with
    checkpointing: this rank's saved-tensor roles."""
    from hfzero.profiler import ZeroProfiler, load_run
    from hfzero.testing.models import tiny_causal_lm

    out = {}
    for checkpointing in (False, True):
        model = tiny_causal_lm("llama", hidden=128, layers=2, vocab=VOCAB).train()
        model.set_attn_implementation("sdpa")
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model, optimizer, mesh = prepare_sequence_parallel(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                           hfzero.ZeroConfig(stage=0, sp_size=2))
        ids = _batches(15)[0].chunk(mesh.dp_size)[mesh.dp_rank]
        with ZeroProfiler(model, optimizer, f"{root}/{checkpointing}"):
            optimizer.backward(model(**split_batch({"input_ids": ids}, mesh.sp_rank, mesh.sp_size)).loss)
            optimizer.step()
            optimizer.zero_grad()
        torch.distributed.barrier()  # every rank's file is complete
        step = load_run(f"{root}/{checkpointing}").ranks[rank].of_kind("step")[0]
        out[checkpointing] = step["roles"]
        out["coords"] = (step["dp_rank"], step["sp_rank"], "all_to_all" in step["comm"])
        out["config"] = model.config.to_dict()
    return out


def _worker(rank: int, world_size: int, root: str) -> dict:
    runs = {name: _sequence_parallel(rank, *case) for name, case in CASES.items()}
    runs["activations"] = _measured_activations(rank, root)
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_distributed(_worker, 4, str(tmp_path_factory.mktemp("sp_profiles")))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_sp2_dp2_matches_ddp_on_two_ranks(runs: list[dict], name: str) -> None:
    _, _, kv_heads, seq, *_ = CASES[name]
    want_losses, want_params = _reference(kv_heads, seq)
    for rank, run in enumerate(runs):
        got = run[name]
        assert got["average_over"] == 2
        # 2 layers x (q, k, v, out) forward + backward, x 1.5 with the recompute of checkpointing, per step
        assert got["all_to_alls"] == STEPS * 2 * 8 * (1.5 if CASES[name][1] else 1)
        replica = rank // 2
        for step in range(STEPS):
            assert got["losses"][step] == pytest.approx(want_losses[step][replica], abs=1e-5), (rank, step)
            for param, value in want_params[step].items():
                torch.testing.assert_close(got["params"][step][param], value, atol=1e-5, rtol=0,
                                           msg=f"{name} rank {rank} step {step} {param}")


@pytest.mark.slow
def test_checkpoints_offloaded_under_sp_hold_one_chunk(runs: list[dict]) -> None:
    """cpu_checkpointing under SP (the host path forced on this CPU device): every rank's checkpoints went
    through host buffers (one per layer, prefetched ahead of their recomputation) and the ACT_CHECKPOINT role
    holds one layer input per layer of the rank's 8 of 16 positions, the estimator's checkpoints_host."""
    from transformers import LlamaConfig

    from hfzero.planning import estimate as est

    name = "stage3_cpu_checkpoints_tiled_mlp_and_loss"
    for run in runs:
        got = run[name]
        shape = est.DecoderShape.from_hf_config(LlamaConfig(**got["config"]))
        assert got["hosted"] == shape.num_layers and got["prefetches"] == STEPS * (shape.num_layers - 1)
        predicted = est.decoder_activation_bytes(shape, 16, ROWS, dtype="fp32", device="cpu", sp=2,
                                                 checkpointing=True, cpu=True)
        layer_inputs = shape.num_layers * ROWS * 8 * shape.hidden_size * 4  # L x B x T/S x h, fp32
        assert predicted.checkpoints == 0 and predicted.checkpoints_host >= layer_inputs
        assert got["held"] == [layer_inputs] * STEPS, got["held"]


@pytest.mark.slow
def test_measured_activations_match_the_estimator_with_sp(runs: list[dict]) -> None:
    """Each rank saves what the decoder activation model predicts for sp=2 (its 8 of 16 positions; attention
    on 2 of 4 heads of all 16): exact without checkpointing; with it, checkpoints + the rest within 10% (the
    tolerance tests/test_activations.py gives the unsplit model)."""
    from transformers import LlamaConfig

    from hfzero.planning import estimate as est

    for run in runs:
        measured = run["activations"]
        shape = est.DecoderShape.from_hf_config(LlamaConfig(**measured["config"]))
        plain, ckpt = (est.decoder_activation_bytes(shape, 15, ROWS, dtype="fp32", attention="sdpa", device="cpu",
                                                    sp=2, checkpointing=c) for c in (False, True))
        assert measured[False]["activations"] == plain.saved
        assert measured[True]["activations"] + measured[True]["act_checkpoint"] == pytest.approx(ckpt.saved, rel=0.10)
        assert measured[True]["activations"] == ckpt.head
    # the records carry the sp coordinate, and the SP all-to-alls count in the engine's comm statistics
    assert [run["activations"]["coords"] for run in runs] == [(r // 2, r % 2, True) for r in range(4)]


@pytest.mark.slow
def test_stage3_gradient_staging_matches_the_estimator(runs: list[dict]) -> None:
    """Stage 3 under SP: the GRAD_BUCKET pool after a backward is estimate.stage3_grad_staging_bytes (fp32, 4
    ranks, every parameter in a unit: persistence threshold 0: the root and both layers), up to bucket padding
    (< world elements per bucket; measured: none)."""
    from transformers import LlamaConfig

    from hfzero.planning import estimate as est

    for name in ("stage3", "stage3_checkpointing_tiled_loss", "stage3_cpu_checkpoints_tiled_mlp_and_loss"):
        for run in runs:
            config = LlamaConfig(**run[name]["config"])
            root, units = est.stage3_unit_numels(config, persistence_threshold=0)
            bound = est.stage3_grad_staging_bytes(root, units, 4, grad_bytes=4)
            assert bound <= run[name]["staging"] <= bound + 4 * 4 * 3 * 4, (name, run[name]["staging"], bound)


def test_split_batch_shifts_on_the_whole_sequence_and_pads() -> None:
    ids = torch.arange(1, 8).reshape(1, 7)  # T = 7, sp = 2: padded to 8
    parts = [split_batch({"input_ids": ids}, r, 2, pad_token_id=0) for r in range(2)]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts], 1), torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]]))
    assert torch.equal(torch.cat([p["shift_labels"] for p in parts], 1),
                       torch.tensor([[2, 3, 4, 5, 6, 7, -100, -100]]))  # boundary target 5 kept on rank 0
    assert torch.equal(torch.cat([p["position_ids"] for p in parts], 1), torch.arange(8).reshape(1, 8))  # (1, T)
    assert all(int(p["num_items_in_batch"]) == 6 for p in parts)
    right = shift_labels(ids, torch.tensor([[1, 1, 1, 1, 1, 0, 0]]))
    assert torch.equal(right, torch.tensor([[2, 3, 4, 5, -100, -100, -100]]))
    with pytest.raises(ConfigError, match="right padding"):
        shift_labels(ids, torch.tensor([[0, 0, 1, 1, 1, 1, 1]]))
    with pytest.raises(ConfigError, match="cannot be split"):
        split_batch({"input_ids": ids, "token_type_ids": ids}, 0, 2)


def test_bad_sequence_parallel_configs_are_refused() -> None:
    assert kv_replication(4, 1, 2) == 2 and kv_replication(4, 2, 2) == 1 and kv_replication(8, 2, 4) == 2
    with pytest.raises(ConfigError, match="does not divide the 4 attention heads"):
        kv_replication(4, 2, 8)
    with pytest.raises(ConfigError, match="cannot be replicated"):
        kv_replication(6, 4, 3)
    with pytest.raises(ConfigError, match="tensor x sequence"):
        hfzero.ZeroConfig(sp_size=2, tp_size=2)
    with pytest.raises(ConfigError, match="sp_size"):
        hfzero.ZeroConfig(sp_size=0)
    with pytest.raises(ConfigError, match="partitioned over the SP group by construction"):
        hfzero.ZeroConfig(sp_size=2, partition_activations=True)
    model = _llama(2)
    with pytest.raises(ConfigError, match="prepare_sequence_parallel"):
        hfzero.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0), hfzero.ZeroConfig(sp_size=2))


def test_estimate_cli_sp(tmp_path, capsys) -> None:
    """`hfzero estimate --sp S`: one rank's activations of a sequence split over S ranks (decoders only)."""
    import json

    from transformers import LlamaConfig

    from hfzero.cli import main

    LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2).save_pretrained(tmp_path)
    figures = {}
    for sp in ("1", "4"):
        assert main(["estimate", "--config", str(tmp_path), "--seq-len", "4096", "--batch-size", "1",
                     "--checkpointing", "--sp", sp, "--json"]) == 0
        figures[sp] = json.loads(capsys.readouterr().out)["activations"]
    assert figures["4"]["sp"] == 4 and figures["4"]["checkpoint_bytes"] < figures["1"]["checkpoint_bytes"] / 3.9
    assert figures["4"]["head_bytes"] < figures["1"]["head_bytes"] / 3.9  # the logits of 1/4 of the positions


def test_tiled_loss_matches_the_model_loss() -> None:
    """One process, no SP: the loss and gradients of 4 tiles (of 15 positions: uneven) equal the model's own;
    a forward without labels is the model's (logits); loss_tiles must match the model at prepare."""
    from hfzero.parallel.sequence import enable_tiled_loss

    ids = _batches(15)[0]
    reference = _llama(2)
    want = reference(input_ids=ids, labels=ids).loss
    want.backward()
    model = _llama(2)
    enable_tiled_loss(model, 4)
    out = model(input_ids=ids, labels=ids)
    assert out.logits is None
    out.loss.backward()
    torch.testing.assert_close(out.loss, want, atol=1e-6, rtol=0)
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad, atol=1e-6, rtol=0, msg=name)
    assert model(input_ids=ids).logits.shape == (ids.shape[0], 15, VOCAB)
    with pytest.raises(ConfigError, match="loss_tiles=1 but the model's loss is tiled in 4"):
        hfzero.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0), hfzero.ZeroConfig())
    with pytest.raises(ConfigError, match="enable_tiled_loss"):
        plain = _llama(2)
        hfzero.prepare(plain, torch.optim.SGD(plain.parameters(), lr=1.0), hfzero.ZeroConfig(loss_tiles=2))


def test_tiled_loss_saves_no_logits(tmp_path) -> None:
    """Measured (the profiler's saved-tensor role): the untiled loss keeps the fp32 log-softmax of every
    position's logits (4 x B x T x V bytes) for backward; 4 tiles keep none of it across the forward."""
    from hfzero.profiler import ZeroProfiler, load_run
    from hfzero.parallel.sequence import enable_tiled_loss

    ids = _batches(15)[0]
    saved = {}
    for tiles in (1, 4):
        model = _llama(2)
        if tiles > 1:
            enable_tiled_loss(model, tiles)
        model, optimizer = hfzero.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0),
                                          hfzero.ZeroConfig(loss_tiles=tiles))
        with ZeroProfiler(model, optimizer, tmp_path / str(tiles)):
            optimizer.backward(model(input_ids=ids, labels=ids).loss)
            optimizer.step()
        saved[tiles] = load_run(tmp_path / str(tiles)).ranks[0].of_kind("step")[0]["roles"]["activations"]
    assert saved[1] - saved[4] >= 4 * ids.numel() * VOCAB - 16  # tiled keeps a scalar or two instead (the count)
