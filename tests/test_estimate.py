"""The paper's memory model (hfzero.planning.estimate) against its Table 1 and Table 2, Ψ counted from HF configs,
the activation estimate against the paper's GPT-2 example, and the ``hfzero estimate`` command line."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, GPT2Config, ViTConfig

from hfzero.planning import estimate as est
from hfzero.cli import main

GB = 1e9

# --------------------------------------------------------------------------------------------------
# Table 1: per-device model-state memory (GB) by DP degree, stages 1-3, as printed in the paper.
# --------------------------------------------------------------------------------------------------

TABLE1_MODELS = (7.5e9, 128e9, 1e12)
TABLE1 = {
    1: ("120", "120", "120", "2048", "2048", "2048", "16000", "16000", "16000"),
    4: ("52.5", "41.3", "30", "896", "704", "512", "7000", "5500", "4000"),
    16: ("35.6", "21.6", "7.5", "608", "368", "128", "4750", "2875", "1000"),
    64: ("31.4", "16.6", "1.88", "536", "284", "32", "4187", "2218", "250"),
    256: ("30.4", "15.4", "0.47", "518", "263", "8", "4046", "2054", "62.5"),
    1024: ("30.1", "15.1", "0.12", "513", "257", "2", "4011", "2013", "15.6"),
}


def _last_digit_unit(printed: str) -> float:
    """One unit in the last printed place: 1 for "4187", 0.1 for "52.5", 0.01 for "1.88"."""
    return 10.0 ** -len(printed.split(".")[1]) if "." in printed else 1.0


def _table1_cases() -> list[tuple[int, float, int, str]]:
    return [(dp, TABLE1_MODELS[i // 3], i % 3 + 1, cell) for dp, row in TABLE1.items() for i, cell in enumerate(row)]


@pytest.mark.parametrize(("dp", "num_params", "stage", "printed"), _table1_cases())
def test_table1_cell(dp: int, num_params: float, stage: int, printed: str) -> None:
    # The paper rounds some cells (41.25 -> 41.3) and truncates others (4187.5 -> 4187, 2218.75 -> 2218),
    # so the exact value lies within one unit of the last printed digit; a relative 1% band would
    # be looser than that for the 4-digit cells (1% of 4187 is 42 GB) and tighter for "0.12" (0.117).
    # One unit still separates neighbouring stages everywhere (e.g. 12/N_d vs 14/N_d at N_d = 4).
    got = est.model_states_bytes(num_params, dp, stage) / GB
    assert abs(got - float(printed)) < _last_digit_unit(printed), (dp, num_params, stage, got, printed)


@pytest.mark.parametrize("dp", [1, 4, 64, 1024])
def test_stage0_is_16_psi_whatever_the_dp_degree(dp: int) -> None:
    assert est.model_states_bytes(7.5e9, dp, 0) == 16 * 7.5e9


# --------------------------------------------------------------------------------------------------
# Table 2: largest model that fits a 32 GB V100 with N_d = 64, theoretical columns.
# --------------------------------------------------------------------------------------------------

TABLE2 = {  # MP: (baseline, P_os, P_os+g, P_os+g+p)
    1: ("2B", "7.6B", "14.4B", "128B"),
    2: ("4B", "15.2B", "28.8B", "256B"),
    4: ("8B", "30.4B", "57.6B", "0.5T"),
    8: ("16B", "60.8B", "115.2B", "1T"),
    16: ("32B", "121.6B", "230.4B", "2T"),
}


def _count(printed: str) -> float:
    return float(printed[:-1]) * {"B": 1e9, "T": 1e12}[printed[-1]]


@pytest.mark.parametrize(("mp", "stage", "printed"),
                         [(mp, stage, cell) for mp, row in TABLE2.items() for stage, cell in enumerate(row)])
def test_table2_theoretical_column(mp: int, stage: int, printed: str) -> None:
    # The paper scales its MP = 1 row (7.64B printed as 7.6B) by MP and writes 512B, 1024B and 2048B
    # as 0.5T, 1T and 2T, so its cells sit up to 2.4% from the formula: compare within 2.5%.
    got = est.max_params(32e9, 64, stage, mp=mp)
    assert got == pytest.approx(_count(printed), rel=0.025), (mp, stage, got)


@pytest.mark.parametrize("stage", est.STAGES)
@pytest.mark.parametrize(("kwargs"), [
    {},
    {"mp": 4, "param_bytes": 4, "grad_bytes": 4, "optimizer_k": 8},
    {"persistent_params": 2e8},
    {"offload_optimizer": True, "persistent_params": 5e7, "mp": 2},
])
def test_max_params_is_the_inverse_of_model_states_bytes(stage: int, kwargs: dict) -> None:
    fitted = est.max_params(32e9, 16, stage, **kwargs)
    assert est.model_states_bytes(fitted, 16, stage, **kwargs) == pytest.approx(32e9, rel=1e-12)


def test_max_params_is_zero_when_persistent_parameters_alone_do_not_fit() -> None:
    assert est.max_params(1e9, 64, 3, persistent_params=1e9) == 0.0


# --------------------------------------------------------------------------------------------------
# Precision, persistence, offload, stage choice, input checks.
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "optimizer", "expected"), [
    ("bf16", "adam", (2, 2, 12)), ("fp16", "adamw", (2, 2, 12)), ("bf16", "sgd_momentum", (2, 2, 8)),
    ("fp16", "sgd", (2, 2, 4)), ("fp32", "adam", (4, 4, 8)), ("fp32", "sgd_momentum", (4, 4, 4)),
    ("fp32", "sgd", (4, 4, 0)),
])
def test_precision_bytes(dtype: str, optimizer: str, expected: tuple[int, int, int]) -> None:
    assert tuple(est.precision_bytes(dtype, optimizer)) == expected


@pytest.mark.parametrize(("dtype", "optimizer"), [("fp8", "adam"), ("bf16", "lion")])
def test_precision_bytes_rejects_unknown_names(dtype: str, optimizer: str) -> None:
    with pytest.raises(est.EstimateError, match="unknown"):
        est.precision_bytes(dtype, optimizer)


def test_fp32_adam_stage_formulas() -> None:
    p, g, k = est.precision_bytes("fp32", "adam")
    psi, n = 1e9, 8
    expected = [16 * psi, 8 * psi + 8 * psi / n, 4 * psi + 12 * psi / n, 16 * psi / n]
    got = [est.model_states_bytes(psi, n, s, param_bytes=p, grad_bytes=g, optimizer_k=k) for s in est.STAGES]
    assert got == pytest.approx(expected, rel=1e-12)


def test_mp_divides_psi() -> None:
    assert est.model_states_bytes(8e9, 4, 2, mp=8) == pytest.approx(est.model_states_bytes(1e9, 4, 2), rel=1e-12)


def test_persistent_parameters_cost_full_parameter_bytes_at_stage3_only() -> None:
    psi, persistent, n = 1e9, 1e8, 10
    got = est.model_states_breakdown(psi, n, 3, persistent_params=persistent)
    assert got.params == pytest.approx(2 * ((psi - persistent) / n + persistent))
    assert (got.grads, got.optimizer) == pytest.approx((2 * psi / n, 12 * psi / n))
    for stage in (0, 1, 2):
        assert est.model_states_bytes(psi, n, stage, persistent_params=persistent) == est.model_states_bytes(psi, n, stage)
    with pytest.raises(est.EstimateError, match="exceeds"):
        est.model_states_bytes(psi, n, 3, persistent_params=2 * psi)


@pytest.mark.parametrize("stage", est.STAGES)
def test_offload_moves_the_k_part_and_from_stage_2_the_fp32_gradients_to_the_host(stage: int) -> None:
    psi, n = 7.5e9, 64
    device = est.model_states_bytes(psi, n, stage, offload_optimizer=True)
    cpu = est.model_states_cpu_bytes(psi, n, stage, offload_optimizer=True)
    grads_moved = 2 * psi / n if stage >= 2 else 0.0  # bf16 gradient shard leaves the device ...
    assert device == pytest.approx(est.model_states_bytes(psi, n, stage) - 12 * psi / (n if stage >= 1 else 1)
                                   - grads_moved, rel=1e-12)
    assert cpu == pytest.approx(12 * psi / (n if stage >= 1 else 1) + 2 * grads_moved)  # ... and lands in fp32
    assert est.model_states_cpu_bytes(psi, n, stage) == 0.0
    # fp32: the device parameters were their own master; offloaded, the host steps an fp32 copy of the slice
    fp32 = dict(param_bytes=4, grad_bytes=4, optimizer_k=8, offload_optimizer=True)
    assert est.model_states_cpu_bytes(psi, n, 1, **fp32) == pytest.approx((8 + 4) * psi / n)
    # a "local" accumulator stays on the device
    local = est.model_states_bytes(psi, n, 2, offload_optimizer=True, accumulation="local", accumulation_steps=4)
    assert local == pytest.approx(2 * psi + 2 * psi)


def test_choose_stage_picks_the_smallest_stage_that_fits() -> None:
    # 7.5B on N_d = 64: stage 1 needs 31.4 GB, stage 2 16.6 GB.
    assert est.choose_stage(7.5e9, 64, 32e9, headroom=0.0) == 1
    assert est.choose_stage(7.5e9, 64, 32e9, headroom=0.2) == 2  # 25.6 GB budget
    assert est.choose_stage(7.5e9, 64, 32e9, headroom=0.0, reserved_bytes=20e9) == 3
    assert est.choose_stage(1e9, 64, 32e9) == 0
    with pytest.raises(est.EstimateError, match="no ZeRO stage fits"):
        est.choose_stage(1e12, 64, 32e9)


@pytest.mark.parametrize(("args", "kwargs", "message"), [
    ((1e9, 0, 1), {}, "dp"), ((1e9, 2, 4), {}, "stage"), ((1e9, 2, 1), {"mp": 0}, "mp"),
    ((-1.0, 2, 1), {}, "num_params"), ((float("nan"), 2, 1), {}, "num_params"),
])
def test_invalid_inputs_raise(args: tuple, kwargs: dict, message: str) -> None:
    with pytest.raises(est.EstimateError, match=message):
        est.model_states_bytes(*args, **kwargs)


# --------------------------------------------------------------------------------------------------
# Ψ from Hugging Face configs.
# --------------------------------------------------------------------------------------------------


def _tiny_gpt2() -> GPT2Config:
    return GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=500, n_positions=64)


def test_params_from_gpt2_config_counts_tied_embeddings_once(tmp_path) -> None:
    config = _tiny_gpt2()
    config.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_config(config)
    expected = sum(p.numel() for p in set(model.parameters()))
    assert model.lm_head.weight is model.transformer.wte.weight  # the case the dedup is for
    assert est.params_from_config(tmp_path) == expected
    assert est.params_from_config(tmp_path / "config.json") == expected
    assert est.params_from_config(config) == expected


def test_params_from_config_falls_back_to_auto_model(tmp_path) -> None:
    config = ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                       image_size=32, patch_size=8)
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError):
        AutoModelForCausalLM.from_config(config)
    expected = sum(p.numel() for p in set(AutoModel.from_config(config).parameters()))
    assert est.params_from_config(tmp_path) == expected


def test_params_from_config_never_allocates_weights(monkeypatch) -> None:
    counted = []
    original = est.count_params
    monkeypatch.setattr(est, "count_params", lambda m: counted.append(next(m.parameters()).device) or original(m))
    est.params_from_config(_tiny_gpt2())
    assert counted == [torch.device("meta")]


@pytest.mark.parametrize(("content", "message"), [
    (None, "not found"), ("{not json", "as JSON"), ('{"hidden_size": 4}', "model_type"),
    ('{"model_type": "no_such_model"}', "no_such_model"),
])
def test_unreadable_configs_raise_a_clear_error(tmp_path, content: str | None, message: str) -> None:
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(est.EstimateError, match=message):
        est.params_from_config(path)


# --------------------------------------------------------------------------------------------------
# Activation estimate.
# --------------------------------------------------------------------------------------------------

GPT2_1_5B = est.TransformerShape(hidden_size=1600, num_layers=48, num_heads=25, vocab_size=50257, ffn_size=6400)


def test_shape_from_gpt2_config() -> None:
    config = GPT2Config(n_embd=1600, n_layer=48, n_head=25)
    assert est.TransformerShape.from_hf_config(config) == GPT2_1_5B


def test_shape_requires_a_transformer_config() -> None:
    config = ViTConfig()  # an encoder without a vocabulary
    with pytest.raises(est.EstimateError, match="vocab_size"):
        est.TransformerShape.from_hf_config(config)


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_layer_bytes_match_korthikanti_closed_form(tp: int) -> None:
    s, b, h, a = 1024, 32, 1600, 25
    expected = s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))  # 34 + 5as/h at tp = 1
    assert est.layer_activation_bytes(GPT2_1_5B, s, b, tp=tp) == pytest.approx(expected, rel=1e-12)
    fused = est.layer_activation_bytes(GPT2_1_5B, s, b, tp=tp, fused_attention=True)
    assert fused == pytest.approx(s * b * h * (10 + 24 / tp), rel=1e-12)


def test_checkpointing_keeps_layer_inputs_plus_one_working_set() -> None:
    s, b = 1024, 32
    full = est.activation_bytes(GPT2_1_5B, s, b)
    ckpt = est.activation_bytes(GPT2_1_5B, s, b, checkpointing=True)
    assert ckpt.layers == pytest.approx(48 * 2 * s * b * 1600 + full.per_layer)
    assert full.layers == pytest.approx(48 * full.per_layer)
    assert ckpt.head == full.head and ckpt.total == pytest.approx(ckpt.layers + ckpt.head)


def test_activation_estimate_against_the_papers_gpt2_example() -> None:
    # The paper: GPT-2 1.5B, sequence 1K, batch 32 needs ~60 GB of activations, ~8 GB with
    # checkpointing. The paper counts 12*h*b*s*L 16-bit values (no attention-score term), so we
    # compare our fused-attention estimate (also without s x s scores) and accept a factor of 2
    # either way: measured 92.4 GB (1.54x) and 13.7 GB (1.71x), the excess being Korthikanti's
    # fuller per-layer count (34 vs 24 bytes per s*b*h) and the fp32 logits (6.6 GB) the paper
    # leaves out. With attention scores stored the estimate is 294 GB / 17.9 GB: the 5as/h term
    # (80 of 114 bytes per s*b*h here) that the paper's count omits.
    full = est.activation_bytes(GPT2_1_5B, 1024, 32, fused_attention=True)
    ckpt = est.activation_bytes(GPT2_1_5B, 1024, 32, fused_attention=True, checkpointing=True)
    assert 0.5 <= full.total / 60e9 <= 2.0, full.total
    assert 0.5 <= ckpt.total / 8e9 <= 2.0, ckpt.total
    eager = est.activation_bytes(GPT2_1_5B, 1024, 32)
    assert eager.total > full.total > ckpt.total


# --------------------------------------------------------------------------------------------------
# The ``hfzero estimate`` command line (in-process).
# --------------------------------------------------------------------------------------------------


def _run_json(capsys, *argv: str) -> dict:
    assert main(["estimate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_json_model_states(capsys) -> None:
    out = _run_json(capsys, "--params", "7.5e9", "--dp", "64")
    assert set(out["model_states_bytes"]) == {"0", "1", "2", "3"}
    for stage in est.STAGES:
        assert out["model_states_bytes"][str(stage)] == est.model_states_bytes(7.5e9, 64, stage)
    assert (out["params"], out["dp"], out["mp"], out["dtype"], out["optimizer"]) == (7.5e9, 64, 1, "bf16", "adam")


def test_cli_json_max_params(capsys) -> None:
    out = _run_json(capsys, "--memory", "32e9", "--dp", "64", "--mp", "1")
    assert out["max_params"]["0"] == pytest.approx(2e9) and out["max_params"]["3"] == pytest.approx(128e9)
    assert set(out["max_params"]) == {"0", "1", "2", "3"} and out["memory"] == 32e9
    assert "model_states_bytes" not in out


def test_cli_json_options(capsys) -> None:
    out = _run_json(capsys, "--params", "1e9", "--dp", "4", "--mp", "2", "--dtype", "fp32", "--optimizer", "sgd",
                    "--offload-optimizer", "--memory", "40e9")
    assert out["bytes_per_param"] == {"param_bytes": 4, "grad_bytes": 4, "optimizer_k": 0}
    assert out["model_states_bytes"]["1"] == pytest.approx(4e9)  # (4 + 4) * 1e9 / 2
    # sgd has no state, but offloaded the host steps an fp32 master copy of the slice: 4 * 1e9 / 2 / 4
    assert out["model_states_cpu_bytes"]["1"] == pytest.approx(0.5e9) and out["auto_stage"] == 0


def test_cli_config_and_activations(capsys, tmp_path) -> None:
    _tiny_gpt2().save_pretrained(tmp_path)
    out = _run_json(capsys, "--config", str(tmp_path), "--dp", "2", "--seq-len", "64", "--batch-size", "4",
                    "--checkpointing")
    assert out["params"] == est.params_from_config(tmp_path)
    shape = est.DecoderShape.from_hf_config(tmp_path)
    expected = est.decoder_activation_bytes(shape, 64, 4, checkpointing=True)
    assert out["activations"]["total_bytes"] == pytest.approx(expected.total)
    assert out["activations"]["checkpointing"] is True
    paper = est.activation_bytes(est.TransformerShape.from_hf_config(tmp_path), 64, 4, checkpointing=True,
                                 fused_attention=True)  # sdpa, the default attention
    assert out["activations"]["korthikanti_total_bytes"] == pytest.approx(paper.total)
    out = _run_json(capsys, "--config", str(tmp_path), "--seq-len", "64", "--batch-size", "4", "--checkpointing",
                    "--tp", "2", "--partition-activations", "--cpu-checkpointing", "--attention", "eager")
    expected = est.decoder_activation_bytes(shape, 64, 4, checkpointing=True, tp=2, partition=True, cpu=True,
                                            attention="eager")
    assert out["activations"]["checkpoint_bytes"] == 0
    assert expected.checkpoints_host > 0
    assert out["activations"]["checkpoint_host_bytes"] == pytest.approx(expected.checkpoints_host)
    assert out["activations"]["total_bytes"] == pytest.approx(expected.total)


def test_cli_table(capsys) -> None:
    assert main(["estimate", "--params", "7.5e9", "--dp", "64", "--memory", "32e9"]) == 0
    text = capsys.readouterr().out
    for figure in ("120.00", "31.41", "16.64", "1.88", "128.00B"):
        assert figure in text
    assert "smallest stage that fits 32 GB with 20% headroom: 2 (P_os+g)" in text


@pytest.mark.parametrize(("argv", "message"), [
    (["--params", "0"], "--params must be a number > 0"),
    (["--params=-7.5e9"], "--params must be a number > 0"),
    (["--params", "1e9", "--dp", "0"], "--dp must be an integer > 0"),
    (["--params", "1e9", "--dp", "-4"], "--dp must be an integer > 0"),
    (["--params", "1e9", "--config", "x"], "either --params or --config"),
    ([], "give the model size"),
    (["--config", "/no/such/dir"], "not found"),
    (["--params", "1e9", "--seq-len", "8", "--batch-size", "1"], "needs the model's shape"),
    (["--params", "1e9", "--dtype", "fp8"], "unknown dtype"),
    (["--params", "1e9", "--partition-activations"], "need --seq-len and --batch-size"),
])
def test_cli_bad_input_is_one_line_and_exit_2(capsys, argv: list[str], message: str) -> None:
    assert main(["estimate", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and message in captured.err and "Traceback" not in captured.err


def test_cli_activation_options_need_checkpointing_and_tp(capsys, tmp_path) -> None:
    _tiny_gpt2().save_pretrained(tmp_path)
    shape = ["--config", str(tmp_path), "--seq-len", "8", "--batch-size", "1"]
    for extra, message in ((["--cpu-checkpointing"], "enable checkpointing too"),
                           (["--checkpointing", "--partition-activations"], "nothing to partition"),
                           (["--device", "tpu"], "--device must be cuda or cpu")):
        assert main(["estimate", *shape, *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


def test_cli_corrupt_config_is_one_line_and_exit_2(capsys, tmp_path) -> None:
    (tmp_path / "config.json").write_text("{corrupt")
    assert main(["estimate", "--config", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "as JSON" in err


def test_accumulation_policy_in_the_memory_model_and_communication():
    """"local" accumulation at stages 2-3 holds a full gradient buffer (g bytes per parameter) across the
    micro-batches; "sharded" keeps the stage's formula but reduces every micro-batch."""
    psi, n = 1e9, 8
    for stage in (0, 1):
        assert est.model_states_bytes(psi, n, stage, accumulation_steps=4, accumulation="local") == \
            est.model_states_bytes(psi, n, stage)
    for stage in (2, 3):
        base = est.model_states_bytes(psi, n, stage)
        assert est.model_states_bytes(psi, n, stage, accumulation_steps=4) == base  # auto = sharded
        assert est.model_states_bytes(psi, n, stage, accumulation_steps=4, accumulation="local") == base + 2 * psi
        assert est.model_states_bytes(psi, n, stage, accumulation_steps=1, accumulation="local") == base
    comm = functools.partial(est.comm_elements_per_step, psi, n, accumulation_steps=4)
    assert comm(0) == 2 * psi and comm(0, accumulation="sharded") == 8 * psi
    assert comm(1) == 2 * psi and comm(2) == 5 * psi and comm(2, accumulation="local") == 2 * psi
    assert comm(3) == 12 * psi and comm(3, accumulation="local") == 9 * psi
    assert est.comm_elements_per_step(psi, 1, 2, accumulation_steps=4) == 0  # one rank moves nothing
    with pytest.raises(est.EstimateError, match="accumulation"):
        est.model_states_bytes(psi, n, 2, accumulation="bogus")
def test_frozen_parameters_count_parameter_bytes_only(capsys: pytest.CaptureFixture[str]) -> None:
    """A LoRA fine-tune: 4M trainable + 7B frozen, bf16 + Adam, N_d = 8: frozen weights add 2 bytes each,
    whole at stages 0-2 and /N_d at stage 3 (also through `hfzero estimate --frozen-params`)."""
    psi, frozen = 4e6, 7e9
    for stage in (0, 1, 2):
        assert est.model_states_bytes(psi, 8, stage, frozen_params=frozen) == est.model_states_bytes(psi, 8, stage) + 2 * frozen
    assert est.model_states_bytes(psi, 8, 3, frozen_params=frozen) == pytest.approx(16 * psi / 8 + 2 * frozen / 8)
    assert main(["estimate", "--params", "4e6", "--frozen-params", "7e9", "--dp", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model_states_bytes"]["3"] == pytest.approx(16 * psi / 8 + 2 * frozen / 8)
    with pytest.raises(est.EstimateError, match="persistent_params"):
        est.model_states_bytes(psi, 8, 3, frozen_params=1, persistent_params=psi + 2)


def test_pipeline_estimate_splits_traffic_by_node_and_refuses_bad_layouts(capsys):
    """``--pp`` with ``--nodes`` / ``--shard-size``: flat stage 2 over 4 dp ranks on nodes of 2 crosses nodes on
    half its ring hops; HSDP with shard groups inside a node sends only the replicate all-reduce across."""
    import json

    assert main(["estimate", "--params", "1e6", "--pp", "2", "--dp", "4", "--nodes", "4", "--stage", "2",
                 "--accumulation", "sharded", "--micro", "2", "--json"]) == 0
    (flat,) = json.loads(capsys.readouterr().out)
    for rank in flat["ranks"]:  # reduce-scatter per micro-batch + all-gather: 3 x 5e5, half of it inter-node
        assert sum(rank["comm_elements_per_step"].values()) == pytest.approx(1.5e6)
        assert rank["inter_node_elements_per_step"] == pytest.approx(0.75e6)
    assert main(["estimate", "--params", "1e6", "--pp", "2", "--dp", "4", "--nodes", "4", "--shard-size", "2",
                 "--stage", "2", "--accumulation", "sharded", "--micro", "2", "--json"]) == 0
    (hsdp,) = json.loads(capsys.readouterr().out)
    for rank in hsdp["ranks"]:  # only the replicate all-reduce of the 2.5e5 shard, 2n, crosses
        assert rank["inter_node_elements_per_step"] == pytest.approx(2 * 5e5 / 2)
    assert main(["estimate", "--params", "1e6", "--pp", "2", "--dp", "4", "--nodes", "3"]) == 2
    assert "--nodes 3 must be a positive integer dividing" in capsys.readouterr().err
    assert main(["estimate", "--params", "1e6", "--pp", "2", "--dp", "4", "--shard-size", "3"]) == 2
    assert "--shard-size 3 must divide --dp 4" in capsys.readouterr().err
